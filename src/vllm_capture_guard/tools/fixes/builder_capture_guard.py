# SPDX-License-Identifier: Apache-2.0
"""What the tools know of the capture guard, runtime patch
``builder-capture-guard`` (:mod:`vllm_capture_guard.runtime.guard`), beyond
what the runtime loads:

* :func:`read_source`, the one reader of ``rocm_attn.py``: ``status`` hands it the
  source of the module this process imported (:func:`readings`), ``patch
  --check`` the file's bytes in the tree it is given (:func:`tree_findings`);
* the in-tree form for image builders: vLLM PR #51585 written into
  ``rocm_attn.py``. It keeps its name from 0.1.0, ``rocm-attn-cpu-offsets``
  (:data:`FIX`): the edit is exactly that PR, while the runtime guards every
  builder;
* :func:`undo` (tests and tools), :data:`CONSEQUENCE` (``status``'s words);
* :func:`judgements`, ``check``'s check (MiniMax-M3's indexer after each
  backend's capture), and :func:`fails_as`, the verdict's words.

The in-tree form, in ``vllm/v1/attention/backends/rocm_attn.py``: in
0.27.x/0.28.0 ``RocmAttentionMetadataBuilder.build_for_cudagraph_capture``
zeroes the device ``query_start_loc`` (the #25985 guard) and the host
``query_start_loc_cpu``; 0.29.0 zeroes only the device offsets. The edit
removes the one statement that zeroes the CPU offsets and puts our marker
comment in its place.

Recognised, by structure (anything else is refused):

* the capture's metadata parameter (its second, never reassigned) is used
  only for attribute reads and as an argument of ``self.build(...)``: passed
  anywhere else, it could have its offsets written where we cannot see it;
* the CPU offsets are written by exactly one top-level statement of the
  capture, ``<param>.query_start_loc_cpu.zero_()`` (or ``.fill_(0)``), and
  ``query_start_loc_cpu`` (as an attribute or a string) appears nowhere else
  in the module;
* the device offsets are zeroed by one such statement on
  ``<param>.query_start_loc``, and the capture mentions them nowhere else;
* the capture is not decorated, and names no other host field
  (:func:`.tree.capture.host_fields_named`), on any object: reading could
  not tell what it does to it.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from typing import Any

from vllm_capture_guard.runtime import patching
from vllm_capture_guard.runtime.guard import install as guard
from vllm_capture_guard.tools import revert, static
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.capture import (
    capture_params,
    check_param_use,
    host_fields_named,
    zeroes,
)
from vllm_capture_guard.tools.tree.source import (
    PROJECT,
    Edit,
    Source,
    Unrecognised,
    body_without_docstring,
    contains,
    marker,
    mentions,
)

CONSEQUENCE = "later builders read it (MiniMax-M3: assert decode_query_len > 0)"

ROCM_MODULE = "vllm.v1.attention.backends.rocm_attn"
ROCM_BACKEND = "RocmAttentionBackend"
ROCM_LABEL = "ROCM_ATTN"


@dataclasses.dataclass(frozen=True)
class RocmRead:
    """``rocm_attn.py`` as this process imported it, read by :func:`read_source`."""

    reading: static.Reading  # in status's words, for ROCM_ATTN
    capture: Capture | None  # what the AITER fix's reader needs, if recognised


def read_imported_rocm() -> RocmRead:
    """The imported ``rocm_attn``: does its builder's capture zero the CPU
    offsets? Only where the source read is the code that runs."""
    imported = static.imported_source(ROCM_MODULE, FILE)
    if imported.source is None:
        return RocmRead(imported.unread(ROCM_LABEL), None)
    found, capture = read_source(imported.source, FILE)
    if found.state != model.UNRECOGNISED:
        why = _not_what_runs(imported)
        if why:
            return RocmRead(static.in_doubt(ROCM_LABEL, why), None)
    needed = f"{CLASS}'s capture zeroes {CPU}"
    fixed = f"{CLASS}'s capture leaves the host fields alone"
    return RocmRead(static.reading_of(ROCM_LABEL, found, fixed, needed), capture)


def _not_what_runs(imported: static.Imported) -> str | None:
    """Why the capture read is not the one ROCM_ATTN runs: its backend returns
    another builder, or the capture is not what the file says."""
    try:
        backend = getattr(imported.module, ROCM_BACKEND)
        builder = getattr(imported.module, CLASS)
        if backend.get_builder_cls() is not builder:
            return f"{ROCM_BACKEND} returns {backend.get_builder_cls().__name__}"
        running = patching.original_of(vars(builder).get(METHOD))
        return static.not_as_read(imported.source, running, f"{CLASS}.{METHOD}")
    except Exception as e:  # whatever the module holds, status goes on
        return f"{type(e).__name__}: {e}"


def readings() -> list[static.Reading]:
    """ROCM_ATTN, and ROCM_AITER_UNIFIED_ATTN (whose builder is the ROCm one
    until PR #53821): does the capture of each one's builder zero a host value?"""
    from vllm_capture_guard.tools.fixes import rocm_aiter_unified_builder as aiter

    rocm = read_imported_rocm()
    found = aiter.read_imported_aiter(rocm)
    if found.unread is not None:
        aiter_row = found.unread
    elif found.finding.state == model.NEEDED:  # it returns the ROCm builder
        aiter_row = dataclasses.replace(rocm.reading, where=aiter.LABEL)
    else:
        own = f"{aiter.BUILDER}'s capture leaves the host fields alone"
        aiter_row = static.reading_of(aiter.LABEL, found.finding, own)
    return [rocm.reading, aiter_row, *aiter.derived()]


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


def judgements(checked: Any) -> list[Any]:
    """Per backend of the seed scenario: does MiniMax-M3's indexer build after
    that backend's capture, at every capture size? (:class:`.verdict.Checked`)"""
    from vllm_capture_guard.tools import harness
    from vllm_capture_guard.tools.verdict import Judgement

    patch = guard.CaptureGuard
    found = []
    for backend in harness.seed_backends():
        runs = checked.by_backend.get(backend)
        name = f"MiniMax-M3 indexer after {backend}"
        if not runs:  # could not be made here, or the runner captured nothing
            why = checked.result.unavailable.get(backend, "no capture ran")
            found.append(
                Judgement(
                    name, patch.name, patch.pr, None, 0, 0, checked.unit, note=why
                )
            )
            continue
        found.append(_indexer(name, runs, checked))
    return found


def _indexer(name: str, runs: list[Any], checked: Any) -> Any:
    from vllm_capture_guard.tools.verdict import Judgement, size_words

    patch = guard.CaptureGuard
    total = checked.total(runs)
    bad = [r for r in runs if not r.ok]
    found = Judgement(
        name,
        patch.name,
        patch.pr,
        not bad,
        len(runs) - len(bad),
        total,
        checked.unit,
        failed_sizes=[r.num_tokens for r in bad if r.num_tokens],
    )
    if bad and total > len(runs):
        found.stopped_at = bad[0].num_tokens
    elif total > len(runs):  # a runner that stopped with nothing failing
        found.ok = None
        found.note = f"{total - len(runs)} of {total} sizes not reached"
    if bad:
        first = bad[0]
        where = f" at {first.error_site}" if first.error_site else ""
        said = f": {first.error_line}" if first.error_line else ""
        found.failure = f"{first.error}{where}{said}"
        if found.stopped_at is None:
            found.failure += f" (first at {size_words(first)})"
    return found


INDEXER_FILE = "minimax_m3/common/indexer.py"  # as a failure's site names it


def fails_as(judgement: Any) -> str:
    """The start-up failure, as the verdict names it: MiniMax-M3's crash, or
    what else stopped the capture, as it is."""
    from vllm_capture_guard.tools.verdict import INDEXER_CRASH

    if INDEXER_FILE in (judgement.failure or ""):  # the seed crash
        return f"MiniMax-M3 ({INDEXER_CRASH})"
    return f"{judgement.name} ({judgement.failure})"


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


def analyse(src: Source) -> tuple[ast.FunctionDef, Capture]:
    """Recognise the capture, or raise :class:`Unrecognised`."""
    cls = src.top_class(CLASS)
    fn = src.method(cls, METHOD)
    if fn.decorator_list:
        raise Unrecognised(f"{src.rel}:{fn.lineno}: {CLASS}.{METHOD} is decorated")
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
    for node in host_fields_named(fn):
        if node.attr != CPU:
            raise Unrecognised(
                f"{src.rel}:{node.lineno}: {CLASS}.{METHOD} uses `{node.attr}`, a "
                f"host field; cannot tell by reading what it does to it"
            )
    capture = Capture(param, device[0] if device else None, cpu[0] if cpu else None)
    return fn, capture


def read_source(src: Source | None, rel: str) -> tuple[model.Finding, Capture | None]:
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
    found, context[ROCM_CAPTURE] = read_source(sources[FILE], rel)
    return [found]
