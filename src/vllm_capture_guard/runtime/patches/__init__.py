# SPDX-License-Identifier: Apache-2.0
"""Backports of upstream vLLM fixes: one module per upstream fix.

Each module documents its patch under the same headings (What, Symptom, Cause,
Upstream, Affected, Detected, How, Delete when) and defines one :class:`Patch`.
The base class runs the sequence once, under one lock: is the patch switched
off? is its module imported? what does the installed code need (``plan``, by
reading source, never by running it or by version)? then ``install``. Patching
is idempotent and thread-safe; wrappers never stack.

A patch never imports a vLLM module: it acts on what vLLM has imported, when
vLLM imports it and again right before capture (:mod:`..plugin`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

from vllm_capture_guard.runtime import switch

#: Set on every function we install; its value is what it replaced in the
#: class's own ``__dict__`` (``None`` when the class only inherited it).
MARKER = "__vllm_capture_guard_original__"
#: One lock for every patch: hooks, the capture entry and the tools may race.
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
    #: Set when the fix went in because the code was in doubt.
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
    """The vLLM function behind our wrappers (what each one resolved when it
    was made), or ``fn`` itself."""
    fn = getattr(fn, "__func__", fn)
    while is_guarded(fn) and hasattr(fn, "__wrapped__"):
        fn = getattr(fn.__wrapped__, "__func__", fn.__wrapped__)
    return fn


def is_guarded(fn: Any) -> bool:
    return hasattr(getattr(fn, "__func__", fn), MARKER)


def wrap_method(cls: type, name: str, make: Callable[[Any], Any]) -> None:
    """Give ``cls`` its own ``name`` = ``make(what cls resolves now)``."""
    wrapper = functools.wraps(getattr(cls, name))(make(getattr(cls, name)))
    setattr(wrapper, MARKER, cls.__dict__.get(name))
    setattr(cls, name, wrapper)


def unwrap_method(cls: type, name: str) -> bool:
    """Undo :func:`wrap_method`; True if there was a wrapper to remove."""
    current = cls.__dict__.get(name)
    if current is None or not is_guarded(current):
        return False
    own = getattr(getattr(current, "__func__", current), MARKER)
    if own is None:
        delattr(cls, name)
    else:
        setattr(cls, name, own)
    return True


def subclasses(root: type) -> list[type]:
    """``root`` and every class derived from it, base classes first; never
    our own classes."""
    order, todo = [], [root]
    while todo:
        cls = todo.pop(0)
        if cls not in order and not cls.__module__.startswith("vllm_capture_guard"):
            order.append(cls)
            todo.extend(cls.__subclasses__())
    return order


class Patch:
    """One upstream fix. Subclasses set the class attributes and implement
    ``plan``/``install``/``uninstall``; callers use ``apply``/``revert`` (and
    the tools ``inspect``). Those may raise; the plugin turns that into one
    WARNING."""

    #: Short name: log lines, ``status``, ``VLLM_CAPTURE_GUARD_DISABLE``.
    name: ClassVar[str]
    #: The upstream pull request this backports, e.g. ``"#51585"``.
    pr: ClassVar[str]
    #: vLLM modules whose import triggers the patch; the first is the main one.
    modules: ClassVar[tuple[str, ...]]
    #: Registry names of the attention backends whose capture it fixes.
    backends: ClassVar[tuple[str, ...]] = ()
    #: (module, class) of the vLLM classes it may change.
    targets: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: Set by :meth:`revert`; :meth:`apply` clears it.
    reverted: bool = False

    def plan(self, module: ModuleType) -> Plan:
        raise NotImplementedError

    def install(self, plan: Plan) -> str:
        raise NotImplementedError

    def uninstall(self) -> bool:
        raise NotImplementedError

    def _decide(self) -> Outcome | Plan:
        if self.name in switch.disabled_patches():
            why = f"listed in {switch.DISABLE_ENV}; vLLM's code is unchanged"
            return Outcome(self.name, Status.DISABLED, why)
        module = sys.modules.get(self.modules[0])
        if module is None:
            why = f"{self.modules[0]} is not imported"
            return Outcome(self.name, Status.UNAVAILABLE, why)
        return self.plan(module)

    def inspect(self) -> Outcome:
        """For the tools: import the main module, then say what this vLLM
        needs, changing nothing."""
        with LOCK:
            try:
                importlib.import_module(self.modules[0])
            except Exception as e:
                why = f"cannot import {self.modules[0]}: {type(e).__name__}: {e}"
                return Outcome(self.name, Status.UNAVAILABLE, why[:300])
            decided = self._decide()
            if isinstance(decided, Outcome):
                return decided
            return Outcome(self.name, decided.status, decided.detail, decided.warning)

    def apply(self) -> Outcome:
        """Install what the imported code needs. Idempotent; imports nothing."""
        with LOCK:
            self.reverted = False
            decided = self._decide()
            if isinstance(decided, Outcome):
                return decided
            if decided.status is not Status.NEEDED:
                return Outcome(self.name, decided.status, decided.detail)
            detail = self.install(decided)
            return Outcome(self.name, Status.PATCHED, detail, decided.warning)

    def revert(self) -> bool:
        """Undo :meth:`apply` in this process (tests, tools)."""
        with LOCK:
            self.reverted = True
            return self.uninstall()


def _patches() -> tuple[Patch, ...]:
    from vllm_capture_guard.runtime.patches.rocm_aiter_unified_builder import (
        RocmAiterUnifiedBuilder,
    )
    from vllm_capture_guard.runtime.patches.rocm_attn_cpu_offsets import (
        RocmAttnCpuOffsets,
    )

    # Order matters: the AITER backport derives from the builder that the first
    # one guards, and vLLM imports rocm_attn before the AITER module.
    return (RocmAttnCpuOffsets(), RocmAiterUnifiedBuilder())


#: Every patch, in the order they apply.
PATCHES: tuple[Patch, ...] = _patches()
NAMES = frozenset(p.name for p in PATCHES)


def by_name(name: str) -> Patch:
    for patch in PATCHES:
        if patch.name == name:
            return patch
    raise KeyError(name)
