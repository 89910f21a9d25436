# SPDX-License-Identifier: Apache-2.0
"""Reading the metadata: what a ``CommonAttentionMetadata`` holds, as a
dataclass holds it, and which of its fields vLLM names as host values."""

from __future__ import annotations

import functools
import types
from typing import Any

#: Host fields whose names do not say so (the rule where all is on the CPU).
HOST_NAMES = frozenset({"is_prefilling", "rswa_prefix_lens", "req_idx"})


@functools.cache
def is_host_field(name: str) -> bool:
    """vLLM's naming of host values: ``*_cpu``, ``*_cpu_*``, ``*_np``,
    ``*_host``, ``cpu_*``, ``host_*``, or one of :data:`HOST_NAMES`."""
    n = name.lower()
    return (
        n.endswith(("_cpu", "_np", "_host"))
        or n.startswith(("cpu_", "host_"))
        or ("_cpu_" in n or n in HOST_NAMES)
    )


@functools.cache
def _slots(cls: type) -> tuple:
    """(name, descriptor) of each slot of ``cls`` and its bases."""
    return tuple(
        (name, slot)
        for c in reversed(cls.__mro__)
        for name, slot in vars(c).items()
        if type(slot) is types.MemberDescriptorType
    )


def fields_of(metadata: Any) -> dict[str, Any]:
    """What ``metadata`` holds, as a dataclass holds it: its instance dict and
    its slots across the class hierarchy; no property is ever read."""
    own, slots = getattr(metadata, "__dict__", None), _slots(type(metadata))
    if not slots:  # the common case: the instance dict itself (or a TypeError)
        return vars(metadata)
    fields = dict(own) if isinstance(own, dict) else {}
    for name, slot in slots:
        try:  # noqa: SIM105 (a context manager per slot costs more)
            fields[name] = slot.__get__(metadata)
        except AttributeError:  # a slot never set
            pass
    return fields
