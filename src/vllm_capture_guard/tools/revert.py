# SPDX-License-Identifier: Apache-2.0
"""Undo a runtime patch, or its pending import hooks, in this process
(tests, tools). ``vllm serve`` never
reverts, so this lives here and not in the runtime: it puts back what each
patch's ``install`` replaced, by the marker every installed function carries,
and marks the patch reverted so that a pending hook does not apply it again."""

from __future__ import annotations

import sys
from typing import Any

from vllm_capture_guard.runtime import hooks, patching
from vllm_capture_guard.runtime.guard import install as rocm
from vllm_capture_guard.runtime.patches import graph_capture_stream as stream
from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as aiter


def revert(patch: patching.Patch) -> bool:
    """Undo ``patch.apply()``; True if there was something to undo."""
    with patching.LOCK:
        patch.reverted = True
        return _UNDO[patch.name]()


def pending_hooks() -> list[str]:
    """The module names the runtime's import hooks still wait for."""
    return hooks.waiting_for()


def clear_hooks() -> None:
    """Forget every pending hook and take the finder off ``sys.meta_path``."""
    hooks.stop_watching()


def unwrap_method(cls: type, name: str) -> bool:
    """Undo ``patches.wrap_method``; True if there was a wrapper to remove."""
    current = cls.__dict__.get(name)
    if current is None or not patching.is_guarded(current):
        return False
    _put(cls, name, getattr(getattr(current, "__func__", current), patching.MARKER))
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
    if patching.is_guarded(watching):
        _put(root, "__init_subclass__", getattr(watching.__func__, patching.MARKER))
        done = True
    classes = reversed(rocm.builder_classes())
    return any([unwrap_method(c, rocm.METHOD) for c in classes]) or done


def _aiter_builder() -> bool:
    undone = False
    for backend in aiter.backends():
        current = vars(backend).get(aiter.GETTER)
        if not patching.is_guarded(current):
            continue
        _put(backend, aiter.GETTER, getattr(current.__func__, patching.MARKER))
        name, home = aiter.builder_name(backend), sys.modules[backend.__module__]
        if name == aiter.BUILDER:  # vLLM's own binding back (0.29.0 on), or none
            _put(home, name, aiter.REPLACED_BINDINGS.pop(home.__name__, None))
        vars(aiter).pop(name, None)
        undone = True
    return undone


def _capture_stream() -> bool:
    undone = False
    for _where, cls, name in stream.loaded_sites():
        function = cls.__dict__[name]
        if patching.is_guarded(function):
            setattr(cls, name, getattr(function, patching.MARKER))
            undone = True
    return undone


_UNDO = {
    "rocm-attn-cpu-offsets": _builder_guard,
    "rocm-aiter-unified-builder": _aiter_builder,
    "graph-capture-stream": _capture_stream,
}
