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
    builder, which sets ``seq_lens`` to 1 for capture (as the ROCm builder
    does) and leaves ``query_start_loc`` alone.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them.

Detected:
    By behaviour: the builder class that the installed backend returns is
    probed once (:mod:`vllm_capture_guard.runtime.probe`); the patch applies only if its
    capture writes the device ``query_start_loc``.

How:
    ``get_builder_cls()`` returns a subclass of the builder it returned before.
    The subclass's capture runs the inherited one unchanged (so ``seq_lens`` is
    still set to 1 and ``build()`` is the very same function) and then puts the
    caller's ``query_start_loc`` and ``query_start_loc_cpu`` values back.
    ROCM_ATTN keeps its own builder and its #25985 guard.

    Checked against 0.29.0 itself, not only read: the differential oracle
    (:mod:`vllm_capture_guard.tools.oracle`) records every field of the shared
    metadata before and after each builder's capture, and every field of the
    metadata it returns, on patched 0.27.1/0.28.0 and on unpatched 0.29.0, and
    requires them to be equal. The subclass bears upstream's class name and is
    bound to it in this module, so it pickles by reference like vLLM's own.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import importlib

from vllm_capture_guard.runtime.contract import preserved
from vllm_capture_guard.runtime.patches import (
    ALREADY,
    MARKER,
    NEEDED,
    NOT_NEEDED,
    PATCHED,
    UNAVAILABLE,
    Outcome,
    is_guarded,
    original_of,
)

NAME = "rocm-aiter-unified-builder"
PR = "#53821"
MODULE = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
BACKEND = "RocmAiterUnifiedAttentionBackend"
BUILDER = "RocmAiterUnifiedAttentionMetadataBuilder"
FIELDS = ("query_start_loc", "query_start_loc_cpu")


def _backend() -> type:
    return getattr(importlib.import_module(MODULE), BACKEND)


def _own_builder(parent: type) -> type:
    """The backend's own builder: ``parent``'s capture, offsets left alone.

    It runs vLLM's own capture of ``parent`` (past our CPU-offset wrapper, if
    that is installed: this one keeps both offsets anyway)."""
    capture = original_of(parent.build_for_cudagraph_capture)

    def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
        with preserved(common_attn_metadata, *FIELDS):
            return capture(self, common_attn_metadata, *args, **kwargs)

    build_for_cudagraph_capture.__qualname__ = f"{BUILDER}.build_for_cudagraph_capture"
    builder = type(
        BUILDER,
        (parent,),
        {
            "__module__": __name__,
            "__qualname__": BUILDER,
            "__doc__": f"{parent.__name__} whose capture keeps the query offsets "
            f"(vllm-capture-guard backport of PR {PR}).",
            "build_for_cudagraph_capture": build_for_cudagraph_capture,
        },
    )
    return builder


def inspect() -> Outcome:
    """Does the builder this backend returns zero ``query_start_loc``?"""
    from vllm_capture_guard.runtime.probe import capture_writes

    try:
        backend = _backend()
    except Exception as e:  # 0.33 asks the GPU for its arch at import
        return Outcome(NAME, UNAVAILABLE, f"cannot import {MODULE}: {e}")
    current = backend.__dict__.get("get_builder_cls")
    if current is not None and is_guarded(current.__func__):
        return Outcome(NAME, ALREADY, f"{BACKEND}.get_builder_cls")
    parent = backend.get_builder_cls()
    written = {w.field for w in capture_writes(parent)}
    if "query_start_loc" not in written:
        return Outcome(
            NAME,
            NOT_NEEDED,
            f"{BACKEND} builder {parent.__name__} leaves query_start_loc alone",
        )
    return Outcome(
        NAME, NEEDED, f"{BACKEND} builder {parent.__name__} zeroes query_start_loc"
    )


def apply() -> Outcome:
    found = inspect()
    if found.status != NEEDED:
        return found
    backend = _backend()
    current = backend.__dict__.get("get_builder_cls")
    builder = _own_builder(backend.get_builder_cls())

    def get_builder_cls() -> type:
        return builder

    setattr(get_builder_cls, MARKER, current)
    # Found by name, as vLLM's own class is: pickle and cloudpickle store a
    # class as module + qualified name.
    globals()[BUILDER] = builder
    backend.get_builder_cls = staticmethod(get_builder_cls)
    return Outcome(
        NAME,
        PATCHED,
        f"{BACKEND}.get_builder_cls returns its own {BUILDER}, which keeps "
        f"query_start_loc (backport of PR {PR})",
    )


def revert() -> bool:
    """Undo :func:`apply` in this process."""
    backend = _backend()
    current = backend.__dict__.get("get_builder_cls")
    if current is None or not is_guarded(current.__func__):
        return False
    original = original_of(current.__func__)
    if original is None:  # the backend inherited it: drop ours
        delattr(backend, "get_builder_cls")
    else:
        backend.get_builder_cls = original
    globals().pop(BUILDER, None)
    return True
