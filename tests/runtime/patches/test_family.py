# SPDX-License-Identifier: Apache-2.0
"""The CPU-offset backport follows what vLLM really instantiates: subclasses
that a backend returns, captures inherited from a mixin, builders the probe
cannot run (fail closed), many threads at once, and the per-patch switch.

Vendor classes are derived here at test time from vLLM's own builder and
capture function; the seed scenario on modified vLLM *files* lives in
``tests/test_vendor_variants.py``."""

from __future__ import annotations

import gc
import threading

import pytest

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.patches import (
    Status,
    by_name,
    is_guarded,
    original_of,
)
from vllm_capture_guard.runtime.probe import probe

FIELD = "query_start_loc_cpu"
METHOD = "build_for_cudagraph_capture"
PATCH = by_name("rocm-attn-cpu-offsets")


@pytest.fixture
def rocm(unpatched, zeroes_cpu_offsets):
    if not zeroes_cpu_offsets:
        pytest.skip("this vLLM's ROCm capture leaves the CPU offsets alone")
    from vllm.v1.attention.backends import rocm_attn

    gc.collect()  # classes other tests derived must not join the family
    yield rocm_attn
    gc.collect()  # let the derived classes leave __subclasses__()


def test_subclass_with_its_own_capture_is_patched(rocm):
    base = rocm.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    vendor = type("VendorBuilder", (base,), {METHOD: capture})
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED and outcome.warning is None
    assert "VendorBuilder" in outcome.detail
    assert is_guarded(vendor.__dict__[METHOD])
    assert probe(vendor).proves_untouched(FIELD)
    assert probe(base).proves_untouched(FIELD)
    assert PATCH.revert()
    assert vendor.__dict__[METHOD] is capture and base.__dict__[METHOD] is capture


def test_capture_inherited_from_a_mixin_is_patched_on_the_class(rocm):
    base = rocm.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    mixin = type("CaptureMixin", (), {METHOD: capture})
    vendor = type("MixinBuilder", (mixin, base), {})
    assert PATCH.apply().status is Status.PATCHED
    assert is_guarded(vendor.__dict__[METHOD])
    assert mixin.__dict__[METHOD] is capture  # the mixin itself is not ours
    assert probe(vendor).proves_untouched(FIELD)
    PATCH.revert()
    assert METHOD not in vendor.__dict__
    assert vendor.build_for_cudagraph_capture is capture


def test_subclass_that_only_inherits_gets_no_second_wrapper(rocm):
    base = rocm.RocmAttentionMetadataBuilder
    vendor = type("PlainSubclass", (base,), {})
    PATCH.apply()
    assert METHOD not in vendor.__dict__
    assert vendor.build_for_cudagraph_capture is base.build_for_cudagraph_capture


def test_builder_the_probe_cannot_run_is_patched_with_a_warning(rocm):
    base = rocm.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]

    def needs_init(self, common_attn_metadata):
        assert self.num_heads_kv > 0  # set by __init__ only
        return capture(self, common_attn_metadata)

    vendor = type("NeedsInitBuilder", (base,), {METHOD: needs_init})
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED
    assert "could not prove" in outcome.warning
    assert "NeedsInitBuilder" in outcome.warning and "num_heads_kv" in outcome.warning
    assert original_of(vendor.__dict__[METHOD]) is needs_init


def test_four_threads_install_one_wrapper(rocm):
    base = rocm.RocmAttentionMetadataBuilder
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


def test_build_stays_vllms_own_function(rocm):
    base = rocm.RocmAttentionMetadataBuilder
    build = base.__dict__["build"]
    PATCH.apply()
    assert base.__dict__["build"] is build


def test_per_patch_switch_leaves_that_patch_out(rocm, monkeypatch):
    base = rocm.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    monkeypatch.setenv(switch.DISABLE_ENV, PATCH.name)
    outcome = PATCH.apply()
    assert outcome.status is Status.DISABLED
    assert base.__dict__[METHOD] is capture
    other = by_name("rocm-aiter-unified-builder")
    assert other.apply().status is not Status.DISABLED


def test_subclass_defined_later_is_checked_when_defined(rocm):
    base = rocm.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    seen = []
    PATCH.notify = seen.append
    try:
        assert PATCH.apply().status is Status.PATCHED
        later = type("LaterVendorBuilder", (base,), {METHOD: capture})
        assert is_guarded(later.__dict__[METHOD])
        assert probe(later).proves_untouched(FIELD)
        (outcome,) = seen
        assert (
            outcome.status is Status.PATCHED and "LaterVendorBuilder" in outcome.detail
        )
        clean = type("LaterCleanBuilder", (base,), {})
        assert METHOD not in clean.__dict__
        assert PATCH.revert()
        assert "__init_subclass__" not in base.__dict__
        after = type("AfterRevertBuilder", (base,), {METHOD: capture})
        assert after.__dict__[METHOD] is capture
    finally:
        PATCH.notify = None


def test_our_own_aiter_builder_is_never_wrapped(rocm):
    aiter = by_name("rocm-aiter-unified-builder")
    assert PATCH.apply().status is Status.PATCHED
    assert aiter.apply().status is Status.PATCHED
    ours = aiter.backend().get_builder_cls()
    assert PATCH.apply().status is Status.ALREADY
    assert METHOD in ours.__dict__ and not is_guarded(ours.__dict__[METHOD])
    assert aiter.revert() and PATCH.revert()
