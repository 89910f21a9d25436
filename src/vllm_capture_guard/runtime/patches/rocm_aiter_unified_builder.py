# SPDX-License-Identifier: Apache-2.0
"""ROCM_AITER_UNIFIED_ATTN capture must leave the query offsets alone.

What:
    ``vllm.v1.attention.backends.rocm_aiter_unified_attn
    .RocmAiterUnifiedAttentionBackend.get_builder_cls``.

Symptom:
    With the CPU-offset fix alone (:mod:`.rocm_attn_cpu_offsets`) the engine
    starts, but the AITER unified backend still captures its full graphs after
    the shared device ``query_start_loc`` was zeroed, while its kernel reads
    those offsets at replay (vLLM PR #53821 reports the corrupted replay).

Cause:
    In 0.27.x/0.28.0 the AITER unified backend has no builder of its own: its
    ``get_builder_cls()`` returns ``RocmAttentionMetadataBuilder``, whose
    capture zeroes ``query_start_loc`` to avoid a fault in the *prefix-prefill*
    kernel (#25985), a kernel this backend does not use.

Upstream:
    vllm-project/vllm PR #53821, released in 0.29.0: the backend gets its own
    builder, ``RocmAiterUnifiedAttentionMetadataBuilder``, which sets
    ``seq_lens`` to 1 for capture (as the ROCm builder does) and leaves
    ``query_start_loc`` alone.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them.

Detected:
    By reading, never running: the backend is left alone only if the capture
    of the builder its ``get_builder_cls()`` returns (the vLLM function behind
    our own guard, if any) has the fixed shape with no use of the metadata but
    ``self.build(...)`` and no ``query_start_loc*`` or host field touched
    (:func:`..shape.fixed_shape`). Otherwise it gets its own builder; a
    capture in doubt rather than plainly writing the offsets, with a WARNING.

How:
    ``get_builder_cls()`` returns a subclass of the class it returned before,
    named like upstream's. Its capture does what upstream's does: it calls
    ``self.build(0, common_attn_metadata)`` (the inherited ``build()``, the
    very same function), sets the returned ``seq_lens`` to 1, and writes
    nothing else. It does not zero the offsets and put them back: a host
    write to the runner's pinned ``query_start_loc_cpu`` could race the
    non-blocking copy to the device that vLLM issued just before. ROCM_ATTN
    keeps its own builder and its #25985 guard.

    Code written for 0.29.0 finds the class where upstream put it: it is also
    bound in the backend's module. It pickles by reference to this module;
    a process that unpickles it and has loaded vLLM's plugins gets it back,
    and one that has not gets an error that says so.

    Checked against 0.29.0 itself, not only read: the differential oracle
    records every field of the shared metadata before and after each
    builder's capture, and every field of the metadata it returns, on patched
    0.27.1/0.28.0 and on unpatched 0.29.0, and requires them to be equal.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from vllm_capture_guard.runtime.patches import (
    MARKER,
    Patch,
    Plan,
    Status,
    is_guarded,
    original_of,
)
from vllm_capture_guard.runtime.shape import fixed_shape, is_host_field

MODULE = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
BACKEND = "RocmAiterUnifiedAttentionBackend"
BUILDER = "RocmAiterUnifiedAttentionMetadataBuilder"
METHOD = "build_for_cudagraph_capture"
_ABSENT = object()
#: What vLLM's module bound to BUILDER before we did (``_ABSENT``: nothing).
_displaced: list[Any] = []


def _offsets_or_host(name: str) -> bool:
    return name.startswith("query_start_loc") or is_host_field(name)


def _own_builder(parent: type, pr: str) -> type:
    """The backend's own builder: what upstream's does, as a ``parent``."""

    def build_for_cudagraph_capture(self, common_attn_metadata):
        # Capture with sequence lengths of 1 (as every ROCm capture does) and
        # write nothing else: the AITER unified kernel reads the caller's
        # query_start_loc at replay, and later builders read the CPU copy.
        attn_metadata = self.build(0, common_attn_metadata)
        attn_metadata.seq_lens.fill_(1)
        return attn_metadata

    build_for_cudagraph_capture.__qualname__ = f"{BUILDER}.{METHOD}"
    doc = f"{parent.__name__} whose capture leaves the query offsets alone "
    doc += f"(vllm-capture-guard backport of PR {pr})."
    attrs = {"__module__": __name__, "__qualname__": BUILDER, "__doc__": doc}
    return type(BUILDER, (parent,), {**attrs, METHOD: build_for_cudagraph_capture})


class RocmAiterUnifiedBuilder(Patch):
    name = "rocm-aiter-unified-builder"
    pr = "#53821"
    modules = (MODULE,)
    backends = ("ROCM_AITER_UNIFIED_ATTN",)
    targets = ((MODULE, BACKEND),)

    def plan(self, module: ModuleType) -> Plan:
        backend = getattr(module, BACKEND)
        if is_guarded(backend.__dict__.get("get_builder_cls")):
            return Plan(Status.ALREADY, f"{BACKEND}.get_builder_cls returns {BUILDER}")
        parent = backend.get_builder_cls()
        name = f"{BACKEND} builder {parent.__name__}"
        capture = original_of(getattr(parent, METHOD, None))
        why = fixed_shape(capture, device_fields=False, forbidden=_offsets_or_host)
        if why is None:
            return Plan(Status.NOT_NEEDED, f"{name} leaves query_start_loc alone")
        warning = None
        if not why.startswith("it touches"):
            warning = (
                f"could not show by reading that {name} leaves the query offsets "
                f"alone ({why}), so {BACKEND} now gets its own {BUILDER} as in "
                f"vLLM 0.29.0 (backport of PR {self.pr})"
            )
        return Plan(Status.NEEDED, f"{name}: {why}", warning, parent)

    def install(self, plan: Plan) -> str:
        backend = getattr(sys.modules[MODULE], BACKEND)
        module = sys.modules[backend.__module__]
        builder = _own_builder(plan.data, self.pr)

        def get_builder_cls() -> type:
            return builder

        setattr(get_builder_cls, MARKER, backend.__dict__.get("get_builder_cls"))
        globals()[BUILDER] = builder  # pickle finds it here, by name
        _displaced.append(module.__dict__.get(BUILDER, _ABSENT))
        setattr(module, BUILDER, builder)  # where code written for 0.29.0 looks
        backend.get_builder_cls = staticmethod(get_builder_cls)
        return (
            f"{BACKEND}.get_builder_cls returns its own {BUILDER}, which keeps "
            f"query_start_loc (backport of PR {self.pr})"
        )

    def uninstall(self) -> bool:
        module = sys.modules.get(MODULE)
        backend = getattr(module, BACKEND, None)
        current = getattr(backend, "__dict__", {}).get("get_builder_cls")
        if current is None or not is_guarded(current):
            return False
        own = getattr(current.__func__, MARKER)
        if own is None:
            delattr(backend, "get_builder_cls")
        else:
            backend.get_builder_cls = own
        previous = _displaced.pop() if _displaced else _ABSENT
        if previous is _ABSENT:
            module.__dict__.pop(BUILDER, None)
        else:
            setattr(module, BUILDER, previous)
        globals().pop(BUILDER, None)
        return True


class BackportUnavailable(ImportError):
    """The backport class was asked for in a process that did not make it.

    An ``ImportError``, not an ``AttributeError``: pickle replaces the latter
    by its own "Can't get attribute" message, and the cause would be lost."""


def __getattr__(name: str) -> Any:
    """Unpickling the backport in a process that has not made it yet: in a
    process that loaded vLLM's plugins, importing the backend makes it."""
    if name != BUILDER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module(MODULE)
    found = globals().get(BUILDER)
    if found is None:
        raise BackportUnavailable(
            f"{BUILDER} is made by the vllm-capture-guard plugin when vLLM "
            f"imports {MODULE} in a process that loaded vLLM's general plugins, "
            "and this process has not made it: call "
            "vllm.plugins.load_general_plugins() before unpickling (and check "
            "VLLM_PLUGINS, VLLM_CAPTURE_GUARD and VLLM_CAPTURE_GUARD_DISABLE)"
        )
    return found
