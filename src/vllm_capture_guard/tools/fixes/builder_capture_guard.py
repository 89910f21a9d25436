# SPDX-License-Identifier: Apache-2.0
"""What the tools know of the capture guard, runtime patch
``builder-capture-guard`` (:mod:`vllm_capture_guard.runtime.guard`), beyond
what the runtime loads:

* :func:`readings`: ``status``'s reading of the imported ROCm builders'
  captures (does one touch a host field? :func:`.shape.fixed_shape`);
* the in-tree form for image builders (:data:`TREE_FILES`,
  :func:`tree_findings`): vLLM PR #51585 written into ``rocm_attn.py``. It
  keeps its name from 0.1.0, ``rocm-attn-cpu-offsets`` (:data:`FIX`): the edit
  is exactly that PR, while the runtime guards every builder;
* :func:`undo`: the guard taken off again (tests and tools; vLLM never does);
* :data:`CONSEQUENCE`: what a needed fix prevents, in ``status``'s words.

The in-tree form, in ``vllm/v1/attention/backends/rocm_attn.py``: in
0.27.x/0.28.0 ``RocmAttentionMetadataBuilder.build_for_cudagraph_capture``
zeroes the device ``query_start_loc`` (the #25985 guard) and the host
``query_start_loc_cpu``; 0.29.0 zeroes only the device offsets. The edit
removes the one statement that zeroes the CPU offsets and puts our marker
comment in its place.

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
import sys

from vllm_capture_guard.runtime import patching
from vllm_capture_guard.runtime.guard import install as guard
from vllm_capture_guard.tools import revert, static
from vllm_capture_guard.tools.shape import fixed_shape
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

CONSEQUENCE = "later builders read it (MiniMax-M3: assert decode_query_len > 0)"

#: The ROCm backends whose builders status reads: (module, class, registry name).
ROCM = (
    ("vllm.v1.attention.backends.rocm_attn", "RocmAttentionBackend", "ROCM_ATTN"),
    (
        "vllm.v1.attention.backends.rocm_aiter_unified_attn",
        "RocmAiterUnifiedAttentionBackend",
        "ROCM_AITER_UNIFIED_ATTN",
    ),
)


def readings() -> list[static.Reading]:
    """Per ROCm backend: does its builder's capture touch a host field?"""
    found = []
    for module, name, label in ROCM:
        mod = static.import_to_read(module)
        if isinstance(mod, str):
            found.append(static.Reading(label, None, mod, importable=False))
            continue
        backend = getattr(mod, name, None)
        if not isinstance(backend, type):
            found.append(static.Reading(label, None, f"{module} has no {name}"))
            continue
        builder = backend.get_builder_cls()
        why = fixed_shape(patching.original_of(getattr(builder, static.METHOD)))
        found.append(static.capture_reading(label, builder, why, "the host fields"))
    return found


def undo() -> bool:
    """Take the guard off every builder class, and off vLLM's ``AttentionGroup``
    and builder base."""
    group = getattr(sys.modules.get(guard.UTILS), guard.GROUP, None)
    done = isinstance(group, type) and revert.unwrap_method(group, guard.MAKE)
    root = getattr(sys.modules.get(guard.BASE), guard.BUILDER, None)
    watching = vars(root).get("__init_subclass__") if isinstance(root, type) else None
    if patching.is_guarded(watching):
        revert.put(
            root, "__init_subclass__", getattr(watching.__func__, patching.MARKER)
        )
        done = True
    classes = reversed(guard.builder_classes())
    return any([revert.unwrap_method(c, guard.METHOD) for c in classes]) or done


# The in-tree form (PR #51585).
FIX = "rocm-attn-cpu-offsets"
PR = "#51585"
FILE = "v1/attention/backends/rocm_attn.py"  # inside the vllm package
TREE_FILES = (FILE,)
#: What :func:`tree_findings` leaves for the AITER fix's: the capture it recognised.
ROCM_CAPTURE = "rocm capture"
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


def tree_findings(
    sources: dict[str, Source | None], broken: dict[str, str], tree, context: dict
) -> list[model.Finding]:
    """This tree's ``rocm_attn.py``: what it needs (``context`` gets the capture)."""
    rel = tree.rel(FILE)
    if FILE in broken:
        return [model.Finding(FIX, PR, rel, model.UNRECOGNISED, broken[FILE])]
    found, context[ROCM_CAPTURE] = inspect(sources[FILE], rel)
    return [found]
