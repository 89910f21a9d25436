# SPDX-License-Identifier: Apache-2.0
"""What the tools know of runtime patch ``graph-capture-stream``
(:mod:`vllm_capture_guard.runtime.patches.graph_capture_stream`), a fix that is
no attention backend's (its patch names no backend, so ``check`` drives its
sites in :mod:`..harness.streams`):

* :func:`passes_stream`, the one reader of a ``torch.cuda.graph(...)`` call:
  ``status`` hands it the calls in the imported function's source
  (:func:`readings`), ``patch`` the calls in the file's bytes; a literal
  ``None`` stream is no stream for both;
* the in-tree form (:data:`TREE_FILES`, :func:`tree_findings`): vLLM PR #53818,
  capture CUDA graphs on the current stream;
* :func:`undo`, and :data:`CONSEQUENCE` in ``status``'s words;
* :func:`judgements`: ``check``'s check of it (each site driven by
  :mod:`..harness.streams`, its ``torch.cuda.graph`` call recorded), and
  :func:`fails_as`.

The in-tree form. Files (:data:`SITES`): ``vllm/v1/worker/gpu/cudagraph_utils.py``
(``CudaGraphManager.capture``), ``vllm/v1/worker/encoder_cudagraph.py``
(``EncoderCudaGraphManager._capture_budget_graph``) and
``vllm/v1/spec_decode/gemma4.py``
(``Gemma4Proposer._setup_centroids_cuda_graphs``). In 0.27.x/0.28.0 their
``torch.cuda.graph(...)`` calls pass no stream, so torch captures on its own
side stream. The edit does what upstream did: each such call gets
``stream=current_stream()`` (vLLM's ``vllm.utils.torch_utils.current_stream``,
imported at module level), each edited line and the import with a marker
comment above it. The runtime patch
(:mod:`vllm_capture_guard.runtime.patches.graph_capture_stream`) does the same
while the functions run.

Recognised, by structure (anything else is refused):

* ``torch`` is ``import torch`` at module level, and the class has the method
  as a plain ``def`` holding at least one ``torch.cuda.graph(...)`` call;
* a call without a stream (a literal ``None`` stream counts as none, and is
  refused: the fix would have to change an argument, not add one) is on one
  line of its own, ends in ``)`` with no trailing comma, and
  ``current_stream`` is bound nowhere in the module: the fix applies;
* every call passes a stream and there is no marker: upstream's fix;
* or markers exactly above our import and above each call that passes
  ``stream=current_stream()``, and no call without a stream: ours.
"""

from __future__ import annotations

import ast
import inspect as source_of
import textwrap
from typing import Any

from vllm_capture_guard.runtime import patching
from vllm_capture_guard.runtime.patches import graph_capture_stream as runtime
from vllm_capture_guard.tools import static
from vllm_capture_guard.tools.support import module_exists
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.source import (
    PROJECT,
    Edit,
    Source,
    Unrecognised,
    binds,
    marker,
)

CONSEQUENCE = (
    "capture runs on torch's side stream (AITER: splitk "
    "workspace not initialized for the current CUDA stream)"
)


def graph_calls(node: ast.AST) -> list[ast.Call]:
    """Every ``torch.cuda.graph(...)`` call inside ``node``."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.graph"
    ]


def _stream_argument(call: ast.Call) -> ast.expr | None:
    """What the call passes as its stream (third argument or ``stream=``)."""
    if len(call.args) >= 3:
        return call.args[2]
    return next((k.value for k in call.keywords if k.arg == "stream"), None)


def _is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def passes_stream(call: ast.Call) -> bool:
    """Whether the call passes a stream that is not a literal ``None``."""
    stream = _stream_argument(call)
    return stream is not None and not _is_none(stream)


def readings() -> list[static.Reading]:
    """Per capture site of PR #53818 that this vLLM has, in vLLM's order (a
    site whose module the release no longer has is no site of it)."""
    found = []
    for module, cls_name, name in runtime.SITES:
        if not module_exists(module):
            continue
        where = f"{cls_name}.{name}"
        mod = static.import_to_read(module)
        if isinstance(mod, str):
            found.append(static.Reading(where, None, mod, importable=False))
            continue
        cls = getattr(mod, cls_name, None)
        fn = vars(cls).get(name) if isinstance(cls, type) else None
        if fn is None:
            found.append(static.Reading(where, None, f"{module} has no {where}"))
            continue
        found.append(_read_site(where, patching.original_of(fn)))
    return found


def _read_site(where: str, fn: Any) -> static.Reading:
    try:
        text = textwrap.dedent(source_of.getsource(source_of.unwrap(fn)))
        calls = graph_calls(ast.parse(text))
    except (OSError, TypeError, SyntaxError) as e:
        return static.Reading(where, None, f"source unreadable ({type(e).__name__})")
    if not calls:
        return static.Reading(where, None, "no torch.cuda.graph(...) call to read")
    if all(passes_stream(c) for c in calls):
        return static.Reading(where, False, "passes a stream to torch.cuda.graph")
    return static.Reading(where, True, "calls torch.cuda.graph with no stream")


def judgements(checked: Any) -> list[Any]:
    """Each capture site this vLLM has, driven as the runner drives it: does
    its ``torch.cuda.graph`` get a stream? (:class:`.verdict.Checked`)"""
    from vllm_capture_guard.tools.verdict import Judgement

    sites = checked.result.streams
    if not sites:
        return []
    patch = runtime.GraphCaptureStream
    ran = [s for s in sites if s.ok is not None]
    bad = [s for s in ran if not s.ok]
    not_run = [f"{s.site} ({s.error})" for s in sites if s.ok is None and not s.absent]
    gone = [s.site for s in sites if s.absent]
    absent = f"not in this vLLM: {', '.join(gone)}" if gone else None
    found = Judgement(
        f"capture on the current stream (PR {patch.pr})",
        patch.name,
        patch.pr,
        None if not ran else not bad,
        len(ran) - len(bad),
        len(ran),
        "sites",
        note=absent,
        not_run=not_run if ran else [],
    )
    if not ran:  # no site could be driven: why, each
        found.note = "; ".join([*not_run, *([absent] if absent else [])]) or "no site"
    if bad:
        from vllm_capture_guard.tools.harness.streams import CRASH

        found.failure = (
            f"{', '.join(s.site for s in bad)} capture on torch's side stream "
            f"(no stream given); on ROCm with AITER start-up dies: {CRASH}"
        )
    return [found]


def fails_as(judgement: Any) -> str:
    """The start-up failure, as the verdict names it."""
    from vllm_capture_guard.tools.harness.streams import CRASH

    return f"AITER ({CRASH})"


def undo() -> bool:
    """Each site's own function back."""
    undone = False
    for _where, cls, name in runtime.loaded_sites():
        function = cls.__dict__[name]
        if patching.is_guarded(function):
            setattr(cls, name, getattr(function, patching.MARKER))
            undone = True
    return undone


# The in-tree form (PR #53818).
FIX, PR = runtime.GraphCaptureStream.name, runtime.GraphCaptureStream.pr
#: (file inside the vllm package, class, method): the runtime patch's sites
SITES = tuple(
    (module.removeprefix("vllm.").replace(".", "/") + ".py", cls, method)
    for module, cls, method in runtime.SITES
)
FILES = tuple(f for f, _, _ in SITES)
TREE_FILES = FILES
NAME = "current_stream"
IMPORT = f"from vllm.utils.torch_utils import {NAME}".encode()
ARG = f"stream={NAME}()".encode()


def _graph_calls(src: Source, fn: ast.FunctionDef) -> list[ast.Call]:
    calls = graph_calls(fn)
    if not calls:
        raise Unrecognised(f"{src.rel}:{fn.lineno}: no torch.cuda.graph(...) call")
    return calls


def _ours(call: ast.Call) -> bool:
    return any(
        k.arg == "stream" and ast.unparse(k.value) == f"{NAME}()" for k in call.keywords
    )


def _check_torch(src: Source) -> None:
    plain = any(
        isinstance(s, ast.Import) and any(a.name == "torch" and not a.asname
                                          for a in s.names)
        for s in src.module.body
    )  # fmt: skip
    if not plain:
        raise Unrecognised(f"{src.rel}: no `import torch` at module level")


def _import_line(src: Source) -> int:
    """0-based line after the module's last top-level import."""
    last = [s for s in src.module.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    if not last:
        raise Unrecognised(f"{src.rel}: no import at module level")
    return src.own_lines(last[-1])[1]


def _with_stream(src: Source, call: ast.Call) -> bytes:
    """The call's line with ``stream=current_stream()`` as its last argument."""
    if call.lineno != call.end_lineno:
        raise Unrecognised(f"{src.rel}:{call.lineno}: the call spans several lines")
    line = src.lines[call.lineno - 1].rstrip(b"\r\n")
    end = call.end_col_offset - 1
    head = line[:end].rstrip()
    if line[end : end + 1] != b")" or head.endswith(b","):
        raise Unrecognised(f"{src.rel}:{call.lineno}: the call is not `f(...)`")
    sep = b"" if head.endswith(b"(") else b", "
    return line[:end] + sep + ARG + line[end:]


def _indent(src: Source, lineno: int) -> bytes:
    line = src.lines[lineno - 1]
    return line[: len(line) - len(line.lstrip())]


def read_source(src: Source | None, rel: str, cls: str, method: str) -> model.Finding:
    """What this file needs; never raises."""

    def finding(state: model.State, detail: str, edits: tuple[Edit, ...] = ()):
        return model.Finding(FIX, PR, rel, state, detail, edits)

    if src is None:
        return finding(model.ABSENT, f"{rel} is not in this tree; nothing to fix")
    try:
        return _read(src, cls, method, finding)
    except Unrecognised as e:
        return finding(model.UNRECOGNISED, str(e))


def _read(src: Source, cls: str, method: str, finding) -> model.Finding:
    _check_torch(src)
    fn = src.method(src.top_class(cls), method)
    calls = _graph_calls(src, fn)
    where = f"{cls}.{method}"
    markers = src.all_markers()
    bare = [c for c in calls if not passes_stream(c)]
    if not markers:
        if not bare:
            return finding(model.UPSTREAM, f"{where} passes a stream")
        named = [c for c in bare if _stream_argument(c) is not None]
        if named:
            raise Unrecognised(
                f"{src.rel}:{named[0].lineno}: {where} passes a stream of None; "
                f"this fix adds a stream only to a call that names none"
            )
        used = binds(src.module, NAME)
        if used:
            raise Unrecognised(
                f"{src.rel}:{getattr(used[0], 'lineno', '?')}: the name {NAME} "
                f"is already used"
            )
        at = _import_line(src)
        edits = [Edit(at, at, (marker(PR, "capture stream"), IMPORT))]
        for call in sorted(bare, key=lambda c: c.lineno):
            start = call.lineno - 1
            note = _indent(src, call.lineno) + marker(PR)
            edits.append(Edit(start, start + 1, (note, _with_stream(src, call))))
        lines = ", ".join(str(c.lineno) for c in bare)
        return finding(
            model.NEEDED,
            f"{where} calls torch.cuda.graph without a stream (line {lines})",
            tuple(edits),
        )
    imports = [
        s
        for s in src.module.body
        if isinstance(s, ast.ImportFrom)
        and s.module == "vllm.utils.torch_utils"
        and [(a.name, a.asname) for a in s.names] == [(NAME, None)]
    ]
    expected = {(s.lineno - 1, PR) for s in imports}
    expected |= {(c.lineno - 1, PR) for c in calls if _ours(c)}
    if bare or len(imports) != 1 or set(markers) != expected or len(expected) < 2:
        raise Unrecognised(
            f"{src.rel}: {PROJECT} markers, but {where} or the import of {NAME} "
            f"is not what this fix writes (edited since?)"
        )
    return finding(model.APPLIED, f"{where} passes stream={NAME}() (markers present)")


def tree_findings(
    sources: dict[str, Source | None], broken: dict[str, str], tree, context: dict
) -> list[model.Finding]:
    """Each capture site's file: what it needs (independent of the other fixes)."""
    found = []
    for inside, cls, method in SITES:
        rel = tree.rel(inside)
        if inside in broken:
            found.append(
                model.Finding(FIX, PR, rel, model.UNRECOGNISED, broken[inside])
            )
        else:
            found.append(read_source(sources[inside], rel, cls, method))
    return found
