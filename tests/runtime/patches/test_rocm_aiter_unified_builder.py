# SPDX-License-Identifier: Apache-2.0
"""ROCM_AITER_UNIFIED_ATTN gets its own builder (PR #53821): capture keeps the
query offsets, which the AITER unified kernel reads at replay, and still sets
seq_lens to 1. From outside it looks like 0.29.0: the class is where upstream
put it, behaves as upstream's own tests expect, and pickles by name."""

from __future__ import annotations

import pickle

import pytest

from tests.conftest import run_snippet
from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as mod
from vllm_capture_guard.runtime.patching import Status
from vllm_capture_guard.tools import harness as sc
from vllm_capture_guard.tools.fixes import by_name
from vllm_capture_guard.tools.revert import revert

PATCH = by_name("rocm-aiter-unified-builder")
CPU_PATCH = by_name("builder-capture-guard")


@pytest.fixture
def affected(unpatched, aiter_zeroes_offsets) -> None:
    """Every release where the AITER module imports: the backport goes on
    fixed releases too (over vLLM's own builder, with the same capture)."""


@pytest.mark.parametrize("batch", sc.DEFAULT_BATCHES, ids=sc.Batch.label)
def test_aiter_capture_keeps_offsets_and_sets_seq_lens(affected, batch):
    assert CPU_PATCH.apply().status is Status.PATCHED
    assert PATCH.apply().status is Status.PATCHED
    run = sc.run_capture("ROCM_AITER_UNIFIED_ATTN", batch)
    assert run.failed is None, run.failed
    attention = run.groups[0]
    assert attention.builder == mod.BUILDER
    assert run.values("query_start_loc") == batch.offsets()
    assert run.values("query_start_loc_cpu") == batch.offsets()
    written = {w.field: w for w in attention.writes}
    assert set(written) == {"seq_lens"}
    assert written["seq_lens"].after == [1] * batch.total_reqs


def test_aiter_builder_shares_rocm_build(affected):
    """The serving hot path is vLLM's own build(), not a copy."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    build = RocmAttentionMetadataBuilder.build
    PATCH.apply()
    cls = sc.backend_class("ROCM_AITER_UNIFIED_ATTN").get_builder_cls()
    assert issubclass(cls, RocmAttentionMetadataBuilder)
    assert cls.build is build
    assert PATCH.apply().status is Status.ALREADY
    assert sc.backend_class("ROCM_AITER_UNIFIED_ATTN").get_builder_cls() is cls


def test_revert_restores_vllm_builder_and_module(affected):
    import vllm.v1.attention.backends.rocm_aiter_unified_attn as aiter

    backend = aiter.RocmAiterUnifiedAttentionBackend
    before = backend.get_builder_cls()
    names = set(vars(aiter))
    PATCH.apply()
    assert backend.get_builder_cls() is not before
    assert aiter.RocmAiterUnifiedAttentionMetadataBuilder is backend.get_builder_cls()
    assert revert(PATCH)
    assert backend.get_builder_cls() is before
    assert set(vars(aiter)) == names
    assert mod.BUILDER not in vars(mod)


def test_own_builder_pickles_by_name(affected):
    PATCH.apply()
    cls = sc.backend_class("ROCM_AITER_UNIFIED_ATTN").get_builder_cls()
    assert cls.__name__ == cls.__qualname__ == mod.BUILDER
    assert pickle.loads(pickle.dumps(cls)) is cls


#: What vLLM 0.29.0's own tests of PR #53821 ask (tests/v1/attention/), in our
#: words: the dedicated builder is importable from the backend's module and is
#: what the backend returns; ROCM_ATTN keeps its builder; a bare builder's
#: capture calls build(0, common) once, sets seq_lens to 1 and returns the
#: metadata whose query_start_loc is the caller's tensor, values unchanged.
AS_UPSTREAM_TESTS = """
import json
from unittest.mock import MagicMock
import torch, vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.v1.attention.backends.rocm_aiter_unified_attn import (
    RocmAiterUnifiedAttentionBackend, RocmAiterUnifiedAttentionMetadataBuilder)
from vllm.v1.attention.backends.rocm_attn import (
    RocmAttentionBackend, RocmAttentionMetadataBuilder)
out = {
    "rocm_keeps_its_builder":
        RocmAttentionBackend.get_builder_cls() is RocmAttentionMetadataBuilder,
    "aiter_returns_dedicated": RocmAiterUnifiedAttentionBackend.get_builder_cls()
        is RocmAiterUnifiedAttentionMetadataBuilder,
}
builder = object.__new__(RocmAiterUnifiedAttentionMetadataBuilder)
metadata = MagicMock()
metadata.seq_lens = torch.tensor([4096, 8192], dtype=torch.int32)
builder.build = MagicMock(return_value=metadata)
common = MagicMock()
offsets = torch.tensor([0, 3, 7], dtype=torch.int32)
common.query_start_loc = offsets.clone()
metadata.query_start_loc = common.query_start_loc
got = builder.build_for_cudagraph_capture(common)
builder.build.assert_called_once_with(0, common)
out.update(
    returns_metadata=got is metadata,
    seq_lens_one=got.seq_lens.tolist() == [1, 1],
    same_offsets_tensor=got.query_start_loc is common.query_start_loc,
    offsets_unchanged=got.query_start_loc.tolist() == offsets.tolist(),
)
print(json.dumps(out))
"""


def test_patched_release_passes_what_upstreams_tests_ask(aiter_zeroes_offsets):
    """On every release where the module imports (0.29.0's own tests pass on
    0.29.0 with the backport over vLLM's builder too)."""
    out, logs = run_snippet(AS_UPSTREAM_TESTS, VLLM_CAPTURE_GUARD="on")
    assert out == dict.fromkeys(out, True), out
    assert len(out) == 6


def test_backport_capture_writes_no_offsets_at_all(affected):
    """Not zero-then-restore: a host write to the runner's pinned offsets
    could race the non-blocking copy vLLM issued just before capture. With
    mocks, any call on the offsets would be recorded."""
    from unittest.mock import MagicMock

    import torch

    PATCH.apply()
    cls = sc.backend_class("ROCM_AITER_UNIFIED_ATTN").get_builder_cls()
    builder = object.__new__(cls)
    metadata = MagicMock()
    metadata.seq_lens = torch.tensor([9, 9], dtype=torch.int32)
    builder.build = MagicMock(return_value=metadata)
    common = MagicMock()
    assert builder.build_for_cudagraph_capture(common) is metadata
    builder.build.assert_called_once_with(0, common)
    assert metadata.seq_lens.tolist() == [1, 1]
    assert common.query_start_loc.method_calls == []
    assert common.query_start_loc_cpu.method_calls == []


@pytest.fixture
def aiter(unpatched):
    """The AITER unified backend module, where it imports on this host."""
    try:
        import vllm.v1.attention.backends.rocm_aiter_unified_attn as module
    except Exception as e:  # 0.33's asks the GPU for its architecture
        pytest.skip(f"AITER unified backend unavailable here: {e}")
    import vllm.v1.worker.utils  # noqa: F401  (where vLLM makes builders)

    return module


def _vendor(aiter, builder: type) -> type:
    """A vendor's CUSTOM backend: a subclass of the AITER unified backend with
    a get_builder_cls of its own."""
    return type(
        "VendorAiterBackend",
        (aiter.RocmAiterUnifiedAttentionBackend,),
        {"get_builder_cls": staticmethod(lambda: builder)},
    )


def _offsets_after_capture(backend: type, batch: sc.Batch) -> list[int]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=sc.BLOCK_SIZE, num_kv_heads=1, head_size=sc.HEAD_SIZE,
        dtype=__import__("torch").bfloat16,
    )  # fmt: skip
    builder = sc.group_builder(backend, spec, sc.make_vllm_config(0))
    run = sc.capture([("attention", builder)], batch)
    assert run.failed is None, run.failed
    return run.values("query_start_loc")


def test_a_vendor_subclass_of_the_backend_keeps_the_offsets(aiter):
    """Derived from the installed release: a subclass whose get_builder_cls()
    returns vLLM's ROCm builder, whose capture zeroes the device offsets the
    AITER kernel reads at replay; with the backport it leaves them, as
    0.29.0's own AITER builder does, and says so without a WARNING."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    vendor = _vendor(aiter, RocmAttentionMetadataBuilder)
    batch = sc.Batch(4)
    assert _offsets_after_capture(vendor, batch) == [0] * 5  # unguarded: zeroed
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED and outcome.warning is None, outcome
    assert "VendorAiterBackend" in outcome.detail
    own = vendor.get_builder_cls()
    assert (
        issubclass(own, RocmAttentionMetadataBuilder) and own.__module__ == mod.__name__
    )
    assert _offsets_after_capture(vendor, batch) == batch.offsets()
    assert pickle.loads(pickle.dumps(own)) is own
    assert revert(PATCH)
    assert vendor.get_builder_cls() is RocmAttentionMetadataBuilder


def test_a_vendors_own_zeroing_capture_is_replaced_with_one_warning(aiter):
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    def build_for_cudagraph_capture(self, common_attn_metadata):
        built = self.build(0, common_attn_metadata)
        common_attn_metadata.query_start_loc.zero_()
        return built

    builder = type(
        "VendorAiterBuilder",
        (RocmAttentionMetadataBuilder,),
        {"build_for_cudagraph_capture": build_for_cudagraph_capture},
    )
    vendor = _vendor(aiter, builder)
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED
    assert (
        "replaced the capture of VendorAiterBackend's builder VendorAiterBuilder"
        in (outcome.warning or "")
    ), outcome
    assert _offsets_after_capture(vendor, sc.Batch(4)) == sc.Batch(4).offsets()
