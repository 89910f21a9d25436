# SPDX-License-Identifier: Apache-2.0
"""What a patch is. A :class:`Patch` looks at what vLLM imported (``plan``) and
changes it there (``install``), idempotently, under one lock. Every function we
install carries :data:`MARKER`, which holds what it replaced."""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from types import ModuleType
from typing import Any, ClassVar

from vllm_capture_guard.runtime import hooks, switch
from vllm_capture_guard.runtime.logs import Words

#: On each function we install: what it replaced there, or None.
MARKER = "__vllm_capture_guard_original__"
LOCK = threading.RLock()
OURS = "vllm_capture_guard"  # the package whose classes are never patched


class Status(Words):
    NEEDED = "needed"
    PATCHED = "patched"
    ALREADY = "already patched"
    NOT_NEEDED = "not needed"
    UNAVAILABLE = "unavailable"
    DISABLED = "disabled"
    INCOMPLETE = "incomplete"  # patched in part: its WARNING says what is left
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a patch found or did. ``data``: what its ``install`` needs."""

    patch: str
    status: Status
    detail: str
    warning: str | None = None
    data: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.patch}: {self.status} ({self.detail})"


def is_guarded(fn: Any) -> bool:
    """Whether ``fn`` (or the function a method holds) is one we installed."""
    return hasattr(getattr(fn, "__func__", fn), MARKER)


def original_of(fn: Any) -> Any:
    """The vLLM function behind our wrappers, or ``fn`` itself."""
    fn = getattr(fn, "__func__", fn)
    while is_guarded(fn) and hasattr(fn, "__wrapped__"):
        fn = getattr(fn.__wrapped__, "__func__", fn.__wrapped__)
    return fn


def wrap_method(cls: type, name: str, make: Any) -> None:
    """Give ``cls`` its own ``name``: ``make(what cls resolves now)``."""
    current = getattr(cls, name)
    wrapper = functools.wraps(current)(make(current))
    setattr(wrapper, MARKER, cls.__dict__.get(name))
    setattr(cls, name, wrapper)


def subclasses(root: type) -> list[type]:
    """``root`` and every class derived from it, bases first; not ours."""
    order, todo = [], [root]
    while todo:
        cls = todo.pop(0)
        if cls in order or cls.__module__.startswith(OURS):
            continue
        order.append(cls)
        todo.extend(cls.__subclasses__())
    return order


class Patch:
    """One fix. ``plan`` says NEEDED, ALREADY or NOT_NEEDED; ``install`` does it."""

    name: ClassVar[str]  # in log lines, status and VLLM_CAPTURE_GUARD_DISABLE
    former_names: ClassVar[tuple[str, ...]] = ()  # still switch it off, with a WARNING
    pr: ClassVar[str]  # the upstream pull request, e.g. "#51585"
    modules: ClassVar[tuple[str, ...]]  # the vLLM modules whose import applies it
    backends: ClassVar[tuple[str, ...]] = ()  # the attention backends it fixes
    targets: ClassVar[tuple[tuple[str, str], ...]] = ()  # (module, class) it changes
    reverted: bool = False  # set by the tools' revert; apply() clears it

    def plan(self, module: ModuleType) -> Outcome:
        raise NotImplementedError

    def install(self, plan: Outcome) -> str:
        raise NotImplementedError

    def decide(self) -> Outcome:
        """What the imported code needs; changes nothing."""
        if {self.name, *self.former_names} & switch.disabled_patches():
            why = f"listed in {switch.DISABLE_ENV}; vLLM's code is unchanged"
            return Outcome(self.name, Status.DISABLED, why)
        for name in self.modules:  # the first one vLLM has imported
            if hooks.complete(name):
                return self.plan(sys.modules[name])
        why = f"{', '.join(self.modules)} not imported (yet)"
        return Outcome(self.name, Status.UNAVAILABLE, why)

    def apply(self) -> Outcome:
        """Install what the imported code needs. Idempotent; imports nothing."""
        with LOCK:
            self.reverted = False
            plan = self.decide()
            if plan.status is not Status.NEEDED:
                return plan
            detail = self.install(plan)
            return Outcome(self.name, Status.PATCHED, detail, plan.warning)
