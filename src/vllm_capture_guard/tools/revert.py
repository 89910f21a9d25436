# SPDX-License-Identifier: Apache-2.0
"""Undo a runtime patch, or its pending import hooks, in this process
(tests, tools). ``vllm serve`` never
reverts, so this lives here and not in the runtime: it puts back what each
patch's ``install`` replaced, by the marker every installed function carries,
and marks the patch reverted so that a pending hook does not apply it again."""

from __future__ import annotations

import sys
from typing import Any

from vllm_capture_guard.runtime import base, hooks
from vllm_capture_guard.runtime.guard import install as rocm
from vllm_capture_guard.runtime.patches import graph_capture_stream as stream
from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as aiter


def revert(patch: base.Patch) -> bool:
    """Undo ``patch.apply()``; True if there was something to undo."""
    with base.LOCK:
        patch.reverted = True
        return _UNDO[patch.name]()


def pending_hooks() -> list[str]:
    """The module names the runtime's import hooks still wait for."""
    with hooks._lock:
        return sorted(hooks._pending)


def clear_hooks() -> None:
    """Forget every pending hook and take the finder off ``sys.meta_path``."""
    with hooks._lock:
        hooks._pending.clear()
        hooks._deferred.clear()
        if hooks._finder in sys.meta_path:
            sys.meta_path.remove(hooks._finder)


def unwrap_method(cls: type, name: str) -> bool:
    """Undo ``patches.wrap_method``; True if there was a wrapper to remove."""
    current = cls.__dict__.get(name)
    if current is None or not base.is_guarded(current):
        return False
    _put(cls, name, getattr(getattr(current, "__func__", current), base.MARKER))
    return True


def _put(owner: Any, name: str, own: Any) -> None:
    """``owner.name = own``, or no attribute of its own where ``own`` is None."""
    if own is None:
        delattr(owner, name)
    else:
        setattr(owner, name, own)


def _builder_guard() -> bool:
    group = getattr(sys.modules.get(rocm.UTILS), rocm.GROUP, None)
    done = isinstance(group, type) and unwrap_method(group, rocm.MAKE)
    root = getattr(sys.modules.get(rocm.BASE), rocm.BUILDER, None)
    watching = vars(root).get("__init_subclass__") if isinstance(root, type) else None
    if base.is_guarded(watching):
        _put(root, "__init_subclass__", getattr(watching.__func__, base.MARKER))
        done = True
    classes = reversed(rocm.builder_classes())
    return any([unwrap_method(c, rocm.METHOD) for c in classes]) or done


def _aiter_builder() -> bool:
    undone = False
    for backend in aiter.backends():
        current = vars(backend).get(aiter.GETTER)
        if not base.is_guarded(current):
            continue
        _put(backend, aiter.GETTER, getattr(current.__func__, base.MARKER))
        name, home = aiter._name(backend), sys.modules[backend.__module__]
        if name == aiter.BUILDER:  # vLLM's own binding back (0.29.0 on), or none
            _put(home, name, aiter._SAVED.pop(home.__name__, None))
        vars(aiter).pop(name, None)
        undone = True
    return undone


def _capture_stream() -> bool:
    found = [(c, n, c.__dict__[n]) for _, c, n in stream._loaded()]
    for cls, name, fn in found:
        if base.is_guarded(fn):
            setattr(cls, name, getattr(fn, base.MARKER))
    return any(base.is_guarded(fn) for _, _, fn in found)


_UNDO = {
    "rocm-attn-cpu-offsets": _builder_guard,
    "rocm-aiter-unified-builder": _aiter_builder,
    "graph-capture-stream": _capture_stream,
}
