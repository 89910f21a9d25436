# SPDX-License-Identifier: Apache-2.0
"""Capture CUDA graphs on the current stream.

What:
    ``CudaGraphManager.capture`` (``vllm/v1/worker/gpu/cudagraph_utils.py``,
    Model Runner V2), ``EncoderCudaGraphManager._capture_budget_graph``
    (``vllm/v1/worker/encoder_cudagraph.py``) and
    ``Gemma4Proposer._setup_centroids_cuda_graphs``
    (``vllm/v1/spec_decode/gemma4.py``).

Symptom:
    Start-up dies in full-graph capture, e.g. on ROCm with AITER (Kimi-K3,
    TP8, MI355X, Model Runner V2): ``splitk workspace not initialized for the
    current CUDA stream. Call aiter.opus_gemm_workspace_init()``.

Cause:
    These functions call ``torch.cuda.graph(...)`` with no ``stream=``, so
    torch captures on its own side stream, not on the one that warm-up ran
    on; state a kernel keeps per stream is missing there.

Upstream:
    vllm-project/vllm PR #53818, in 0.29.0: ``stream=current_stream()``.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them.

Detected:
    By reading each imported function's source (through its decorators),
    never by running it: needed where a ``torch.cuda.graph(...)`` call passes
    no stream. Unreadable source is guarded, with a WARNING; a function with
    no such call, or whose ``torch`` is not torch, is left alone, with a
    WARNING (this patch cannot change how it captures).

How:
    The class gets a copy of the function (same code, defaults, closure and
    decorators) whose globals read its module's live, except ``torch``: a
    stand-in that forwards everything to torch but ``torch.cuda.graph``, which
    is torch's own given vLLM's ``current_stream()`` when the caller passed no
    stream. torch itself is never changed, so no other code, thread or
    library sees a different ``torch.cuda.graph``.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from types import ModuleType
from typing import Any

from vllm_capture_guard.runtime import patches as base

#: (module, class, function): the call sites that PR #53818 changed.
SITES = (
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "capture"),
    ("vllm.v1.worker.encoder_cudagraph", "EncoderCudaGraphManager",
     "_capture_budget_graph"),
    ("vllm.v1.spec_decode.gemma4", "Gemma4Proposer", "_setup_centroids_cuda_graphs"),
)  # fmt: skip


def current_stream() -> Any:
    """The stream 0.29.0 passes: vLLM's own ``current_stream()``."""
    found = getattr(sys.modules.get("vllm.utils.torch_utils"), "current_stream", None)
    return found() if callable(found) else sys.modules["torch"].cuda.current_stream()


def graph(cuda_graph: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.cuda.graph``, on the current stream unless one is given."""
    if len(args) >= 2 and args[1] is None:
        args = (args[0], current_stream(), *args[2:])
    elif len(args) < 2 and kwargs.get("stream") is None:
        kwargs["stream"] = current_stream()
    return sys.modules["torch"].cuda.graph(cuda_graph, *args, **kwargs)


class _Cuda:
    graph = staticmethod(graph)

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.modules["torch"].cuda, name)


class _Torch:
    cuda = _Cuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.modules["torch"], name)


class _Globals(dict):
    """A module's globals, read live, with ``torch`` read through ``_Torch``."""

    def __init__(self, module: dict) -> None:
        super().__init__(torch=_Torch(), __builtins__=module.get("__builtins__"))
        self.module = module

    def __missing__(self, key: str) -> Any:
        return self.module[key]


def _given(node: ast.AST | None) -> bool:
    return node is not None and not (
        isinstance(node, ast.Constant) and node.value is None
    )


def stream_calls(fn: Any) -> list[bool]:
    """Does each ``torch.cuda.graph(...)`` call in ``fn`` pass a stream (not
    ``None``)? Raises ValueError where a copy would not behave as ``fn``:
    ``global`` statements and ``globals()`` use the copy's own globals."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    nodes = list(ast.walk(tree))
    if any(
        isinstance(n, ast.Global) or (isinstance(n, ast.Name) and n.id == "globals")
        for n in nodes
    ):
        raise ValueError("it uses its module's globals directly")
    calls = [
        n
        for n in nodes
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.graph"
    ]
    return [
        _given(c.args[2] if len(c.args) >= 3 else None)
        or any(k.arg == "stream" and _given(k.value) for k in c.keywords)
        for c in calls
    ]


def _holds(cell: Any, obj: Any) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def copy_of(fn: Any) -> Any:
    """``fn`` reading ``torch`` through the stand-in; a decorator's wrapper is
    copied with the copy of the function it holds in its closure."""
    inner, cells = getattr(fn, "__wrapped__", None), list(fn.__closure__ or ())
    scope: dict = _Globals(fn.__globals__)
    if inner is not None:
        held = [i for i, c in enumerate(cells) if _holds(c, inner)]
        if len(held) != 1:
            raise TypeError(f"{fn.__qualname__} does not hold what it wraps")
        cells[held[0]], scope = types.CellType(copy_of(inner)), fn.__globals__
    new = types.FunctionType(
        fn.__code__, scope, fn.__name__, fn.__defaults__, tuple(cells) or None
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    new = functools.update_wrapper(new, fn)
    setattr(new, base.MARKER, fn)
    return new


def _loaded() -> list[tuple[str, type, str]]:
    """``(where, class, name)`` of each site whose module vLLM imported."""
    found = []
    for module, cls_name, name in SITES:
        cls = getattr(sys.modules.get(module), cls_name, None)
        if isinstance(cls, type) and inspect.isfunction(cls.__dict__.get(name)):
            found.append((f"{cls_name}.{name}", cls, name))
    return found


class GraphCaptureStream(base.Patch):
    name, pr = "graph-capture-stream", "#53818"
    modules = tuple(dict.fromkeys(m for m, _, _ in SITES))
    backends = ()  # not an attention backend's fix
    targets = tuple((m, c) for m, c, _ in SITES)

    def plan(self, module: ModuleType) -> base.Outcome:
        needed, done, warnings = [], [], []
        for where, cls, name in _loaded():
            fn = cls.__dict__[name]
            if base.is_guarded(fn):
                done.append(f"{where} guarded")
            elif (
                inspect.unwrap(fn).__globals__.get("torch") is not sys.modules["torch"]
            ):
                warnings.append(f"{where}: its `torch` is not torch; unchanged")
            else:
                try:
                    calls = stream_calls(fn)
                except ValueError as e:
                    calls = None
                    warnings.append(f"{where}: {e}; unchanged")
                except (OSError, TypeError, SyntaxError) as e:
                    calls = [False]
                    warnings.append(
                        f"cannot read {where} ({type(e).__name__}), guarded"
                    )
                if calls == []:
                    warnings.append(f"{where} has no torch.cuda.graph call; unchanged")
                elif calls is None:
                    pass
                elif all(calls):
                    done.append(f"{where} passes a stream")
                else:
                    needed.append((where, cls, name))
        warning = warnings and "; ".join(warnings) + (
            f" (backport of PR {self.pr}: capture on the current stream, as 0.29.0)"
        )
        detail = "; ".join([f"{w} passes no stream" for w, _, _ in needed] + done)
        if needed:
            return base.Outcome(self.name, base.Status.NEEDED, detail, warning, needed)
        guarded = any(d.endswith(" guarded") for d in done)
        status = base.Status.ALREADY if guarded else base.Status.NOT_NEEDED
        return base.Outcome(self.name, status, detail, warning or None)

    def install(self, plan: base.Outcome) -> str:
        copies = [
            (cls, name, copy_of(cls.__dict__[name])) for _, cls, name in plan.data
        ]
        for cls, name, new in copies:  # every copy made before any is set
            setattr(cls, name, new)
        where = ", ".join(w for w, _, _ in plan.data)
        return f"{where} capture on the current stream (backport of PR {self.pr})"

    def uninstall(self) -> bool:
        found = [(c, n, c.__dict__[n]) for _, c, n in _loaded()]
        for cls, name, fn in found:
            if base.is_guarded(fn):
                setattr(cls, name, getattr(fn, base.MARKER))
        return any(base.is_guarded(fn) for _, _, fn in found)
