# SPDX-License-Identifier: Apache-2.0
"""ROCM_AITER_UNIFIED_ATTN capture must leave the query offsets alone.

What:
    ``get_builder_cls`` of ``RocmAiterUnifiedAttentionBackend`` (in
    ``vllm.v1.attention.backends.rocm_aiter_unified_attn``) and of every
    backend class derived from it.

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
    By reading (:mod:`..shape`), per backend class: left alone only if the
    capture of the builder its ``get_builder_cls()`` returns hands the
    metadata only to ``self.build`` and touches no ``query_start_loc*`` or
    host field. Anything else gets the upstream builder; one in doubt, or a
    capture that is not vLLM's own ROCm capture (a vendor's), with a WARNING.

How:
    ``get_builder_cls()`` returns a subclass of what it returned before, named
    and placed like upstream's (for the base class also bound in the
    backend's module, so code written for 0.29.0 finds it; it pickles by
    reference to this module). Its capture does what upstream's does:
    ``self.build(0, metadata)`` (vLLM's own ``build``), returned ``seq_lens``
    set to 1, nothing else written. The differential oracle checks this
    against 0.29.0 field by field.

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
ROCM = ("vllm.v1.attention.backends.rocm_attn", "RocmAttentionMetadataBuilder")
METHOD = "build_for_cudagraph_capture"


def _offsets_or_host(name: str) -> bool:
    return name.startswith("query_start_loc") or is_host_field(name)


def _builder_name(backend: type) -> str:
    return BUILDER if backend.__name__ == BACKEND else f"{BUILDER}For{backend.__name__}"


def _own_builder(parent: type, name: str, pr: str) -> type:
    def build_for_cudagraph_capture(self, common_attn_metadata):
        # Sequence lengths of 1, as every ROCm capture; nothing else written:
        # the kernel reads the caller's query_start_loc at replay.
        attn_metadata = self.build(0, common_attn_metadata)
        attn_metadata.seq_lens.fill_(1)
        return attn_metadata

    build_for_cudagraph_capture.__qualname__ = f"{name}.{METHOD}"
    doc = f"{parent.__name__} whose capture leaves the query offsets alone "
    doc += f"(vllm-capture-guard backport of PR {pr})."
    attrs = {"__module__": __name__, "__qualname__": name, "__doc__": doc}
    return type(name, (parent,), {**attrs, METHOD: build_for_cudagraph_capture})


def _vllms_rocm_capture() -> Any:
    cls = getattr(sys.modules.get(ROCM[0]), ROCM[1], None)
    return base.original_of(getattr(cls, METHOD, None))


def backends() -> list[type]:
    """The AITER unified backend and every backend class derived from it that
    has a ``get_builder_cls`` of its own (the others inherit the fix)."""
    root = getattr(sys.modules.get(MODULE), BACKEND, None)
    if not isinstance(root, type):
        return []
    found = base.subclasses(root)
    return [c for c in found if c is root or "get_builder_cls" in vars(c)]


class RocmAiterUnifiedBuilder(base.Patch):
    name, pr = "rocm-aiter-unified-builder", "#53821"
    modules = (MODULE,)
    backends = ("ROCM_AITER_UNIFIED_ATTN",)
    targets = ((MODULE, BACKEND),)

    def plan(self, module: ModuleType) -> base.Outcome:
        if not isinstance(getattr(module, BACKEND, None), type):
            raise LookupError(f"{MODULE} has no {BACKEND}")
        todo, kept, warnings, guarded = [], [], [], []
        for backend in backends():
            if base.is_guarded(vars(backend).get("get_builder_cls")):
                guarded.append(backend.__name__)
                continue
            parent = backend.get_builder_cls()
            capture = base.original_of(getattr(parent, METHOD, None))
            why = fixed_shape(capture, device_fields=False, forbidden=_offsets_or_host)
            name = f"{backend.__name__}'s builder {parent.__name__}"
            if why is None:
                kept.append(f"{name} leaves query_start_loc alone")
                continue
            todo.append((backend, parent))
            if not why.startswith("it touches"):
                warnings.append(f"could not show by reading that {name} leaves the "
                                f"query offsets alone ({why})")  # fmt: skip
            elif capture is not _vllms_rocm_capture():
                warnings.append(f"{name} has a capture of its own ({why}); "
                                "it is replaced")  # fmt: skip
        warning = warnings and (
            "; ".join(warnings) + f", so it gets its own {BUILDER} as in vLLM 0.29.0 "
            f"(backport of PR {self.pr})"
        )
        if todo:
            detail = "; ".join(f"{b.__name__}: {p.__name__}'s capture zeroes "
                               "query_start_loc" for b, p in todo)  # fmt: skip
            warning = warning or None
            return base.Outcome(self.name, base.Status.NEEDED, detail, warning, todo)
        if guarded:
            detail = f"{', '.join(guarded)}.get_builder_cls returns its own {BUILDER}"
            return base.Outcome(self.name, base.Status.ALREADY, detail)
        return base.Outcome(self.name, base.Status.NOT_NEEDED, "; ".join(kept))

    def install(self, plan: base.Outcome) -> str:
        done = []
        for backend, parent in plan.data:
            name = _builder_name(backend)
            builder = _own_builder(parent, name, self.pr)

            def get_builder_cls(builder: type = builder) -> type:
                return builder

            own = backend.__dict__.get("get_builder_cls")
            setattr(get_builder_cls, base.MARKER, own)
            globals()[name] = builder  # pickle finds it here, by name
            if name == BUILDER:  # as in 0.29.0
                setattr(sys.modules[backend.__module__], BUILDER, builder)
            backend.get_builder_cls = staticmethod(get_builder_cls)
            done.append(backend.__name__)
        return (
            f"{', '.join(done)}.get_builder_cls returns its own {BUILDER}, which "
            f"keeps query_start_loc (backport of PR {self.pr})"
        )

    def uninstall(self) -> bool:
        undone = False
        for backend in backends():
            current = backend.__dict__.get("get_builder_cls")
            if not base.is_guarded(current):
                continue
            own = getattr(current.__func__, base.MARKER)
            if own is None:
                delattr(backend, "get_builder_cls")
            else:
                backend.get_builder_cls = own
            name = _builder_name(backend)
            if name == BUILDER:
                sys.modules[backend.__module__].__dict__.pop(BUILDER, None)
            globals().pop(name, None)
            undone = True
        return undone


class BackportUnavailable(ImportError):
    """Unpickling the backport where it was not made (an ``ImportError``:
    pickle hides an ``AttributeError``'s message behind its own)."""


def __getattr__(name: str) -> Any:
    """Unpickling the backport: in a process that loaded vLLM's plugins,
    importing the backend makes it."""
    if not name.startswith(BUILDER):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(MODULE)
    if name not in globals():
        raise BackportUnavailable(
            f"{name} is made by the vllm-capture-guard plugin when vLLM imports "
            f"{MODULE} in a process that loaded vLLM's general plugins; this one "
            "has not made it: call vllm.plugins.load_general_plugins() before "
            "unpickling (and check VLLM_PLUGINS and VLLM_CAPTURE_GUARD*)"
        )
    return globals()[name]
