# SPDX-License-Identifier: Apache-2.0
"""Backports of upstream vLLM fixes, one module per upstream fix.

Every patch module documents itself with the same headings (What, Symptom,
Cause, Upstream, Affected, Detected, How, Delete when) and exposes ``NAME`` and
``inspect() -> Outcome`` (does this vLLM need the fix? changes nothing) and
``apply() -> Outcome`` (inspect, then patch if needed). Both decide by
behaviour, ``apply`` is idempotent, and either may raise: the plugin turns that
into one warning, and a patch installs nothing unless it succeeds.

Order matters: :data:`PATCHES` lists the ROCm builder fix first, because the
AITER unified backport subclasses that builder.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

#: Attribute set on every function we install; its value is the original.
MARKER = "__vllm_capture_guard_original__"

NEEDED = "needed"
PATCHED = "patched"
ALREADY = "already patched"
NOT_NEEDED = "not needed"
UNAVAILABLE = "unavailable"


@dataclasses.dataclass(frozen=True)
class Outcome:
    patch: str
    status: str
    detail: str

    def __str__(self) -> str:
        return f"{self.patch}: {self.status} ({self.detail})"


def original_of(fn: Any) -> Any:
    """The vLLM function behind one of our wrappers, or ``fn`` itself."""
    return getattr(fn, MARKER, fn)


def is_guarded(fn: Any) -> bool:
    return hasattr(fn, MARKER)


def wrap_method(
    cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``cls.name`` by ``make(original)``, marked so that a second call
    and :func:`unwrap_method` can find the original again."""
    original = cls.__dict__[name]
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, MARKER, original)
    setattr(cls, name, wrapper)


def unwrap_method(cls: type, name: str) -> bool:
    """Put vLLM's own function back. True if there was a wrapper to remove."""
    current = cls.__dict__.get(name)
    if current is None or not is_guarded(current):
        return False
    setattr(cls, name, original_of(current))
    return True
