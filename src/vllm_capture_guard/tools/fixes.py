# SPDX-License-Identifier: Apache-2.0
"""What each runtime patch is about, for the tools: the attention backends its
fix concerns (``check``, the oracle and the matrix run them) and the
``(module, class)`` pairs it may change (``tools.identity`` watches them)."""

from __future__ import annotations

from typing import Any

_ROCM = "vllm.v1.attention.backends.rocm_attn"
_AITER = "vllm.v1.attention.backends.rocm_aiter_unified_attn"

BACKENDS: dict[str, tuple[str, ...]] = {
    "rocm-attn-cpu-offsets": ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"),
    "rocm-aiter-unified-builder": ("ROCM_AITER_UNIFIED_ATTN",),
    "graph-capture-stream": (),  # not an attention backend's fix
}


def by_name(name: str) -> Any:
    """The runtime patch called ``name`` (KeyError: no such patch)."""
    from vllm_capture_guard.runtime.patches import PATCHES

    return {p.name: p for p in PATCHES}[name]


def backends(patch: Any) -> tuple[str, ...]:
    return BACKENDS[patch.name]


def targets(patch: Any) -> tuple[tuple[str, str], ...]:
    if patch.name == "rocm-attn-cpu-offsets":
        return (
            (_ROCM, "RocmAttentionMetadataBuilder"),
            (_ROCM, "RocmAttentionBackend"),
        )
    if patch.name == "rocm-aiter-unified-builder":
        return ((_AITER, "RocmAiterUnifiedAttentionBackend"),)
    if patch.name == "graph-capture-stream":
        from vllm_capture_guard.runtime.patches.graph_capture_stream import SITES

        return tuple((module, cls) for module, cls, _ in SITES)
    raise KeyError(f"tools/fixes.py names no targets for {patch.name}")
