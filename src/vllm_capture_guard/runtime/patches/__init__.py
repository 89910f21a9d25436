# SPDX-License-Identifier: Apache-2.0
"""Backports of upstream vLLM fixes: one module per upstream fix.

Every patch is a :class:`Patch`. Its module documents it under the same
headings (What, Symptom, Cause, Upstream, Affected, Detected, How, Delete
when). The base class does the sequence once, under one lock: is the patch
switched off? what does the installed vLLM do (``plan``, by behaviour, never
by version)? is our fix already there? then ``install``. Patching is
idempotent and thread-safe; wrappers never stack.

Fail closed: a patch installs its fix unless a probe that ran to completion
proved the installed vLLM does not need it. When it installs the fix without
that proof it says why in ``Outcome.warning``, and the plugin logs it once.

Adding a backport:

1. one module here, with the headings above and one ``Patch`` subclass
   (``name``, ``pr``, ``modules`` to hook, ``backends`` it fixes, ``targets``
   it may change; ``plan``/``install``/``uninstall``);
2. its instance in :data:`PATCHES` at the bottom of this file;
3. its tests under ``tests/runtime/patches/``. The tools (``check``, the
   identity check, the oracle, the version matrix) take their backends and
   classes from the patch, so nothing else needs editing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from vllm_capture_guard.runtime import switch

#: Attribute set on every function we install; its value is the original
#: (``None`` when the class only inherited it).
MARKER = "__vllm_capture_guard_original__"

#: One lock for every patch: the plugin, the hooks and the tools may race.
LOCK = threading.RLock()


class Status(str, enum.Enum):
    NEEDED = "needed"
    PATCHED = "patched"
    ALREADY = "already patched"
    NOT_NEEDED = "not needed"
    UNAVAILABLE = "unavailable"
    DISABLED = "disabled"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


#: The statuses after which vLLM's capture behaves as upstream's fix.
FIXED = frozenset({Status.PATCHED, Status.ALREADY, Status.NOT_NEEDED})


@dataclasses.dataclass(frozen=True)
class Outcome:
    patch: str
    status: Status
    detail: str
    #: Set when the fix is installed without proof that it is needed.
    warning: str | None = None

    def __str__(self) -> str:
        return f"{self.patch}: {self.status} ({self.detail})"


@dataclasses.dataclass
class Plan:
    """What ``install`` would do; ``status`` is NEEDED, ALREADY or NOT_NEEDED."""

    status: Status
    detail: str
    warning: str | None = None
    data: Any = None


def original_of(fn: Any) -> Any:
    """The vLLM function behind one of our wrappers, or ``fn`` itself."""
    while hasattr(fn, MARKER) and getattr(fn, MARKER) is not None:
        fn = getattr(fn, MARKER)
    return fn


def is_guarded(fn: Any) -> bool:
    return hasattr(getattr(fn, "__func__", fn), MARKER)


def wrap_method(
    cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Give ``cls`` its own ``name`` = ``make(what cls resolves now)``, marked
    so that :func:`unwrap_method` puts back exactly what was there."""
    own = cls.__dict__.get(name)
    current = getattr(cls, name)
    wrapper = functools.wraps(current)(make(current))
    setattr(wrapper, MARKER, own)
    setattr(cls, name, wrapper)


def unwrap_method(cls: type, name: str) -> bool:
    """Undo :func:`wrap_method`. True if there was a wrapper to remove."""
    current = cls.__dict__.get(name)
    if current is None or not is_guarded(current):
        return False
    own = getattr(current, MARKER)
    if own is None:
        delattr(cls, name)
    else:
        setattr(cls, name, own)
    return True


class Patch:
    """One upstream fix. Subclasses set the class attributes and implement
    ``plan``/``install``/``uninstall``; callers use ``inspect``/``apply``/
    ``revert``, which may raise (the plugin turns that into one warning)."""

    #: Short name: log lines, ``status``, ``VLLM_CAPTURE_GUARD_DISABLE``.
    name: ClassVar[str]
    #: The upstream pull request this backports, e.g. ``"#51585"``.
    pr: ClassVar[str]
    #: vLLM modules whose import triggers the patch (hooks), first the main one.
    modules: ClassVar[tuple[str, ...]]
    #: Registry names of the backends whose capture it fixes.
    backends: ClassVar[tuple[str, ...]]
    #: (module, class) of the vLLM classes it may change.
    targets: ClassVar[tuple[tuple[str, str], ...]]

    def plan(self) -> Plan:
        raise NotImplementedError

    def fallback(self, error: Exception) -> Plan:
        """The plan when :meth:`plan` itself failed: fail closed if possible."""
        raise error

    def follow(self) -> list[str]:
        """More vLLM modules whose import should re-run :meth:`apply`."""
        return []

    def install(self, plan: Plan) -> str:
        raise NotImplementedError

    def uninstall(self) -> bool:
        raise NotImplementedError

    def import_target(self) -> Any:
        return importlib.import_module(self.modules[0])

    def _unavailable(self) -> Outcome | None:
        """UNAVAILABLE if the main module cannot be imported at all (0.33's
        AITER module asks the GPU at import); None once it is imported."""
        if self.modules[0] in sys.modules:
            return None
        try:
            self.import_target()
        except Exception as e:
            why = f"cannot import {self.modules[0]}: {type(e).__name__}: {e}"
            return Outcome(self.name, Status.UNAVAILABLE, why[:300])
        return None

    def inspect(self) -> Outcome:
        """What this vLLM needs; changes nothing. A vLLM that cannot be
        checked gives FAILED, with the reason."""
        with LOCK:
            missing = self._unavailable()
            if missing is not None:
                return missing
            try:
                plan = self.plan()
            except Exception as e:
                return Outcome(self.name, Status.FAILED, f"{type(e).__name__}: {e}")
            return Outcome(self.name, plan.status, plan.detail, plan.warning)

    #: Set by :meth:`revert`: the plugin's hooks then leave this patch out.
    reverted: bool = False
    #: Called with an :class:`Outcome` when the patch acts on its own later
    #: (a class defined after its module was imported); set by the plugin.
    notify: Callable[[Outcome], None] | None = None

    def apply(self) -> Outcome:
        """Inspect, then install what is needed. Idempotent. Raises only when
        the installed vLLM can neither be checked nor fixed blindly."""
        with LOCK:
            self.reverted = False
            if self.name in switch.disabled_patches():
                return Outcome(
                    self.name,
                    Status.DISABLED,
                    f"listed in {switch.DISABLE_ENV}; vLLM's code is unchanged",
                )
            missing = self._unavailable()
            if missing is not None:
                return missing
            try:
                plan = self.plan()
            except Exception as e:  # fail closed where the patch can
                plan = self.fallback(e)
            if plan.status is not Status.NEEDED:
                return Outcome(self.name, plan.status, plan.detail, plan.warning)
            detail = self.install(plan)
            return Outcome(self.name, Status.PATCHED, detail, plan.warning)

    def revert(self) -> bool:
        """Undo :meth:`apply` in this process (tests, tools); hooks still
        pending in this process no longer apply it."""
        with LOCK:
            self.reverted = True
            return self.uninstall()


def _patches() -> tuple[Patch, ...]:
    from vllm_capture_guard.runtime.patches.graph_capture_stream import (
        GraphCaptureStream,
    )
    from vllm_capture_guard.runtime.patches.rocm_aiter_unified_builder import (
        RocmAiterUnifiedBuilder,
    )
    from vllm_capture_guard.runtime.patches.rocm_attn_cpu_offsets import (
        RocmAttnCpuOffsets,
    )

    # Order matters: the AITER backport subclasses the builder that the first
    # one guards, and vLLM imports rocm_attn before the AITER module. The
    # capture stream is independent of both.
    return (RocmAttnCpuOffsets(), RocmAiterUnifiedBuilder(), GraphCaptureStream())


#: Every patch, in the order they apply.
PATCHES: tuple[Patch, ...] = _patches()


def by_name(name: str) -> Patch:
    for patch in PATCHES:
        if patch.name == name:
            return patch
    raise KeyError(name)
