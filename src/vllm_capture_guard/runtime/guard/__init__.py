# SPDX-License-Identifier: Apache-2.0
"""The capture guard: no capture may change the host values other builders read
(PR #51585's rule, ``rocm-attn-cpu-offsets``, on every release). Here, reading the
metadata; :mod:`.keep` saves and puts back, :mod:`.copies` follows the copies and
waits, :mod:`.install` installs the guarded call."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

PR = "#51585"
KEPT = f"kept from the other builders (backport of PR {PR})"
SEEN: dict[str, dict] = {}  # per builder class: {"calls": n, "wrote": {field: size}}
HOST_NAMES = frozenset({"is_prefilling", "rswa_prefix_lens", "req_idx"})  # all-CPU


@functools.cache
def is_host_field(name: str) -> bool:
    """vLLM's naming of host values (``*_cpu``, ``*_np``, ``host_*``, ...)."""
    n = name.lower()
    ends = n.endswith(("_cpu", "_np", "_host")) or n.startswith(("cpu_", "host_"))
    return ends or "_cpu_" in n or n in HOST_NAMES


@functools.cache  # (name, descriptor) of each slot of cls and its bases
def _slots(cls: type) -> tuple:
    found = [(n, d) for c in reversed(cls.__mro__) for n, d in vars(c).items()]
    return tuple((n, d) for n, d in found if type(d) is types.MemberDescriptorType)


def fields_of(metadata: Any) -> dict[str, Any]:
    """What ``metadata`` holds, as a dataclass holds it: its instance dict and
    its slots across the class hierarchy; no property is ever read."""
    own, slots = getattr(metadata, "__dict__", None), _slots(type(metadata))
    if not slots:  # the common case: the instance dict itself (or a TypeError)
        return vars(metadata)
    fields = dict(own) if isinstance(own, dict) else {}
    for name, slot in slots:
        with contextlib.suppress(AttributeError):  # a slot never set
            fields[name] = slot.__get__(metadata)
    return fields
