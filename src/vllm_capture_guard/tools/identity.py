# SPDX-License-Identifier: Apache-2.0
"""Did loading the guard change vLLM's ROCm classes?

On a fixed vLLM (0.29.0 and later) the promise is "nothing changes": every
attribute of the ROCm builder, the AITER unified backend and the builder that
backend returns must be the very same object after vLLM's plugin loader ran
the guard. The version matrix and ``tests/test_fixed_releases.py`` both ask
this module.
"""

from __future__ import annotations

import importlib
from typing import Any

#: vLLM's classes to compare, as (module, class); the AITER backend's builder
#: is looked up through its ``get_builder_cls()`` under :data:`AITER_BUILDER`.
TARGETS = {
    "RocmAttentionMetadataBuilder": (
        "vllm.v1.attention.backends.rocm_attn",
        "RocmAttentionMetadataBuilder",
    ),
    "RocmAiterUnifiedAttentionBackend": (
        "vllm.v1.attention.backends.rocm_aiter_unified_attn",
        "RocmAiterUnifiedAttentionBackend",
    ),
}
AITER_BUILDER = "its get_builder_cls()"


def target_classes() -> dict[str, Any]:
    """Each target class, or why it cannot be imported on this host."""
    found: dict[str, Any] = {}
    for key, (module, name) in TARGETS.items():
        try:
            found[key] = getattr(importlib.import_module(module), name)
        except Exception as e:  # 0.33's AITER module asks the GPU at import
            found[key] = f"{type(e).__name__} at import"
    backend = found["RocmAiterUnifiedAttentionBackend"]
    if not isinstance(backend, str):
        found[AITER_BUILDER] = backend.get_builder_cls()
    return found


def _members(found: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, str) else (v, dict(v.__dict__)) for k, v in found.items()
    }


def around_plugin_load() -> dict[str, dict[str, Any]]:
    """Run ``vllm.plugins.load_general_plugins()`` and report, per target, the
    class before and after and which of its attributes are other objects."""
    import vllm.plugins

    before = _members(target_classes())
    vllm.plugins.load_general_plugins()
    after = _members(target_classes())
    out: dict[str, dict[str, Any]] = {}
    for key, was in before.items():
        if isinstance(was, str):
            out[key] = {"unavailable": was}
            continue
        cls, attrs = was
        now_cls, now_attrs = after[key]
        out[key] = {
            "class": cls.__qualname__,
            "same_class": now_cls is cls,
            "now": f"{now_cls.__module__}.{now_cls.__qualname__}",
            "attributes": len(attrs),
            "changed": sorted(
                n
                for n in set(attrs) | set(now_attrs)
                if attrs.get(n) is not now_attrs.get(n)
            ),
        }
    return out
