# SPDX-License-Identifier: Apache-2.0
"""Undo a runtime patch, or its pending import hooks, in this process
(tests, tools). ``vllm serve`` never
reverts, so this lives here and not in the runtime: each patch's ``undo()`` (in
its module of :mod:`.fixes`) puts back what its ``install`` replaced, by the
marker every installed function carries, and :func:`revert` marks the patch
reverted so that a pending hook does not apply it again."""

from __future__ import annotations

from typing import Any

from vllm_capture_guard.runtime import hooks, patching


def revert(patch: patching.Patch) -> bool:
    """Undo ``patch.apply()``; True if there was something to undo."""
    with patching.LOCK:
        from vllm_capture_guard.tools.fixes import module_of

        patch.reverted = True
        return module_of(patch).undo()


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
    put(cls, name, getattr(getattr(current, "__func__", current), patching.MARKER))
    return True


def put(owner: Any, name: str, own: Any) -> None:
    """``owner.name = own``, or no attribute of its own where ``own`` is None."""
    if own is None:
        delattr(owner, name)
    else:
        setattr(owner, name, own)
