# SPDX-License-Identifier: Apache-2.0
"""The host-metadata backport follows what vLLM really instantiates:
subclasses, captures inherited from a mixin, classes defined or changed after
the import (found again when the patch applies again, as it does at the
capture entry), captures it cannot read (guarded, with a WARNING), many
threads at once, and the per-patch switch.

Vendor classes are derived here at test time from vLLM's own builder and
capture function; modified vLLM *files* are in ``tests/test_vendor_variants.py``
and ``tests/runtime/test_guard_at_use.py``."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.patches import (
    Status,
    by_name,
    is_guarded,
    original_of,
)
from vllm_capture_guard.runtime.shape import is_host_field
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.contract import CPU

METHOD = "build_for_cudagraph_capture"
PATCH = by_name("rocm-attn-cpu-offsets")


@pytest.fixture
def rocm(unpatched):
    from vllm.v1.attention.backends import rocm_attn

    gc.collect()  # classes other tests derived must not join the family
    yield rocm_attn
    gc.collect()  # let the derived classes leave __subclasses__()


@pytest.fixture
def affected(rocm, zeroes_cpu_offsets):
    if not zeroes_cpu_offsets:
        pytest.skip("this vLLM's ROCm capture leaves the CPU offsets alone")
    return rocm


def host_writes(builder_cls: type) -> list[str]:
    """Run ``builder_cls``'s capture on shared runner buffers, as the runner
    does: which host fields did it change?"""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    config = harness.make_vllm_config(0)
    spec = FullAttentionSpec(
        block_size=harness.BLOCK_SIZE,
        num_kv_heads=1,
        head_size=harness.HEAD_SIZE,
        dtype=torch.bfloat16,
    )
    builder = harness.make_builder(builder_cls, spec, config)
    run = harness.capture([("attention", builder)], harness.Batch(4))
    assert run.failed is None, run.failed
    return [w.field for w in run.groups[0].writes if w.side == CPU]


def test_subclass_with_its_own_capture_is_patched(affected):
    base = affected.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    vendor = type("VendorBuilder", (base,), {METHOD: capture})
    assert host_writes(vendor) == ["query_start_loc_cpu"]  # unguarded
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED and outcome.warning is None
    assert "VendorBuilder" in outcome.detail
    assert is_guarded(vendor.__dict__[METHOD])
    assert host_writes(vendor) == [] and host_writes(base) == []
    assert PATCH.revert()
    assert vendor.__dict__[METHOD] is capture and base.__dict__[METHOD] is capture


def test_capture_inherited_from_a_mixin_is_patched_on_the_class(affected):
    base = affected.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    mixin = type("CaptureMixin", (), {METHOD: capture})
    vendor = type("MixinBuilder", (mixin, base), {})
    assert PATCH.apply().status is Status.PATCHED
    assert is_guarded(vendor.__dict__[METHOD])
    assert mixin.__dict__[METHOD] is capture  # the mixin itself is not ours
    assert host_writes(vendor) == []
    PATCH.revert()
    assert METHOD not in vendor.__dict__
    assert vendor.build_for_cudagraph_capture is capture


def test_subclass_that_only_inherits_gets_no_second_wrapper(affected):
    base = affected.RocmAttentionMetadataBuilder
    vendor = type("PlainSubclass", (base,), {})
    PATCH.apply()
    assert METHOD not in vendor.__dict__
    assert vendor.build_for_cudagraph_capture is base.build_for_cudagraph_capture


def test_capture_it_cannot_read_as_fixed_is_patched_with_a_warning(rocm):
    """On every release, fixed ones included: a capture that hands the shared
    metadata to something other than ``self.build`` is in doubt."""
    base = rocm.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]

    def through_a_helper(self, common_attn_metadata):
        return capture(self, common_attn_metadata)

    vendor = type("HelperBuilder", (base,), {METHOD: through_a_helper})
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED
    assert "HelperBuilder" in outcome.warning and "could not show" in outcome.warning
    assert original_of(vendor.__dict__[METHOD]) is through_a_helper
    assert host_writes(vendor) == []


def test_class_defined_after_the_import_is_patched_when_applied_again(rocm):
    """What the capture entry does: apply again, and find the newcomers."""
    base = rocm.RocmAttentionMetadataBuilder
    first = PATCH.apply().status
    capture = base.__dict__[METHOD]

    def zeroing(self, common_attn_metadata):
        out = capture(self, common_attn_metadata)
        common_attn_metadata.query_start_loc_cpu.zero_()
        return out

    later = type("LaterVendorBuilder", (base,), {METHOD: zeroing})
    assert not is_guarded(later.__dict__[METHOD])
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED and "LaterVendorBuilder" in outcome.detail
    assert is_guarded(later.__dict__[METHOD])
    assert host_writes(later) == []
    assert first in (Status.PATCHED, Status.NOT_NEEDED)


def test_capture_put_back_on_the_class_is_patched_again(affected):
    base = affected.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    assert PATCH.apply().status is Status.PATCHED
    base.build_for_cudagraph_capture = capture  # a vendor module puts it back
    assert host_writes(base) == ["query_start_loc_cpu"]
    assert PATCH.apply().status is Status.PATCHED
    assert host_writes(base) == []


def test_four_threads_install_one_wrapper(affected):
    base = affected.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    barrier = threading.Barrier(4)
    outcomes = []

    def run():
        barrier.wait()
        outcomes.append(PATCH.apply().status)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == sorted([Status.PATCHED] + [Status.ALREADY] * 3)
    wrapper = base.__dict__[METHOD]
    assert original_of(wrapper) is capture
    assert wrapper.__vllm_capture_guard_original__ is capture  # one layer
    assert PATCH.revert()
    assert base.__dict__[METHOD] is capture
    assert not PATCH.revert()


def test_build_stays_vllms_own_function(affected):
    base = affected.RocmAttentionMetadataBuilder
    build = base.__dict__["build"]
    PATCH.apply()
    assert base.__dict__["build"] is build


def test_per_patch_switch_leaves_that_patch_out(affected, monkeypatch):
    base = affected.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    monkeypatch.setenv(switch.DISABLE_ENV, PATCH.name)
    outcome = PATCH.apply()
    assert outcome.status is Status.DISABLED
    assert base.__dict__[METHOD] is capture
    other = by_name("rocm-aiter-unified-builder")
    assert other.apply().status is not Status.DISABLED


def test_our_own_aiter_builder_is_never_wrapped(affected):
    from vllm.v1.attention.backends import rocm_aiter_unified_attn as au

    aiter = by_name("rocm-aiter-unified-builder")
    assert PATCH.apply().status is Status.PATCHED
    assert aiter.apply().status is Status.PATCHED
    ours = au.RocmAiterUnifiedAttentionBackend.get_builder_cls()
    assert PATCH.apply().status is Status.ALREADY
    assert METHOD in ours.__dict__ and not is_guarded(ours.__dict__[METHOD])
    assert aiter.revert() and PATCH.revert()


def test_the_capture_keeps_every_host_field_values_and_bindings(affected):
    """Isolation: the shared metadata's host tensors are the very same objects
    with the same values after the guarded capture; its device offsets are
    zeroed as in 0.29.0 (#25985)."""
    base = affected.RocmAttentionMetadataBuilder
    PATCH.apply()
    config = harness.make_vllm_config(0)
    builder = harness.attention_builder("ROCM_ATTN", config)
    buffers = harness.RunnerBuffers(max_reqs=8)
    batch = harness.Batch(8)
    buffers.fill(batch)
    shared = buffers.common_metadata(batch)
    host = {
        n: (t, t.clone())
        for n, t in vars(shared).items()
        if isinstance(t, torch.Tensor) and is_host_field(n)
    }
    assert {"query_start_loc_cpu", "is_prefilling"} <= set(host)
    assert type(builder) is base
    builder.build_for_cudagraph_capture(shared)
    for name, (tensor, before) in host.items():
        assert getattr(shared, name) is tensor, name
        assert torch.equal(tensor, before), name
    assert shared.query_start_loc.eq(0).all()


def test_containers_are_the_captures_own_too(affected):
    """A dict or list field (``mm_req_doc_ranges``) is copied for the capture:
    what it does to it stays its own."""
    import dataclasses

    from vllm_capture_guard.runtime.patches import rocm_attn_cpu_offsets as rocm

    shared = harness.shared_metadata(harness.Batch(2))
    if "mm_req_doc_ranges" not in {f.name for f in dataclasses.fields(shared)}:
        pytest.skip("this vLLM's metadata has no container field")
    shared.mm_req_doc_ranges = {0: [(0, 1)]}

    def appends(self, cm):
        cm.mm_req_doc_ranges[0].append((1, 2))
        cm.query_start_loc.zero_()

    rocm._isolated(appends)(None, shared)
    assert shared.mm_req_doc_ranges == {0: [(0, 1)]}
    assert shared.query_start_loc.eq(0).all()  # device writes still land


def test_a_metadata_it_cannot_copy_is_restored_and_vllm_goes_on(caplog):
    """Our own failure handling (a fake metadata): the copy fails, the
    capture still runs on the shared object and its host values come back."""
    import logging

    from vllm_capture_guard.runtime.patches import rocm_attn_cpu_offsets as rocm

    class Uncopyable:
        __slots__ = ("query_start_loc", "query_start_loc_cpu")

        def __copy__(self):
            raise TypeError("no copies")

    cm = Uncopyable()
    cm.query_start_loc = torch.arange(3)
    cm.query_start_loc_cpu = torch.arange(3)

    def zeroes(self, metadata):
        metadata.query_start_loc_cpu.zero_()
        metadata.query_start_loc.zero_()
        return "built"

    with caplog.at_level(logging.WARNING, logger="vllm.capture_guard"):
        assert rocm._isolated(zeroes)(None, cm) == "built"
    assert caplog.records and "no own copy" in caplog.records[0].getMessage()
    assert cm.query_start_loc.eq(0).all()
    assert cm.query_start_loc_cpu.tolist() == [0, 1, 2]
