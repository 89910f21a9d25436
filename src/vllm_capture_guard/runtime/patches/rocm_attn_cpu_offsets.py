# SPDX-License-Identifier: Apache-2.0
"""ROCM_ATTN capture must not zero the CPU query offsets.

What:
    ``vllm.v1.attention.backends.rocm_attn.RocmAttentionMetadataBuilder
    .build_for_cudagraph_capture``.

Symptom:
    ``vllm serve`` of a mixed-attention model (MiniMax-M3) with
    ``--attention-backend ROCM_ATTN`` or ``ROCM_AITER_UNIFIED_ATTN`` and full
    CUDA-graph capture dies at startup::

        File "vllm/models/minimax_m3/common/indexer.py", line 317, in build
            assert decode_query_len > 0
        EngineCore failed to start.

Cause:
    The runner hands one ``CommonAttentionMetadata`` (views of its persistent
    buffers, shallow-copied per KV-cache group) to every builder in turn. This
    builder zeroes the device ``query_start_loc`` (a deliberate guard against an
    illegal memory access in the prefix-prefill kernel, vLLM issue #25985) and
    also the host ``query_start_loc_cpu``, which no ROCm kernel reads but every
    later builder does: the MiniMax-M3 indexer then computes a query length of 0.

Upstream:
    vllm-project/vllm PR #51585, released in 0.29.0: only the device offsets
    are zeroed.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them. In those
    releases ROCM_AITER_UNIFIED_ATTN uses this same builder class, so this
    patch fixes startup for both backends.

Detected:
    By behaviour (:mod:`vllm_capture_guard.runtime.probe`): the installed capture runs
    once on a tiny CPU metadata; the patch applies only if it wrote
    ``query_start_loc_cpu``.

How:
    The installed method still runs unchanged, the #25985 guard included; the
    wrapper puts the values of the caller's ``query_start_loc_cpu`` back
    afterwards. The device ``query_start_loc`` stays zeroed, as in 0.29.0.
    ``build()``, the serving hot path, is not touched.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

from typing import Any

from vllm_capture_guard.runtime.contract import preserved, shares_memory
from vllm_capture_guard.runtime.patches import (
    ALREADY,
    NEEDED,
    NOT_NEEDED,
    PATCHED,
    UNAVAILABLE,
    Outcome,
    is_guarded,
    unwrap_method,
    wrap_method,
)

NAME = "rocm-attn-cpu-offsets"
PR = "#51585"
MODULE = "vllm.v1.attention.backends.rocm_attn"
CLASS = "RocmAttentionMetadataBuilder"
METHOD = "build_for_cudagraph_capture"
FIELD = "query_start_loc_cpu"


def _target() -> type:
    import importlib

    return getattr(importlib.import_module(MODULE), CLASS)


def _keep_cpu_offsets(original: Any) -> Any:
    def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
        cm = common_attn_metadata
        if shares_memory(cm.query_start_loc, cm.query_start_loc_cpu):
            # One buffer serves as both: zeroing "the device copy" is zeroing
            # this one too, in 0.29.0 as well. Nothing to keep apart.
            return original(self, cm, *args, **kwargs)
        with preserved(cm, FIELD):
            return original(self, cm, *args, **kwargs)

    return build_for_cudagraph_capture


def inspect() -> Outcome:
    """Does the installed builder's capture write ``query_start_loc_cpu``?"""
    from vllm_capture_guard.runtime.probe import capture_writes

    try:
        cls = _target()
    except ImportError as e:
        return Outcome(NAME, UNAVAILABLE, f"cannot import {MODULE}: {e}")
    current = cls.__dict__.get(METHOD)
    if current is None:
        return Outcome(NAME, NOT_NEEDED, f"{CLASS} has no {METHOD} of its own")
    if is_guarded(current):
        return Outcome(NAME, ALREADY, f"{CLASS}.{METHOD}")
    written = {w.field for w in capture_writes(cls, current)}
    if FIELD not in written:
        return Outcome(NAME, NOT_NEEDED, f"{CLASS} capture leaves {FIELD} alone")
    return Outcome(NAME, NEEDED, f"{CLASS} capture zeroes {FIELD}")


def apply() -> Outcome:
    found = inspect()
    if found.status != NEEDED:
        return found
    wrap_method(_target(), METHOD, _keep_cpu_offsets)
    return Outcome(
        NAME, PATCHED, f"{CLASS}.{METHOD} keeps {FIELD} (backport of PR {PR})"
    )


def revert() -> bool:
    """Undo :func:`apply` in this process (tests, ``VLLM_CAPTURE_GUARD=off``)."""
    return unwrap_method(_target(), METHOD)
