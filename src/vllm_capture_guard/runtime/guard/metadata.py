# SPDX-License-Identifier: Apache-2.0
"""Reading a metadata: the fields it holds, and which of them are host values
by vLLM's naming."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

#: Host values by name where every field is on the CPU (no other sign then).
HOST_NAMES = frozenset({"is_prefilling", "rswa_prefix_lens", "req_idx"})
HOST_SUFFIXES = ("_cpu", "_np", "_host")
HOST_PREFIXES = ("cpu_", "host_")


@functools.cache
def is_host_field(name: str) -> bool:
    """vLLM's naming of host values (``*_cpu``, ``*_np``, ``host_*``, ...)."""
    name = name.lower()
    if name.endswith(HOST_SUFFIXES) or name.startswith(HOST_PREFIXES):
        return True
    return "_cpu_" in name or name in HOST_NAMES


@functools.cache
def _slots(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, descriptor)`` of each slot of ``cls`` and its bases."""
    found = [(n, d) for c in reversed(cls.__mro__) for n, d in vars(c).items()]
    return tuple((n, d) for n, d in found if type(d) is types.MemberDescriptorType)


def fields_of(metadata: Any) -> dict[str, Any]:
    """What ``metadata`` holds, as a dataclass holds it: its instance dict and
    its slots across the class hierarchy. No property is ever read."""
    slots = _slots(type(metadata))
    if not slots:  # the common case: the instance dict itself (or a TypeError)
        return vars(metadata)
    own = getattr(metadata, "__dict__", None)
    fields = dict(own) if isinstance(own, dict) else {}
    for name, slot in slots:
        with contextlib.suppress(AttributeError):  # a slot never set
            fields[name] = slot.__get__(metadata)
    return fields
