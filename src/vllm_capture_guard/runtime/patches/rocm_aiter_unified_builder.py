# SPDX-License-Identifier: Apache-2.0
"""ROCM_AITER_UNIFIED_ATTN capture must leave the query offsets alone.

What:
    ``RocmAiterUnifiedAttentionBackend.get_builder_cls`` in
    ``vllm.v1.attention.backends.rocm_aiter_unified_attn``.

Symptom:
    With the host-metadata fix alone the engine starts, but this backend still
    captures its graphs after the shared device ``query_start_loc`` was zeroed,
    and its kernel reads those offsets at replay (vLLM PR #53821).

Cause:
    In 0.27.x/0.28.0 the backend has no builder of its own: it returns
    ``RocmAttentionMetadataBuilder``, whose capture zeroes ``query_start_loc``
    against a fault in a kernel this backend does not use (#25985).

Upstream:
    vllm-project/vllm PR #53821, in 0.29.0: its own
    ``RocmAiterUnifiedAttentionMetadataBuilder``, whose capture sets
    ``seq_lens`` to 1 and leaves ``query_start_loc`` alone.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them.

Detected:
    By reading, never running (:mod:`..shape`): left alone only if the capture
    of the builder that ``get_builder_cls()`` returns (the vLLM function
    behind our guard, if any) hands the metadata only to ``self.build`` and
    touches no ``query_start_loc*`` or host field. Else it gets its own
    builder; one in doubt, rather than plainly touching the offsets, with a
    WARNING.

How:
    ``get_builder_cls()`` returns a subclass of what it returned before, named
    and placed like upstream's (also bound in the backend's module, so code
    written for 0.29.0 finds it; it pickles by reference to this module). Its
    capture does what upstream's does: ``self.build(0, metadata)`` (vLLM's own
    ``build``), returned ``seq_lens`` set to 1, nothing else written. The
    differential oracle checks this against 0.29.0 field by field.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from vllm_capture_guard.runtime import patches as base
from vllm_capture_guard.runtime.shape import fixed_shape, is_host_field

MODULE = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
BACKEND = "RocmAiterUnifiedAttentionBackend"
BUILDER = "RocmAiterUnifiedAttentionMetadataBuilder"
METHOD = "build_for_cudagraph_capture"


def _offsets_or_host(name: str) -> bool:
    return name.startswith("query_start_loc") or is_host_field(name)


def _own_builder(parent: type, pr: str) -> type:
    def build_for_cudagraph_capture(self, common_attn_metadata):
        # Sequence lengths of 1, as every ROCm capture; nothing else written:
        # the kernel reads the caller's query_start_loc at replay.
        attn_metadata = self.build(0, common_attn_metadata)
        attn_metadata.seq_lens.fill_(1)
        return attn_metadata

    build_for_cudagraph_capture.__qualname__ = f"{BUILDER}.{METHOD}"
    doc = f"{parent.__name__} whose capture leaves the query offsets alone "
    doc += f"(vllm-capture-guard backport of PR {pr})."
    attrs = {"__module__": __name__, "__qualname__": BUILDER, "__doc__": doc}
    return type(BUILDER, (parent,), {**attrs, METHOD: build_for_cudagraph_capture})


class RocmAiterUnifiedBuilder(base.Patch):
    name, pr = "rocm-aiter-unified-builder", "#53821"
    modules = (MODULE,)
    backends = ("ROCM_AITER_UNIFIED_ATTN",)
    targets = ((MODULE, BACKEND),)

    def plan(self, module: ModuleType) -> base.Outcome:
        backend = getattr(module, BACKEND)
        if base.is_guarded(backend.__dict__.get("get_builder_cls")):
            detail = f"{BACKEND}.get_builder_cls returns {BUILDER}"
            return base.Outcome(self.name, base.Status.ALREADY, detail)
        parent = backend.get_builder_cls()
        name = f"{BACKEND} builder {parent.__name__}"
        capture = base.original_of(getattr(parent, METHOD, None))
        why = fixed_shape(capture, device_fields=False, forbidden=_offsets_or_host)
        if why is None:
            detail = f"{name} leaves query_start_loc alone"
            return base.Outcome(self.name, base.Status.NOT_NEEDED, detail)
        warning = None
        if not why.startswith("it touches"):
            warning = (
                f"could not show by reading that {name} leaves the query offsets "
                f"alone ({why}), so {BACKEND} now gets its own {BUILDER} as in "
                f"vLLM 0.29.0 (backport of PR {self.pr})"
            )
        detail = f"{name}: {why}"
        return base.Outcome(self.name, base.Status.NEEDED, detail, warning, parent)

    def install(self, plan: base.Outcome) -> str:
        backend = getattr(sys.modules[MODULE], BACKEND)
        builder = _own_builder(plan.data, self.pr)

        def get_builder_cls() -> type:
            return builder

        setattr(get_builder_cls, base.MARKER, backend.__dict__.get("get_builder_cls"))
        globals()[BUILDER] = builder  # pickle finds it here, by name
        setattr(sys.modules[backend.__module__], BUILDER, builder)  # as in 0.29.0
        backend.get_builder_cls = staticmethod(get_builder_cls)
        return (
            f"{BACKEND}.get_builder_cls returns its own {BUILDER}, which keeps "
            f"query_start_loc (backport of PR {self.pr})"
        )

    def uninstall(self) -> bool:
        backend = getattr(sys.modules.get(MODULE), BACKEND, None)
        current = getattr(backend, "__dict__", {}).get("get_builder_cls")
        if not base.is_guarded(current):
            return False
        own = getattr(current.__func__, base.MARKER)
        if own is None:
            delattr(backend, "get_builder_cls")
        else:
            backend.get_builder_cls = own
        sys.modules[backend.__module__].__dict__.pop(BUILDER, None)
        globals().pop(BUILDER, None)
        return True


class BackportUnavailable(ImportError):
    """Unpickling the backport where it was not made (an ``ImportError``:
    pickle hides an ``AttributeError``'s message behind its own)."""


def __getattr__(name: str) -> Any:
    """Unpickling the backport: in a process that loaded vLLM's plugins,
    importing the backend makes it."""
    if name != BUILDER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(MODULE)
    if BUILDER not in globals():
        raise BackportUnavailable(
            f"{BUILDER} is made by the vllm-capture-guard plugin when vLLM imports "
            f"{MODULE} in a process that loaded vLLM's general plugins; this one "
            "has not made it: call vllm.plugins.load_general_plugins() before "
            "unpickling (and check VLLM_PLUGINS and VLLM_CAPTURE_GUARD*)"
        )
    return globals()[BUILDER]
