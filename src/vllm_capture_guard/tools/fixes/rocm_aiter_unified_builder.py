# SPDX-License-Identifier: Apache-2.0
"""What the tools know of runtime patch ``rocm-aiter-unified-builder``
(:mod:`vllm_capture_guard.runtime.patches.rocm_aiter_unified_builder`):

* :func:`read_source`, the one reader of ``rocm_aiter_unified_attn.py``:
  ``status`` hands it the imported module's source (:func:`readings`),
  ``patch --check`` the file's bytes;
* the in-tree form (:data:`TREE_FILES`, :func:`tree_findings`): vLLM PR #53821,
  ROCM_AITER_UNIFIED_ATTN gets its own metadata builder, whose capture leaves
  the query offsets alone;
* :func:`undo`, :data:`CONSEQUENCE`; :func:`judgements` and :func:`fails_as`,
  ``check``'s check (the capture keeps the offsets its kernel reads).

The in-tree form, in ``vllm/v1/attention/backends/rocm_aiter_unified_attn.py``: in
0.27.x/0.28.0 ``RocmAiterUnifiedAttentionBackend.get_builder_cls()`` returns
``RocmAttentionMetadataBuilder``, whose capture zeroes the offsets that the
unified kernel reads at replay. The edit inserts our own subclass, named as
upstream's (:data:`BUILDER`), before the backend class, and makes
``get_builder_cls()`` return it.

Its capture is the one the runtime patch installs:
``self.build(0, common_attn_metadata)`` (the inherited hot path), the
returned ``seq_lens`` set to 1, and no other write. It does not zero the
offsets and put them back: a host write to the runner's pinned
``query_start_loc_cpu`` could race the non-blocking copy to the device that
vLLM issued just before capture. The oracle checks it against 0.29.0.

Recognised, by structure (anything else is refused):

* ``get_builder_cls`` is a static or class method of the backend whose body is
  ``return <Name>``;
* it returns ``RocmAttentionMetadataBuilder``, imported at module level from
  ``rocm_attn`` before the backend class and bound nowhere else, and the
  module does not use the name :data:`BUILDER` yet: the fix applies;
* or it returns :data:`BUILDER`, a module-level subclass of
  ``RocmAttentionMetadataBuilder`` with its own capture that hands its
  metadata only to ``self.build`` and never names ``query_start_loc``,
  ``query_start_loc_cpu`` or any other host field, and is not decorated:
  upstream's fix (no marker); or ours (markers, and the class is exactly the
  block we insert).

``status`` reads only the backend of that name: a vendor's backend derived
from it reads as in doubt (:func:`derived`); the runtime guards it too.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from typing import Any

from vllm_capture_guard.runtime import patching
from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as runtime
from vllm_capture_guard.tools import revert, static
from vllm_capture_guard.tools.fixes.builder_capture_guard import (
    CPU,
    DEVICE,
    METHOD,
    ROCM_CAPTURE,
    Capture,
    RocmRead,
    read_imported_rocm,
)
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.capture import (
    capture_params,
    check_param_use,
    host_fields_named,
)
from vllm_capture_guard.tools.tree.source import (
    PROJECT,
    Edit,
    Source,
    Unrecognised,
    binds,
    body_without_docstring,
    is_name,
    marker,
    mentions,
)

CONSEQUENCE = "the AITER kernel reads it at replay"
LABEL = "ROCM_AITER_UNIFIED_ATTN"


@dataclasses.dataclass(frozen=True)
class AiterRead:
    """The imported AITER unified module: the reader's finding, or why none."""

    finding: model.Finding | None
    unread: static.Reading | None = None  # set where finding is None


def read_imported_aiter(rocm: RocmRead) -> AiterRead:
    """The imported AITER unified module: does its backend return the ROCm
    builder (the fix is needed) or its own? Only where the source read is the
    code that runs."""
    imported = static.imported_source(runtime.MODULE, FILE)
    if imported.source is None:
        return AiterRead(None, imported.unread(LABEL))
    found = read_source(imported.source, FILE, rocm.capture)
    if found.state != model.UNRECOGNISED:
        why = _not_what_runs(imported, found)
        if why:
            return AiterRead(None, static.in_doubt(LABEL, why))
    return AiterRead(found)


def _not_what_runs(imported: static.Imported, found: model.Finding) -> str | None:
    """Why the reading is not what the backend runs: its getter or its builder's
    capture is not what the file says, or it returns another builder."""
    try:
        backend = getattr(imported.module, BACKEND)
        getter = patching.original_of(vars(backend).get(GETTER))
        why = static.not_as_read(imported.source, getter, f"{BACKEND}.{GETTER}")
        if why:
            return why
        read = PARENT if found.state == model.NEEDED else BUILDER
        builder = getattr(imported.module, read)
        if backend.get_builder_cls() is not builder:
            return f"{BACKEND} returns {backend.get_builder_cls().__name__}"
        if read == PARENT:  # the ROCm builder, read with rocm_attn.py
            return None
        capture = patching.original_of(vars(builder).get(METHOD))
        return static.not_as_read(imported.source, capture, f"{BUILDER}.{METHOD}")
    except Exception as e:  # whatever the module holds, status goes on
        return f"{type(e).__name__}: {e}"


def derived() -> list[static.Reading]:
    """Each vendor's backend derived from this one with its own builder: in doubt."""
    rows = []
    for backend in runtime.backends():
        if backend.__name__ != BACKEND:
            why = f"{backend.__name__} has a builder of its own, not read here"
            rows.append(static.in_doubt(backend.__name__, why))
    return rows


def readings() -> list[static.Reading]:
    """The AITER unified backend: does its builder's capture zero the query
    offsets that its kernel reads at replay?"""
    found = read_imported_aiter(read_imported_rocm())
    if found.unread is not None:
        return [found.unread]
    needed = f"{BACKEND}.{GETTER} returns {PARENT}, whose capture zeroes {DEVICE}"
    fixed = f"{BUILDER}'s capture leaves {DEVICE} alone"
    return [static.reading_of(LABEL, found.finding, fixed, needed), *derived()]


def undo() -> bool:
    """Each backend's own ``get_builder_cls`` back, and vLLM's binding of the
    builder's name (0.29.0 on), or none."""
    undone = False
    for backend in runtime.backends():
        current = vars(backend).get(runtime.GETTER)
        if not patching.is_guarded(current):
            continue
        revert.put(backend, runtime.GETTER, getattr(current.__func__, patching.MARKER))
        name, home = runtime.builder_name(backend), sys.modules[backend.__module__]
        if name == runtime.BUILDER:
            revert.put(home, name, runtime.REPLACED_BINDINGS.pop(home.__name__, None))
        vars(runtime).pop(name, None)
        undone = True
    return undone


NOT_REACHED = "the runner did not reach"


def judgements(checked: Any) -> list[Any]:
    """The AITER unified capture must leave the device offsets as the batch had
    them, as its kernel reads them at replay (:class:`.verdict.Checked`)."""
    from vllm_capture_guard.tools.verdict import Judgement, size_words

    patch = runtime.RocmAiterUnifiedBuilder
    found = []
    for backend in patch.backends:
        runs = checked.by_backend.get(backend)
        if not runs:
            continue
        bad = [
            r for r in runs if r.query_start_loc_after != r.query_start_loc_cpu_before
        ]
        title = f"{backend} keeps the query offsets its kernel reads (PR {patch.pr})"
        counts = (not bad, len(runs) - len(bad), len(runs), checked.unit)
        sizes = [r.num_tokens for r in bad if r.num_tokens]
        judgement = Judgement(title, patch.name, patch.pr, *counts, failed_sizes=sizes)
        judgement.kind = "replay"
        if unreached := checked.total(runs) - len(runs):  # the runner stopped
            judgement.note = f"not checked: the {unreached} sizes {NOT_REACHED}"
        if bad:
            judgement.failure = (
                "its capture changes the device query_start_loc that the kernel "
                f"reads at replay (first at {size_words(bad[0])})"
            )
        found.append(judgement)
    return found


def fails_as(judgement: Any) -> str:
    """The backend whose graphs would replay over zeroed offsets."""
    return judgement.name.split(" keeps ")[0]


# The in-tree form (PR #53821).
FIX = runtime.RocmAiterUnifiedBuilder.name
PR = runtime.PR
FILE = "v1/attention/backends/rocm_aiter_unified_attn.py"  # inside vllm/
TREE_FILES = (FILE,)
BACKEND = "RocmAiterUnifiedAttentionBackend"
PARENT = "RocmAttentionMetadataBuilder"
BUILDER = "RocmAiterUnifiedAttentionMetadataBuilder"
GETTER = "get_builder_cls"

#: The class we insert (our own code; the runtime patch does the same).
BLOCK = (
    marker(PR, "own builder, offsets kept"),
    f"class {BUILDER}({PARENT}):".encode(),
    b'    """The ROCm builder, except that full-graph capture leaves the query',
    b'    offsets alone: the unified attention kernel reads them at replay."""',
    b"",
    f"    def {METHOD}(self, common_attn_metadata):".encode(),
    b"        # Capture with sequence lengths of 1, as every ROCm capture does,",
    b"        # and write nothing else: no offset is zeroed, none is put back.",
    b"        attn_metadata = self.build(0, common_attn_metadata)",
    b"        attn_metadata.seq_lens.fill_(1)",
    b"        return attn_metadata",
)
BLANK_AFTER = 2


def _getter(src: Source, backend: ast.ClassDef) -> tuple[ast.FunctionDef, str]:
    fn = src.method(backend, GETTER)
    decorators = [d.id for d in fn.decorator_list if isinstance(d, ast.Name)]
    if len(fn.decorator_list) != 1 or decorators[0] not in (
        "staticmethod",
        "classmethod",
    ):
        raise Unrecognised(
            f"{src.rel}:{fn.lineno}: {BACKEND}.{GETTER} is not a plain static "
            f"or class method"
        )
    body = body_without_docstring(fn.body)
    if len(body) != 1 or not (
        isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Name)
    ):
        raise Unrecognised(
            f"{src.rel}:{fn.lineno}: {BACKEND}.{GETTER} is not `return <class>`"
        )
    return fn, body[0].value.id


def _parent_import(src: Source, before: int) -> None:
    """``PARENT`` must come from ``rocm_attn`` at module level, above line
    ``before``, and be bound nowhere else."""
    imported = None
    for stmt in src.module.body:
        if (
            isinstance(stmt, ast.ImportFrom)
            and (stmt.module or "").split(".")[-1] == "rocm_attn"
        ):
            for alias in stmt.names:
                if alias.name == PARENT and alias.asname is None:
                    imported = stmt
    if imported is None or imported.lineno >= before:
        raise Unrecognised(
            f"{src.rel}: no `from ...rocm_attn import {PARENT}` at module level "
            f"above {BACKEND}"
        )
    for node in binds(src.module, PARENT):
        is_load = isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        is_import = isinstance(node, ast.alias) and any(
            node is a for a in imported.names
        )
        if not (is_load or is_import):
            raise Unrecognised(
                f"{src.rel}:{getattr(node, 'lineno', '?')}: {PARENT} is bound "
                f"here as well as imported from rocm_attn"
            )


def _builder_class(src: Source) -> ast.ClassDef:
    """The module's own ``BUILDER``, recognised (see the module docstring)."""
    cls = src.top_class(BUILDER)
    if len(cls.bases) != 1 or not is_name(cls.bases[0], PARENT) or cls.keywords:
        raise Unrecognised(f"{src.rel}:{cls.lineno}: {BUILDER} is not a {PARENT}")
    fn = src.method(cls, METHOD)
    if fn.decorator_list:
        raise Unrecognised(f"{src.rel}:{fn.lineno}: {BUILDER}.{METHOD} is decorated")
    check_param_use(src, fn, capture_params(src, fn))
    for field in (DEVICE, CPU):
        found = mentions(cls, field)
        if found:
            raise Unrecognised(
                f"{src.rel}:{found[0].lineno}: {BUILDER} uses `{field}`"  # type: ignore[attr-defined]
            )
    for node in host_fields_named(fn):
        raise Unrecognised(
            f"{src.rel}:{node.lineno}: {BUILDER}'s capture uses `{node.attr}`, "
            f"a host field"
        )
    return cls


def _insertion_line(src: Source, backend: ast.ClassDef) -> int:
    """0-based line before which our class goes: above the backend class, its
    decorators and the comment lines right above them."""
    at = src.first_line(backend) - 1
    while at > 0 and src.lines[at - 1].strip().startswith(b"#"):
        at -= 1
    return at


def read_source(src: Source | None, rel: str, capture: Capture | None) -> model.Finding:
    """What this tree's ``rocm_aiter_unified_attn.py`` needs; never raises.

    ``capture`` is the ROCm builder's capture as :mod:`.builder_capture_guard`
    recognised it (None if it did not)."""

    def finding(state: str, detail: str, edits: tuple[Edit, ...] = ()):
        return model.Finding(FIX, PR, rel, state, detail, edits)

    if src is None:
        return finding(model.ABSENT, f"{rel} is not in this tree; nothing to fix")
    try:
        return _read(src, capture, finding)
    except Unrecognised as e:
        return finding(model.UNRECOGNISED, str(e))


def _read(src: Source, capture: Capture | None, finding) -> model.Finding:
    backend = src.top_class(BACKEND)
    getter, returned = _getter(src, backend)
    ret = body_without_docstring(getter.body)[0]
    markers = src.all_markers()
    where = f"{BACKEND}.{GETTER}"
    if returned == PARENT:
        if markers:
            raise Unrecognised(
                f"{src.rel}:{markers[0][0]}: a {PROJECT} marker, but {where} "
                f"still returns {PARENT}"
            )
        at = _insertion_line(src, backend)
        _parent_import(src, at + 1)
        used = binds(src.module, BUILDER)
        if used:
            raise Unrecognised(
                f"{src.rel}:{getattr(used[0], 'lineno', '?')}: the name {BUILDER} "
                f"is already used"
            )
        if capture is None:
            raise Unrecognised(f"{PARENT}'s capture in rocm_attn.py not recognised")
        start, end = src.own_lines(ret)
        indent = src.indent(ret)
        edits = (
            Edit(at, at, tuple([*BLOCK, *([b""] * BLANK_AFTER)])),
            Edit(
                start,
                end,
                (indent + marker(PR), indent + b"return " + BUILDER.encode()),
            ),
        )
        return finding(
            model.NEEDED,
            f"{where} returns {PARENT} (line {ret.lineno}), whose capture zeroes "
            f"query_start_loc; the fix adds {BUILDER}",
            edits,
        )
    if returned != BUILDER:
        raise Unrecognised(f"{src.rel}:{ret.lineno}: {where} returns {returned}")
    if not markers:
        _builder_class(src)
        return finding(model.UPSTREAM, f"{where} returns its own {BUILDER}")
    cls = src.top_class(BUILDER)
    first = src.first_line(cls)
    expected = [(first - 1, PR), (ret.lineno - 1, PR)]
    block = [line.rstrip(b"\r\n") for line in src.lines[first - 2 : cls.end_lineno]]
    if markers != expected or block != list(BLOCK):
        raise Unrecognised(
            f"{src.rel}: {PROJECT} markers, but {BUILDER} or {where} is not what "
            f"this fix writes (edited since?)"
        )
    _parent_import(src, first)
    return finding(model.APPLIED, f"{where} returns our {BUILDER} (markers present)")


def tree_findings(
    sources: dict[str, Source | None], broken: dict[str, str], tree, context: dict
) -> list[model.Finding]:
    """This tree's AITER unified module: what it needs, given the ROCm capture
    that the capture guard's in-tree form recognised (or None)."""
    rel = tree.rel(FILE)
    if FILE in broken:
        return [model.Finding(FIX, PR, rel, model.UNRECOGNISED, broken[FILE])]
    return [read_source(sources[FILE], rel, context.get(ROCM_CAPTURE))]
