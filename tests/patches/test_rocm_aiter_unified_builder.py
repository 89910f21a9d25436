# SPDX-License-Identifier: Apache-2.0
"""ROCM_AITER_UNIFIED_ATTN gets its own builder (PR #53821): capture keeps the
query offsets, which the AITER unified kernel reads at replay, and still sets
seq_lens to 1."""

from __future__ import annotations

import pytest

from vllm_capture_guard.tools import scenarios as sc
from vllm_capture_guard.runtime.patches import (
    ALREADY,
    NEEDED,
    PATCHED,
    rocm_aiter_unified_builder,
    rocm_attn_cpu_offsets,
)


@pytest.fixture
def aiter_needed(unpatched) -> None:
    try:
        found = rocm_aiter_unified_builder.inspect()
    except Exception as e:  # pragma: no cover - depends on the vLLM installed
        pytest.skip(f"cannot inspect the AITER backend here: {e}")
    if found.status != NEEDED:
        pytest.skip(f"this vLLM does not need it: {found.status} ({found.detail})")


@pytest.mark.parametrize("batch", sc.DEFAULT_BATCHES, ids=sc.Batch.label)
def test_aiter_capture_keeps_offsets_and_sets_seq_lens(aiter_needed, batch):
    assert rocm_attn_cpu_offsets.apply().status == PATCHED
    assert rocm_aiter_unified_builder.apply().status == PATCHED
    run = sc.run_capture(sc.ROCM_AITER_UNIFIED_ATTN, batch)
    assert run.failed is None, run.failed
    attention = run.groups[0]
    assert attention.builder == rocm_aiter_unified_builder.BUILDER
    assert run.query_start_loc_after == batch.offsets()
    assert run.query_start_loc_cpu_after == batch.offsets()
    written = {w.field: w for w in attention.writes}
    assert set(written) == {"seq_lens"}
    assert written["seq_lens"].after == [1] * batch.total_reqs


def test_aiter_builder_shares_rocm_build(aiter_needed):
    """The serving hot path is vLLM's own build(), not a copy."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    build = RocmAttentionMetadataBuilder.build
    rocm_aiter_unified_builder.apply()
    cls = sc.backend_class(sc.ROCM_AITER_UNIFIED_ATTN).get_builder_cls()
    assert issubclass(cls, RocmAttentionMetadataBuilder)
    assert cls.build is build
    assert rocm_aiter_unified_builder.apply().status == ALREADY
    assert sc.backend_class(sc.ROCM_AITER_UNIFIED_ATTN).get_builder_cls() is cls


def test_revert_restores_vllm_builder(aiter_needed):
    backend = sc.backend_class(sc.ROCM_AITER_UNIFIED_ATTN)
    before = backend.get_builder_cls()
    rocm_aiter_unified_builder.apply()
    assert backend.get_builder_cls() is not before
    assert rocm_aiter_unified_builder.revert()
    assert backend.get_builder_cls() is before


def test_own_builder_pickles_by_name(aiter_needed):
    """vLLM's class pickles as module + name; so must the backport's."""
    import pickle

    rocm_aiter_unified_builder.apply()
    cls = sc.backend_class(sc.ROCM_AITER_UNIFIED_ATTN).get_builder_cls()
    assert cls.__name__ == cls.__qualname__ == rocm_aiter_unified_builder.BUILDER
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert rocm_aiter_unified_builder.revert()
    assert not hasattr(rocm_aiter_unified_builder, rocm_aiter_unified_builder.BUILDER)
