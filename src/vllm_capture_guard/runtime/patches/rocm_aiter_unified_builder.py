# SPDX-License-Identifier: Apache-2.0
"""``ROCM_AITER_UNIFIED_ATTN`` gets upstream's builder (backport of PR #53821, in
0.29.0; delete when 0.29.0 is the oldest supported): on 0.27/0.28 it uses the
ROCm builder, whose capture zeroes the device offsets its kernel reads. Its
``get_builder_cls()`` returns a subclass with upstream's capture (``build(0)``,
``seq_lens`` set to 1); a vendor's capture replaced gets a WARNING."""

from __future__ import annotations

import sys
from types import ModuleType

from vllm_capture_guard.runtime import base

MODULE = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
BACKEND = "RocmAiterUnifiedAttentionBackend"
BUILDER = "RocmAiterUnifiedAttentionMetadataBuilder"
ROCM = ("vllm.v1.attention.backends.rocm_attn", "RocmAttentionMetadataBuilder")
METHOD = "build_for_cudagraph_capture"
GETTER = "get_builder_cls"
PR = "#53821"
KEEPS = f"which keeps query_start_loc (backport of PR {PR})"
_SAVED: dict = {}  # backend module -> what it bound as BUILDER before, or None


def _name(backend: type) -> str:
    return BUILDER if backend.__name__ == BACKEND else f"{BUILDER}For{backend.__name__}"


def _own_builder(parent: type, name: str, pr: str) -> type:
    def build_for_cudagraph_capture(self, common_attn_metadata):
        # Sequence lengths of 1, as every ROCm capture; nothing else written:
        # the kernel reads the caller's query_start_loc at replay.
        attn_metadata = self.build(0, common_attn_metadata)
        attn_metadata.seq_lens.fill_(1)
        return attn_metadata

    build_for_cudagraph_capture.__qualname__ = f"{name}.{METHOD}"
    doc = f"{parent.__name__} with upstream's capture (backport of PR {pr})."
    attrs = {"__module__": __name__, "__qualname__": name, "__doc__": doc}
    return type(name, (parent,), {**attrs, METHOD: build_for_cudagraph_capture})


def _known_captures() -> set:
    """vLLM's ROCm capture and vLLM's own AITER builder's (0.29.0 on)."""
    found = set()
    for module, cls in (ROCM, (MODULE, BUILDER)):
        fn = vars(getattr(sys.modules.get(module), cls, object)).get(METHOD)
        if fn is not None:
            found.add(base.original_of(fn))
    return found


def backends() -> list[type]:
    """The AITER unified backend and its subclasses with a ``get_builder_cls``."""
    root = getattr(sys.modules.get(MODULE), BACKEND, None)
    if not isinstance(root, type):
        return []
    return [c for c in base.subclasses(root) if c is root or GETTER in vars(c)]


class RocmAiterUnifiedBuilder(base.Patch):
    name, pr = "rocm-aiter-unified-builder", PR
    modules = (MODULE,)

    def plan(self, module: ModuleType) -> base.Outcome:
        if not isinstance(getattr(module, BACKEND, None), type):
            raise LookupError(f"{MODULE} has no {BACKEND}")
        todo = [b for b in backends() if not base.is_guarded(vars(b).get(GETTER))]
        if not todo:
            detail = f"{BACKEND}.{GETTER} returns its own {BUILDER}"
            return base.Outcome(self.name, base.Status.ALREADY, detail)
        known, data, vendors = _known_captures(), [], []
        for backend in todo:
            parent = backend.get_builder_cls()
            data.append((backend, parent))
            capture = base.original_of(getattr(parent, METHOD, None))
            if capture not in known:
                vendors.append(f"{backend.__name__}'s builder {parent.__name__}")
        replaced = f"replaced the capture of {', '.join(vendors)}, which is not vLLM's"
        warning = vendors and f"{replaced}, with upstream's, {KEEPS}"
        detail = ", ".join(f"{b.__name__} ({p.__name__})" for b, p in data)
        return base.Outcome(
            self.name, base.Status.NEEDED, detail, warning or None, data
        )

    def install(self, plan: base.Outcome) -> str:
        for backend, parent in plan.data:
            name = _name(backend)
            builder = _own_builder(parent, name, self.pr)

            def get_builder_cls(builder: type = builder) -> type:
                return builder

            setattr(get_builder_cls, base.MARKER, vars(backend).get(GETTER))
            globals()[name] = builder  # pickle finds it here, by name
            home = sys.modules[backend.__module__]
            if name == BUILDER:  # bound where 0.29.0 binds its own
                _SAVED.setdefault(home.__name__, getattr(home, BUILDER, None))
                setattr(home, BUILDER, builder)
            setattr(backend, GETTER, staticmethod(get_builder_cls))
        upstream = f"{GETTER} returns a builder with upstream's capture"
        return f"{plan.detail}: {upstream}, {KEEPS}"
