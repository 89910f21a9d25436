# SPDX-License-Identifier: Apache-2.0
"""A :class:`Patch` looks at what vLLM imported (``plan``) and changes it there
(``install``), idempotently, under one lock; and the log of what is said once."""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any, ClassVar

from vllm_capture_guard.runtime import hooks, switch

MARKER = "__vllm_capture_guard_original__"  # on ours: what we replaced, or None
LOCK = threading.RLock()


class Status(str, enum.Enum):
    NEEDED, PATCHED, ALREADY = "needed", "patched", "already patched"
    NOT_NEEDED, UNAVAILABLE, DISABLED = "not needed", "unavailable", "disabled"
    INCOMPLETE, FAILED = "incomplete", "failed"  # incomplete: a WARNING says why

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Outcome:  # what a patch found or did; ``data``: what ``install`` needs
    patch: str
    status: Status
    detail: str
    warning: str | None = None
    data: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.patch}: {self.status} ({self.detail})"


def is_guarded(fn: Any) -> bool:
    return hasattr(getattr(fn, "__func__", fn), MARKER)


def original_of(fn: Any) -> Any:
    """The vLLM function behind our wrappers, or ``fn`` itself."""
    fn = getattr(fn, "__func__", fn)
    while is_guarded(fn) and hasattr(fn, "__wrapped__"):
        fn = getattr(fn.__wrapped__, "__func__", fn.__wrapped__)
    return fn


def wrap_method(cls: type, name: str, make: Any) -> None:
    """Give ``cls`` its own ``name`` = ``make(what cls resolves now)``."""
    wrapper = functools.wraps(getattr(cls, name))(make(getattr(cls, name)))
    setattr(wrapper, MARKER, cls.__dict__.get(name))
    setattr(cls, name, wrapper)


def subclasses(root: type) -> list[type]:
    """``root`` and every class derived from it, bases first; not ours."""
    order, todo = [], [root]
    while todo:
        cls = todo.pop(0)
        if cls not in order and not cls.__module__.startswith("vllm_capture_guard"):
            order.append(cls)
            todo.extend(cls.__subclasses__())
    return order


class Patch:  # ``plan`` (NEEDED, ALREADY or NOT_NEEDED), ``install``
    name: ClassVar[str]  # log lines, status, VLLM_CAPTURE_GUARD_DISABLE
    pr: ClassVar[str]  # the upstream pull request, e.g. "#51585"
    modules: ClassVar[tuple[str, ...]]  # whose import applies it
    reverted: bool = False  # set by tools.revert; apply() clears it

    def plan(self, module: ModuleType) -> Outcome:
        raise NotImplementedError

    def install(self, plan: Outcome) -> str:
        raise NotImplementedError

    def decide(self) -> Outcome:
        """What the imported code needs; changes nothing."""
        if self.name in switch.disabled_patches():
            why = f"listed in {switch.DISABLE_ENV}; vLLM's code is unchanged"
            return Outcome(self.name, Status.DISABLED, why)
        for name in self.modules:  # the first that vLLM has imported
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
            return Outcome(self.name, Status.PATCHED, self.install(plan), plan.warning)


LOG = logging.getLogger("vllm.capture_guard")  # vLLM's handler and format
_said: set[str] = set()


def say(message: str, warning: bool = False) -> None:
    """Log ``message`` once per process: INFO, or WARNING."""
    with LOCK:
        if message in _said:
            return
        _said.add(message)
    (LOG.warning if warning else LOG.info)(f"vllm-capture-guard: {message}")


def short(e: BaseException) -> str:
    """An error in at most 120 characters."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 120 else text[:117] + "..."
