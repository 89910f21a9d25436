# SPDX-License-Identifier: Apache-2.0
"""Did loading the guard change vLLM's classes?

On a fixed vLLM (0.29.0 and later) the promise is "nothing changes": every
attribute of every class a patch may change (``tools.fixes.targets``), and of the
builder that a backend class returns from ``get_builder_cls()``, must be the
very same object after vLLM's plugin loader ran the guard. The version
matrix and ``tests/test_fixed_releases.py`` both ask this module.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Suffix of the key under which a backend's builder is compared.
BUILDER_OF = ".get_builder_cls()"


def targets() -> dict[str, tuple[str, str]]:
    """``class name -> (module, class)`` for every patch's targets, in the
    patches' order."""
    from vllm_capture_guard.runtime.patches import PATCHES
    from vllm_capture_guard.tools.fixes import targets

    found: dict[str, tuple[str, str]] = {}
    for patch in PATCHES:
        for module, name in targets(patch):
            found.setdefault(name, (module, name))
    return found


def builder_key(backend_class: str) -> str:
    return backend_class + BUILDER_OF


def target_classes() -> dict[str, Any]:
    """Each target class (and each backend's builder), or why it cannot be
    imported on this host."""
    found: dict[str, Any] = {}
    for key, (module, name) in targets().items():
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception as e:  # 0.33's AITER module asks the GPU at import
            found[key] = f"{type(e).__name__} at import"
            continue
        found[key] = cls
        if callable(getattr(cls, "get_builder_cls", None)):
            found[builder_key(key)] = cls.get_builder_cls()
    return found


def _members(found: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, str) else (v, dict(v.__dict__)) for k, v in found.items()
    }


def around_plugin_load() -> dict[str, dict[str, Any]]:
    """Run ``vllm.plugins.load_general_plugins()`` and report, per target, the
    class before and after and which of its attributes are other objects.

    The targets' modules are imported before the plugins load, so the guard
    patches them at load (its post-import hooks run at once)."""
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
