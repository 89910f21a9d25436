# SPDX-License-Identifier: Apache-2.0
"""Capture CUDA graphs on the current stream (backport of PR #53818, in 0.29.0;
delete when 0.29.0 is the oldest supported): torch's own side stream has no AITER
split-K workspace. Each site gets a copy of its function reading ``torch``,
``torch.cuda`` and ``torch.cuda.graph`` as stand-ins that fill in the stream."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import types
from typing import Any

from vllm_capture_guard.runtime import patching

#: (module, class, function): the call sites that PR #53818 changed.
_WORKER = "vllm.v1.worker."
SITES = (
    (_WORKER + "gpu.cudagraph_utils", "CudaGraphManager", "capture"),
    (_WORKER + "encoder_cudagraph", "EncoderCudaGraphManager", "_capture_budget_graph"),
    ("vllm.v1.spec_decode.gemma4", "Gemma4Proposer", "_setup_centroids_cuda_graphs"),
)


def current_stream() -> Any:
    """The stream 0.29.0 passes: vLLM's own ``current_stream()``."""
    found = getattr(sys.modules.get("vllm.utils.torch_utils"), "current_stream", None)
    return found() if callable(found) else sys.modules["torch"].cuda.current_stream()


def graph(cuda_graph: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.cuda.graph``, on the current stream where the stream is None."""
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
    """A module's globals, read live, torch and its graph read as the stand-ins."""

    def __init__(self, module: dict) -> None:
        super().__init__(__builtins__=module.get("__builtins__"))
        self.module = module

    def __missing__(self, key: str) -> Any:
        value, torch = self.module[key], sys.modules["torch"]
        if value is torch:
            return _Torch()
        if value is torch.cuda:
            return _Torch.cuda
        return graph if value is torch.cuda.graph else value

    def __setitem__(self, key: str, value: Any) -> None:  # globals()[k] = v
        self.module[key] = value


_MISSING = object()  # a name the function's globals do not hold


def unreached(fn: Any) -> list[str]:
    """The ``with <...graph>(...)`` in ``fn`` the stand-ins do not reach (source)."""
    fn, torch, found = inspect.unwrap(fn), sys.modules["torch"], []
    reached = {(): torch.cuda.graph, ("graph",): torch.cuda, ("cuda", "graph"): torch}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if isinstance(node, ast.Global):
            found.append("a global statement (the copy has its own globals)")
        for item in getattr(node, "items", ()):
            call = item.context_expr
            name = ast.unparse(call.func) if isinstance(call, ast.Call) else ""
            if not name.lower().endswith("graph"):
                continue
            root, *rest = name.split(".")
            top = fn.__globals__.get(root, _MISSING)  # what the stand-ins replace
            if top is not reached.get(tuple(rest)):
                found.append(f"{name}(...) at line {call.lineno}")
    return found


def _holds(cell: Any, obj: Any) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def copy_of(fn: Any) -> Any:
    """``fn`` reading torch through the stand-ins (a wrapper, with what it wraps)."""
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
    setattr(new, patching.MARKER, fn)
    return new


def loaded_sites() -> list[tuple[str, type, str]]:
    """``(where, class, function name)`` of each site whose module vLLM imported."""
    found = []
    for module, cls_name, name in SITES:
        cls = getattr(sys.modules.get(module), cls_name, None)
        if isinstance(cls, type) and inspect.isfunction(cls.__dict__.get(name)):
            found.append((f"{cls_name}.{name}", cls, name))
    return found


class GraphCaptureStream(patching.Patch):
    name, pr = "graph-capture-stream", "#53818"
    modules = tuple(dict.fromkeys(m for m, _, _ in SITES))
    targets = tuple((module, cls) for module, cls, _ in SITES)  # no backend's fix

    def plan(self, module: types.ModuleType) -> patching.Outcome:
        todo, done, gaps = [], [], []
        for where, cls, name in loaded_sites():
            function = cls.__dict__[name]
            if patching.is_guarded(function):
                done.append(where)
                continue
            todo.append((where, cls, name))
            try:
                gaps += [f"{where}: {gap}" for gap in unreached(function)]
            except (OSError, TypeError, SyntaxError) as e:
                gaps.append(f"{where}: its source cannot be read ({type(e).__name__})")
        sites = ", ".join(where for where, _, _ in todo) or ", ".join(done)
        detail = f"{sites} capture on the current stream where none is given"
        warning = None
        if gaps:
            warning = (
                f"patched, but cannot reach {'; '.join(gaps)}: capture there may "
                f"stay on torch's side stream (backport of PR {self.pr})"
            )
        status = patching.Status.NEEDED if todo else patching.Status.ALREADY
        return patching.Outcome(self.name, status, detail, warning, todo)

    def install(self, plan: patching.Outcome) -> str:
        copies = [
            (cls, name, copy_of(cls.__dict__[name])) for _, cls, name in plan.data
        ]
        for cls, name, copy in copies:  # every copy made before any is set
            setattr(cls, name, copy)
        return plan.detail + f" (backport of PR {self.pr})"

    def apply(self) -> patching.Outcome:
        outcome = super().apply()
        if outcome.warning and outcome.status is patching.Status.PATCHED:
            # patched where it can reach, with a WARNING for the rest
            return dataclasses.replace(outcome, status=patching.Status.INCOMPLETE)
        return outcome
