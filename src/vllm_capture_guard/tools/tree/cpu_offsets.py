# SPDX-License-Identifier: Apache-2.0
"""In-tree backport of vLLM PR #51585: ROCM_ATTN capture keeps the CPU offsets.

File: ``vllm/v1/attention/backends/rocm_attn.py``. In 0.27.x/0.28.0
``RocmAttentionMetadataBuilder.build_for_cudagraph_capture`` zeroes the device
``query_start_loc`` (the #25985 guard) and the host ``query_start_loc_cpu``;
0.29.0 zeroes only the device offsets. The edit removes the one statement that
zeroes the CPU offsets and puts our marker comment in its place.

Recognised, by structure (anything else is refused):

* the capture's metadata parameter (its second parameter, never reassigned)
  is used only for attribute reads, for the two zeroing statements, and as an
  argument of ``self.build(...)``; passing it anywhere else could write the
  offsets where we cannot see it;
* the CPU offsets are written by exactly one top-level statement of the
  capture, ``<param>.query_start_loc_cpu.zero_()`` (or ``.fill_(0)``), and
  ``query_start_loc_cpu`` (as an attribute or a string) appears nowhere else
  in the module;
* the device offsets are zeroed by one such statement on
  ``<param>.query_start_loc``, and the capture mentions them nowhere else.
"""

from __future__ import annotations

import ast
import dataclasses

from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.source import (
    PROJECT,
    Edit,
    Source,
    Unrecognised,
    body_without_docstring,
    contains,
    is_int,
    is_name,
    marker,
    mentions,
    walk_with_parents,
)

FIX = "rocm-attn-cpu-offsets"
PR = "#51585"
FILE = "v1/attention/backends/rocm_attn.py"  # inside the vllm package
CLASS = "RocmAttentionMetadataBuilder"
METHOD = "build_for_cudagraph_capture"
CPU = "query_start_loc_cpu"
DEVICE = "query_start_loc"
NOTE = "CPU offsets left alone"


@dataclasses.dataclass
class Capture:
    """The ROCm builder's capture as recognised (the AITER backport needs it)."""

    param: str
    device_zero: ast.stmt | None
    cpu_zero: ast.stmt | None


def zeroes(stmt: ast.stmt, param: str, field: str) -> bool:
    """``<param>.<field>.zero_()`` or ``<param>.<field>.fill_(0)``."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    call = stmt.value
    func = call.func
    if not isinstance(func, ast.Attribute) or call.keywords:
        return False
    if func.attr == "zero_":
        ok_args = not call.args
    elif func.attr == "fill_":
        ok_args = len(call.args) == 1 and is_int(call.args[0], 0)
    else:
        return False
    target = func.value
    return (
        ok_args
        and isinstance(target, ast.Attribute)
        and target.attr == field
        and is_name(target.value, param)
    )


def _is_self_build(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "build"
        and is_name(node.func.value, "self")
    )


def check_param_use(src: Source, fn: ast.FunctionDef, param: str) -> None:
    """The metadata parameter may be read from and handed to ``self.build``
    only (see the module docstring)."""
    for node, parent in walk_with_parents(fn):
        if not is_name(node, param):
            continue
        assert isinstance(node, ast.Name)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            raise Unrecognised(
                f"{src.rel}:{node.lineno}: {fn.name} rebinds its parameter {param}"
            )
        if isinstance(parent, ast.Attribute):
            continue
        if _is_self_build(parent):
            continue
        raise Unrecognised(
            f"{src.rel}:{node.lineno}: {fn.name} hands {param} to "
            f"`{src.text(parent or node)}`; cannot tell whether that writes the "
            f"offsets"
        )


def capture_params(src: Source, fn: ast.FunctionDef) -> str:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    if len(positional) < 2 or positional[0].arg != "self":
        raise Unrecognised(
            f"{src.rel}:{fn.lineno}: {fn.name} does not take (self, metadata)"
        )
    return positional[1].arg


def analyse(src: Source) -> tuple[ast.FunctionDef, Capture]:
    """Recognise the capture, or raise :class:`Unrecognised`."""
    cls = src.top_class(CLASS)
    fn = src.method(cls, METHOD)
    param = capture_params(src, fn)
    check_param_use(src, fn, param)
    body = body_without_docstring(fn.body)
    cpu = [s for s in body if zeroes(s, param, CPU)]
    device = [s for s in body if zeroes(s, param, DEVICE)]
    if len(cpu) > 1 or len(device) > 1:
        raise Unrecognised(
            f"{src.rel}: {CLASS}.{METHOD} zeroes the offsets more than once"
        )
    for node in mentions(src.module, CPU):
        if not (cpu and contains(cpu[0], node)):
            raise Unrecognised(
                f"{src.rel}:{node.lineno}: `{CPU}` is used outside the one "
                f"statement this fix recognises (`{param}.{CPU}.zero_()` in "
                f"{CLASS}.{METHOD})"
            )
    for node in mentions(fn, DEVICE):
        if not (device and contains(device[0], node)):
            raise Unrecognised(
                f"{src.rel}:{node.lineno}: {CLASS}.{METHOD} uses `{DEVICE}` "
                f"other than by zeroing it"
            )
    capture = Capture(param, device[0] if device else None, cpu[0] if cpu else None)
    return fn, capture


def inspect(src: Source | None, rel: str) -> tuple[model.Finding, Capture | None]:
    """What this tree's ``rocm_attn.py`` needs; never raises."""

    def finding(state: str, detail: str, edits: tuple[Edit, ...] = ()):
        return model.Finding(FIX, PR, rel, state, detail, edits)

    if src is None:
        return finding(model.UNRECOGNISED, f"{rel} not found"), None
    try:
        fn, capture = analyse(src)
    except Unrecognised as e:
        return finding(model.UNRECOGNISED, str(e)), None
    where = f"{CLASS}.{METHOD}"
    inside = src.markers(fn.lineno, fn.end_lineno or fn.lineno)
    stray = [(n, pr) for n, pr in src.all_markers() if (n, pr) not in inside]
    if stray or len(inside) > 1 or any(pr != PR for _, pr in inside):
        n, pr = (stray or inside)[0]
        return finding(
            model.UNRECOGNISED,
            f"{src.rel}:{n}: a {PROJECT} marker (PR {pr}) where this fix puts none",
        ), None
    ours = [pr for _, pr in inside]
    if capture.cpu_zero is not None:
        line = capture.cpu_zero.lineno
        if ours:
            return finding(
                model.UNRECOGNISED,
                f"{src.rel}:{line}: {where} carries our PR {PR} marker but still "
                f"zeroes {CPU}",
            ), capture
        if capture.device_zero is None:
            return finding(
                model.UNRECOGNISED,
                f"{src.rel}:{line}: {where} zeroes {CPU} but not {DEVICE}; "
                f"removing it would not give PR {PR}'s capture",
            ), capture
        try:
            start, end = src.own_lines(capture.cpu_zero)
            indent = src.indent(capture.cpu_zero)
        except Unrecognised as e:
            return finding(model.UNRECOGNISED, str(e)), capture
        edit = Edit(start, end, (indent + marker(PR, NOTE),))
        return finding(
            model.NEEDED,
            f"{where} zeroes {CPU} (line {line}); the fix removes that "
            f"statement and keeps the device zeroing (#25985)",
            (edit,),
        ), capture
    if ours:
        if capture.device_zero is None:
            return finding(
                model.UNRECOGNISED,
                f"{src.rel}: {where} carries our PR {PR} marker but does not "
                f"zero {DEVICE}",
            ), capture
        return finding(
            model.APPLIED, f"{where} zeroes only {DEVICE} (marker present)"
        ), capture
    if capture.device_zero is None:
        detail = f"{where} zeroes neither {DEVICE} nor {CPU}"
    else:
        detail = f"{where} zeroes only {DEVICE}"
    return finding(model.UPSTREAM, detail), capture
