# SPDX-License-Identifier: Apache-2.0
"""Capture CUDA graphs on the current stream.

What:
    ``CudaGraphManager.capture`` (``vllm/v1/worker/gpu/cudagraph_utils.py``,
    Model Runner V2's FULL capture), ``EncoderCudaGraphManager
    ._capture_budget_graph`` (``vllm/v1/worker/encoder_cudagraph.py``) and
    ``Gemma4Proposer._setup_centroids_cuda_graphs``
    (``vllm/v1/spec_decode/gemma4.py``).

Symptom:
    Start-up dies in full-graph capture, e.g. on ROCm with AITER (Kimi-K3,
    TP8, MI355X, Model Runner V2, FULL_AND_PIECEWISE): ``splitk workspace not
    initialized for the current CUDA stream. Call
    aiter.opus_gemm_workspace_init()``.

Cause:
    These functions call ``torch.cuda.graph(...)`` without ``stream=``, so
    torch captures on its own side stream, not on the stream that
    ``graph_capture()`` made current and that warm-up ran on. State that a
    kernel keeps per stream (AITER's split-K workspace, custom all-reduce) is
    missing on the side stream.

Upstream:
    vllm-project/vllm PR #53818, released in 0.29.0: the three calls pass
    ``stream=current_stream()``.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them.

Detected:
    By structure, never by running a capture: the source of each function
    that vLLM has imported (``inspect.getsource``, ``ast``). Needed where a
    ``torch.cuda.graph(...)`` call passes no stream; left alone where every
    such call passes one. A source that cannot be read is guarded, with one
    WARNING; a function with no ``torch.cuda.graph`` call, or whose module's
    ``torch`` is not torch, is left alone, with one WARNING (this patch cannot
    change how it captures).

How:
    The class gets a copy of the function: the same code, defaults, closure
    and decorators (a decorator's wrapper is copied with the copy of what it
    wraps), whose globals are a view of its module's. Every name is read from
    the module at each use, except ``torch``, which reads through a stand-in
    that forwards everything to torch, except ``torch.cuda.graph``: while the
    copy runs on this thread, that is torch's own ``graph`` given vLLM's
    current stream (``vllm.utils.torch_utils.current_stream()``, what 0.29.0
    passes) when the caller passed none.

    Why not replace ``torch.cuda.graph`` for the duration of the call: that
    is one object for the whole process, and every other thread and library
    would see the replacement. Here torch, ``torch.cuda`` and
    ``torch.cuda.graph`` stay what they are; only these functions' code sees
    the difference, only on the thread that runs them, only while they run.
    A caller that passes a stream is not changed. The cost is a slower lookup
    of module globals inside these three start-up functions.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import threading
import types
from typing import Any

from vllm_capture_guard.runtime.patches import MARKER, Patch, Plan, Status

#: (module, class, function): the call sites that PR #53818 changed.
SITES = (
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "capture"),
    ("vllm.v1.worker.encoder_cudagraph", "EncoderCudaGraphManager",
     "_capture_budget_graph"),
    ("vllm.v1.spec_decode.gemma4", "Gemma4Proposer", "_setup_centroids_cuda_graphs"),
)  # fmt: skip
_running = threading.local()


def current_stream() -> Any:
    """The stream 0.29.0 passes: vLLM's own ``current_stream()``."""
    found = getattr(sys.modules.get("vllm.utils.torch_utils"), "current_stream", None)
    return found() if callable(found) else sys.modules["torch"].cuda.current_stream()


def graph(*args: Any, **kwargs: Any) -> Any:
    """``torch.cuda.graph``, on the current stream unless one is given."""
    if len(args) >= 3:
        if args[2] is None:
            args = (*args[:2], current_stream(), *args[3:])
    elif kwargs.get("stream") is None:
        kwargs["stream"] = current_stream()
    return sys.modules["torch"].cuda.graph(*args, **kwargs)


class _Cuda:
    def __getattr__(self, name: str) -> Any:
        if name == "graph" and getattr(_running, "depth", 0):
            return graph
        return getattr(sys.modules["torch"].cuda, name)


class _Torch:
    """``torch`` as the copies see it."""

    cuda = _Cuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.modules["torch"], name)


class _Globals(dict):
    """A module's globals, read live, with ``torch`` read through ``_Torch``."""

    def __init__(self, module: dict) -> None:
        super().__init__(torch=_Torch())
        if "__builtins__" in module:  # read by FunctionType, not via __missing__
            self["__builtins__"] = module["__builtins__"]
        self.module = module

    def __missing__(self, key: str) -> Any:
        return self.module[key]


def stream_calls(fn: Any) -> list[bool]:
    """For each ``torch.cuda.graph(...)`` call in ``fn``'s source: does it
    pass a stream? Raises OSError/TypeError/SyntaxError if unreadable."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    return [
        len(node.args) >= 3 or any(k.arg == "stream" for k in node.keywords)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda.graph"
    ]


def _holds(cell: Any, obj: Any) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def copy_of(fn: Any) -> Any:
    """``fn`` reading ``torch`` through the view; a wrapper (``__wrapped__``)
    is copied with the copy of the function it holds in its closure."""
    inner = getattr(fn, "__wrapped__", None)
    cells = list(fn.__closure__ or ())
    if inner is not None:
        held = [i for i, c in enumerate(cells) if _holds(c, inner)]
        if len(held) != 1:
            raise TypeError(f"{fn.__qualname__} does not hold what it wraps")
        cells[held[0]] = types.CellType(copy_of(inner))
        scope = fn.__globals__
    else:
        scope = _Globals(fn.__globals__)
    new = types.FunctionType(
        fn.__code__, scope, fn.__name__, fn.__defaults__, tuple(cells) or None
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(new, fn)


def guarded(own: Any) -> Any:
    copy = copy_of(own)

    @functools.wraps(own)
    def run(*args: Any, **kwargs: Any) -> Any:
        _running.depth = getattr(_running, "depth", 0) + 1
        try:
            return copy(*args, **kwargs)
        finally:
            _running.depth -= 1

    setattr(run, MARKER, own)
    return run


def _loaded() -> list[tuple[str, type, str]]:
    """``(where, class, name)`` of each site whose module vLLM imported."""
    found = []
    for module, cls_name, name in SITES:
        cls = getattr(sys.modules.get(module), cls_name, None)
        if isinstance(cls, type) and inspect.isfunction(cls.__dict__.get(name)):
            found.append((f"{cls_name}.{name}", cls, name))
    return found


class GraphCaptureStream(Patch):
    name = "graph-capture-stream"
    pr = "#53818"
    modules = tuple(dict.fromkeys(m for m, _, _ in SITES))
    backends = ()  # not an attention backend's fix
    targets = tuple((m, c) for m, c, _ in SITES)

    def follow(self) -> list[str]:
        return list(self.modules[1:])

    def plan(self) -> Plan:
        needed, already, fixed, warnings = [], [], [], []
        for where, cls, name in _loaded():
            if hasattr(cls.__dict__[name], MARKER):
                already.append(where)
                continue
            inner = inspect.unwrap(cls.__dict__[name])
            if (
                getattr(inner, "__globals__", {}).get("torch")
                is not sys.modules["torch"]
            ):
                warnings.append(f"{where}: its `torch` is not torch; unchanged")
                continue
            try:
                calls = stream_calls(cls.__dict__[name])
            except (OSError, TypeError, SyntaxError) as e:
                needed.append((where, cls, name))
                warnings.append(f"cannot read {where} ({type(e).__name__}), guarded")
                continue
            if not calls:
                warnings.append(f"{where} has no torch.cuda.graph call; unchanged")
            elif all(calls):
                fixed.append(where)
            else:
                needed.append((where, cls, name))
        warning = None
        if warnings:
            warning = (
                "; ".join(warnings) + f" (backport of PR {self.pr}: capture on the "
                "current stream, as vLLM 0.29.0)"
            )
        parts = [f"{w} passes no stream" for w, _, _ in needed]
        parts += [f"{w} guarded" for w in already]
        parts += [f"{w} passes a stream" for w in fixed]
        detail = "; ".join(parts) or "no capture function of PR #53818 imported"
        if needed:
            return Plan(Status.NEEDED, detail, warning, needed)
        status = Status.ALREADY if already else Status.NOT_NEEDED
        return Plan(status, detail, warning)

    def install(self, plan: Plan) -> str:
        runs = [(cls, name, guarded(cls.__dict__[name])) for _, cls, name in plan.data]
        for cls, name, run in runs:  # every copy made before any is set
            setattr(cls, name, run)
        where = ", ".join(w for w, _, _ in plan.data)
        return f"{where} capture on the current stream (backport of PR {self.pr})"

    def uninstall(self) -> bool:
        done = False
        for _, cls, name in _loaded():
            current = cls.__dict__[name]
            if hasattr(current, MARKER):
                setattr(cls, name, getattr(current, MARKER))
                done = True
        return done
