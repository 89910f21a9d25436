# SPDX-License-Identifier: Apache-2.0
"""``ROCM_AITER_UNIFIED_ATTN`` gets upstream's builder (backport of PR #53821, in
0.29.0; delete when 0.29.0 is the oldest supported). On 0.27/0.28 it uses the
ROCm builder, whose capture zeroes the device offsets its kernel reads. Its
``get_builder_cls()`` now returns a subclass with upstream's capture (``build(0)``,
``seq_lens`` set to 1); a vendor's capture replaced gets a WARNING."""

from __future__ import annotations

import sys
from types import ModuleType

from vllm_capture_guard.runtime import patching

MODULE = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
BACKEND = "RocmAiterUnifiedAttentionBackend"
BUILDER = "RocmAiterUnifiedAttentionMetadataBuilder"
ROCM = ("vllm.v1.attention.backends.rocm_attn", "RocmAttentionMetadataBuilder")
METHOD = "build_for_cudagraph_capture"
GETTER = "get_builder_cls"
PR = "#53821"
KEEPS = f"which keeps query_start_loc (backport of PR {PR})"

#: Backend module name -> what it bound as BUILDER before we bound ours there
#: (None: nothing). The tools' revert binds it back.
REPLACED_BINDINGS: dict[str, type | None] = {}


def builder_name(backend: type) -> str:
    """The name of the builder made for ``backend``: upstream's, for upstream's."""
    if backend.__name__ == BACKEND:
        return BUILDER
    return f"{BUILDER}For{backend.__name__}"


def _builder_with_upstreams_capture(parent: type, name: str) -> type:
    def build_for_cudagraph_capture(self, common_attn_metadata):
        # Sequence lengths of 1, as every ROCm capture; nothing else written:
        # the kernel reads the caller's query_start_loc at replay.
        attn_metadata = self.build(0, common_attn_metadata)
        attn_metadata.seq_lens.fill_(1)
        return attn_metadata

    build_for_cudagraph_capture.__qualname__ = f"{name}.{METHOD}"
    doc = f"{parent.__name__} with upstream's capture (backport of PR {PR})."
    attrs = {"__module__": __name__, "__qualname__": name, "__doc__": doc}
    return type(name, (parent,), {**attrs, METHOD: build_for_cudagraph_capture})


def _vllms_own_captures() -> set:
    """vLLM's ROCm capture, and vLLM's own AITER builder's (0.29.0 on)."""
    found = set()
    for module, cls in (ROCM, (MODULE, BUILDER)):
        fn = vars(getattr(sys.modules.get(module), cls, object)).get(METHOD)
        if fn is not None:
            found.add(patching.original_of(fn))
    return found


def backends() -> list[type]:
    """The AITER unified backend and its subclasses with a ``get_builder_cls``."""
    root = getattr(sys.modules.get(MODULE), BACKEND, None)
    if not isinstance(root, type):
        return []
    return [c for c in patching.subclasses(root) if c is root or GETTER in vars(c)]


class RocmAiterUnifiedBuilder(patching.Patch):
    name, pr = "rocm-aiter-unified-builder", PR
    modules, backends = (MODULE,), ("ROCM_AITER_UNIFIED_ATTN",)
    targets = ((MODULE, BACKEND),)

    def plan(self, module: ModuleType) -> patching.Outcome:
        if not isinstance(getattr(module, BACKEND, None), type):
            raise LookupError(f"{MODULE} has no {BACKEND}")
        todo = [b for b in backends() if not patching.is_guarded(vars(b).get(GETTER))]
        if not todo:
            detail = f"{BACKEND}.{GETTER} returns its own {BUILDER}"
            return patching.Outcome(self.name, patching.Status.ALREADY, detail)
        # (backend, what its get_builder_cls() returned: ours derives from it)
        targets = [(backend, backend.get_builder_cls()) for backend in todo]
        known, vendors = _vllms_own_captures(), []
        for backend, parent in targets:
            capture = patching.original_of(getattr(parent, METHOD, None))
            if capture not in known:
                vendors.append(f"{backend.__name__}'s builder {parent.__name__}")
        warning = None
        if vendors:
            replaced = (
                f"replaced the capture of {', '.join(vendors)}, which is not vLLM's"
            )
            warning = f"{replaced}, with upstream's, {KEEPS}"
        detail = ", ".join(f"{b.__name__} ({p.__name__})" for b, p in targets)
        status = patching.Status.NEEDED
        return patching.Outcome(self.name, status, detail, warning, targets)

    def install(self, plan: patching.Outcome) -> str:
        for backend, parent in plan.data:
            name = builder_name(backend)
            builder = _builder_with_upstreams_capture(parent, name)

            def get_builder_cls(builder: type = builder) -> type:
                return builder

            setattr(get_builder_cls, patching.MARKER, vars(backend).get(GETTER))
            globals()[name] = builder  # pickle finds it here, by name
            home = sys.modules[backend.__module__]
            if name == BUILDER:  # bound where 0.29.0 binds its own
                replaced = getattr(home, BUILDER, None)
                REPLACED_BINDINGS.setdefault(home.__name__, replaced)
                setattr(home, BUILDER, builder)
            setattr(backend, GETTER, staticmethod(get_builder_cls))
        upstream = f"{GETTER} returns a builder with upstream's capture"
        return f"{plan.detail}: {upstream}, {KEEPS}"
