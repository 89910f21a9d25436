# SPDX-License-Identifier: Apache-2.0
"""The backends the installed vLLM registers: every enum of its backend
registry module that resolves classes (``AttentionBackendEnum``,
``MambaAttentionBackendEnum``, and whatever a later release adds)."""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Any

REGISTRY_MODULE = "vllm.v1.attention.backends.registry"


@dataclasses.dataclass(frozen=True)
class Registered:
    """One member of one of vLLM's backend registries."""

    registry: str
    name: str
    member: Any

    @property
    def is_mamba(self) -> bool:
        return "mamba" in self.registry.lower()


def registries() -> list[type]:
    """Every enum of vLLM's backend registry module that resolves classes."""
    mod = importlib.import_module(REGISTRY_MODULE)
    found = []
    for obj in vars(mod).values():
        if (
            isinstance(obj, type)
            and issubclass(obj, enum.Enum)
            and obj.__module__ == mod.__name__
            and callable(getattr(obj, "get_class", None))
        ):
            found.append(obj)
    return found


def registered_backends() -> list[Registered]:
    return [
        Registered(reg.__name__, member.name, member)
        for reg in registries()
        for member in reg
    ]


def find(name: str) -> Registered | None:
    """The first registered backend called ``name``."""
    return next((r for r in registered_backends() if r.name == name), None)
