# SPDX-License-Identifier: Apache-2.0
"""The host-metadata guard in this process, on vLLM's real builders: every
builder class with a capture of its own is guarded, every builder vLLM's
``AttentionGroup`` makes is guarded on the instance (resolved at each call),
a nested capture saves once, what the capture rebinds reaches the shared
metadata while what it writes in place is put back, host is told by where a
tensor lives, and our own failure handling (fakes only there).

Through vLLM's whole start-up, at every capture size, see
``tests/runtime/test_guard_at_use.py``."""

from __future__ import annotations

import gc
import logging
import threading

import pytest
import torch

from tests.fake_device import DeviceTensor
from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.guard import guarded_call, restore
from vllm_capture_guard.runtime.guard.metadata import fields_of
from vllm_capture_guard.runtime.patching import Status, is_guarded, original_of
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.contract import CPU
from vllm_capture_guard.tools.fixes import by_name
from vllm_capture_guard.tools.revert import revert

METHOD = "build_for_cudagraph_capture"
PATCH = by_name("builder-capture-guard")


def _ours_warned(record) -> bool:  # noqa: ANN001
    """A WARNING of the guard's (not another library's, logged meanwhile)."""
    return record.levelno == logging.WARNING and record.name == "vllm.capture_guard"


@pytest.fixture
def rocm(unpatched):
    import vllm.v1.worker.utils  # noqa: F401  (AttentionGroup: where vLLM makes builders)
    from vllm.v1.attention.backends import rocm_attn

    gc.collect()  # classes other tests derived must not be found
    yield rocm_attn
    gc.collect()


def _spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=harness.BLOCK_SIZE,
        num_kv_heads=1,
        head_size=harness.HEAD_SIZE,
        dtype=torch.bfloat16,
    )


def host_writes(builder) -> list[str]:  # noqa: ANN001
    """Run ``builder``'s capture on shared runner buffers, as the runner does:
    which host fields did it change?"""
    run = harness.capture([("attention", builder)], harness.Batch(4))
    assert run.failed is None, run.failed
    return [w.field for w in run.groups[0].writes if w.side == CPU]


def direct(cls: type):  # noqa: ANN201
    """``cls`` made directly, as a test or a tool makes a builder."""
    return harness.make_builder(cls, _spec(), harness.make_vllm_config(0))


def by_vllm(backend: type):  # noqa: ANN201
    """The builder vLLM's ``AttentionGroup`` makes for ``backend``."""
    return harness.group_builder(backend, _spec(), harness.make_vllm_config(0))


def zeroing(capture):  # noqa: ANN001, ANN201
    """``capture``, then the host offsets zeroed (vLLM 0.27/0.28's shape)."""

    def build_for_cudagraph_capture(self, common_attn_metadata):
        out = capture(self, common_attn_metadata)
        common_attn_metadata.query_start_loc_cpu.zero_()
        return out

    return build_for_cudagraph_capture


def test_every_builder_class_with_its_own_capture_is_guarded(rocm):
    from vllm.v1.attention.backends import triton_attn

    base = rocm.RocmAttentionMetadataBuilder
    vendor = type("VendorBuilder", (base,), {METHOD: zeroing(base.__dict__[METHOD])})
    assert host_writes(direct(vendor)) == ["query_start_loc_cpu"]  # unguarded
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED and outcome.warning is None
    for cls in (base, vendor, triton_attn.TritonAttentionMetadataBuilder):
        assert is_guarded(cls.__dict__[METHOD]), cls
    assert host_writes(direct(vendor)) == [] and host_writes(direct(base)) == []
    assert PATCH.apply().status is Status.ALREADY
    assert revert(PATCH)
    assert not is_guarded(vendor.__dict__[METHOD]) and not is_guarded(
        base.__dict__[METHOD]
    )


def test_a_class_made_after_the_last_check_is_guarded_when_vllm_makes_it(rocm):
    PATCH.apply()
    base = rocm.RocmAttentionMetadataBuilder
    later = type("LaterBuilder", (base,), {METHOD: zeroing(base.__dict__[METHOD])})
    backend = type(
        "LaterBackend",
        (rocm.RocmAttentionBackend,),
        {"get_builder_cls": staticmethod(lambda: later)},
    )
    builder = by_vllm(backend)
    assert is_guarded(vars(builder)[METHOD])  # on the instance
    assert is_guarded(vars(later)[METHOD])  # and now on the class
    assert host_writes(builder) == []


def test_a_class_made_after_the_last_check_and_built_directly_is_guarded(rocm):
    """Made after every patch applied, built by hand (not by vLLM's
    AttentionGroup), and captured: guarded as Python made the class."""
    PATCH.apply()
    base = rocm.RocmAttentionMetadataBuilder
    later = type("DirectBuilder", (base,), {METHOD: zeroing(base.__dict__[METHOD])})
    assert is_guarded(vars(later)[METHOD])
    assert host_writes(direct(later)) == []


def test_a_capture_put_back_after_the_builder_was_made_is_still_guarded(
    rocm, monkeypatch
):
    """The instance's guard resolves the class's capture at each call."""
    PATCH.apply()
    base = rocm.RocmAttentionMetadataBuilder
    builder = by_vllm(rocm.RocmAttentionBackend)
    # vLLM's own capture comes back after the test (the guard's revert only
    # takes its own wrappers off)
    monkeypatch.setattr(base, METHOD, zeroing(original_of(vars(base)[METHOD])))
    assert not is_guarded(vars(base)[METHOD])  # the class is bare again
    assert host_writes(builder) == []
    assert host_writes(direct(base)) == ["query_start_loc_cpu"]  # made directly


def test_a_capture_bound_per_instance_is_guarded(rocm):
    PATCH.apply()
    base = rocm.RocmAttentionMetadataBuilder
    capture = zeroing(original_of(vars(base)[METHOD]))

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self.build_for_cudagraph_capture = capture.__get__(self)

    vendor = type("PerInstanceBuilder", (base,), {"__init__": __init__})
    backend = type(
        "PerInstanceBackend",
        (rocm.RocmAttentionBackend,),
        {"get_builder_cls": staticmethod(lambda: vendor)},
    )
    assert host_writes(direct(vendor)) == ["query_start_loc_cpu"]  # shadows
    assert host_writes(by_vllm(backend)) == []


def test_a_nested_capture_saves_once(rocm, monkeypatch):
    PATCH.apply()
    base = rocm.RocmAttentionMetadataBuilder

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return base.build_for_cudagraph_capture(self, common_attn_metadata)

    nested = type("NestedBuilder", (base,), {METHOD: build_for_cudagraph_capture})
    PATCH.apply()
    saves = []
    real = restore.save
    monkeypatch.setattr(restore, "save", lambda m: saves.append(1) or real(m))
    assert host_writes(direct(nested)) == []
    assert len(saves) == 1


def test_rebinds_and_lazy_caches_reach_the_shared_metadata(rocm):
    """What the capture does to the metadata other than writing a host value
    in place (FlexAttention rebinds max_seq_len; a lazy host cache is filled
    from None) reaches the shared metadata, as without the guard."""
    shared = harness.shared_metadata(harness.Batch(4))
    cache = "_num_computed_tokens_cpu"
    shared.__dict__[cache] = None
    filled = torch.arange(4, dtype=torch.int32)

    def capture(metadata):
        metadata.max_seq_len = 7
        metadata.__dict__[cache] = filled
        metadata.query_start_loc_cpu.zero_()
        metadata.query_start_loc.zero_()
        return "built"

    before = shared.query_start_loc_cpu.clone()
    assert guarded_call.run(capture, "Fake", shared) == "built"
    assert shared.max_seq_len == 7 and shared.__dict__[cache] is filled
    assert torch.equal(shared.query_start_loc_cpu, before)  # in place: put back
    assert shared.query_start_loc.eq(0).all()  # device: lands (#25985)


def test_the_capture_sees_its_own_writes_and_the_runners_buffers():
    """Inside the capture the host values are the runner's own tensors (pinned
    where the runner's are) and its writes are visible to it; two fields that
    hold one tensor stay one tensor."""
    shared = harness.shared_metadata(harness.Batch(4))
    shared.__dict__["host_alias_cpu"] = shared.query_start_loc_cpu
    seen = {}

    def capture(metadata):
        seen["same"] = metadata.query_start_loc_cpu is shared.query_start_loc_cpu
        metadata.query_start_loc_cpu.zero_()
        seen["alias"] = metadata.host_alias_cpu.tolist()
        return "built"

    guarded_call.run(capture, "Fake", shared)
    assert seen == {"same": True, "alias": [0] * 5}
    assert shared.host_alias_cpu.tolist() == harness.Batch(4).offsets()


def test_a_tensor_in_a_container_is_put_back_in_place_and_stays_the_runners():
    shared = harness.shared_metadata(harness.Batch(2))
    runners = torch.arange(4, dtype=torch.int32)
    shared.__dict__["vendor_ranges"] = {"offsets": runners, "spans": [(0, 1)]}

    def capture(metadata):
        metadata.vendor_ranges["offsets"].zero_()
        metadata.vendor_ranges["offsets"] = torch.zeros(4)
        metadata.vendor_ranges["spans"].append((1, 2))

    guarded_call.run(capture, "Containers", shared)
    assert shared.vendor_ranges["offsets"] is runners
    assert runners.tolist() == [0, 1, 2, 3]
    assert shared.vendor_ranges["spans"] == [(0, 1)]


def test_nan_where_nan_was_is_no_write(caplog):
    shared = harness.shared_metadata(harness.Batch(2))
    shared.__dict__["scale_cpu"] = torch.tensor([float("nan"), 1.0])
    shared.__dict__["scale_strided_cpu"] = torch.full((4,), float("nan"))[::2]
    with caplog.at_level(logging.INFO, logger="vllm.capture_guard"):
        guarded_call.run(lambda m: None, "NaNs", shared)
    said = [r.getMessage() for r in caplog.records if "NaNs" in r.getMessage()]
    assert said and "wrote no shared host value" in said[0], said


def test_a_nested_capture_on_other_metadata_is_guarded_too():
    outer = harness.shared_metadata(harness.Batch(2))
    inner = harness.shared_metadata(harness.Batch(3))

    def nested(metadata):
        metadata.query_start_loc_cpu.zero_()

    def capture(metadata):
        return guarded_call.run(nested, "Inner", inner)

    guarded_call.run(capture, "Outer", outer)
    assert inner.query_start_loc_cpu.tolist() == harness.Batch(3).offsets()
    assert guarded_call.SEEN["Inner"].wrote == {"query_start_loc_cpu": 3}


def test_a_write_that_bypasses_torchs_version_counter_is_put_back():
    """A write through a numpy view (no version bump) is told from the bytes."""
    shared = harness.shared_metadata(harness.Batch(4))

    def capture(metadata):
        metadata.query_start_loc_cpu.numpy()[:] = 0

    guarded_call.run(capture, "Numpy", shared)
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()


def _slotted(cls: type, batch: harness.Batch, **extra) -> object:  # noqa: ANN003
    """vLLM's metadata for ``batch``, made as ``cls`` (same fields)."""
    import dataclasses

    made = harness.shared_metadata(batch)
    values = {f.name: getattr(made, f.name) for f in dataclasses.fields(made)}
    return cls(**{**values, **extra})


def test_slotted_metadata_is_read_as_a_dataclass_is():
    """``@dataclass(slots=True)``: a subclass of vLLM's class (which still has
    an instance dict, empty: ``vars()`` sees none of its fields) and vLLM's
    class declared slotted again (no instance dict). Both are guarded."""
    import dataclasses

    from vllm.v1.attention.backend import CommonAttentionMetadata as Common

    sub = dataclasses.dataclass(slots=True)(type("SlottedSub", (Common,), {}))
    names = {f.name: (f.type, f) for f in dataclasses.fields(Common)}
    replaced = dataclasses.make_dataclass(
        "CommonAttentionMetadata", [(n, t, f) for n, (t, f) in names.items()],
        slots=True,
    )  # fmt: skip

    def capture(metadata):
        metadata.query_start_loc_cpu.zero_()

    # a lazy cache behind a property (0.27-0.29; 0.33 has none)
    lazy = {"_seq_lens_cpu": None} if "_seq_lens_cpu" in names else {}
    for cls in (sub, replaced):
        cm = _slotted(cls, harness.Batch(4), **lazy)
        assert not vars(cm) if cls is sub else not hasattr(cm, "__dict__")
        assert "query_start_loc_cpu" in fields_of(cm)
        guarded_call.run(capture, cls.__name__, cm)
        assert cm.query_start_loc_cpu.tolist() == harness.Batch(4).offsets(), cls
        assert all(getattr(cm, n) is None for n in lazy)  # its property not read


def test_no_property_is_read():
    """``seq_lens_cpu`` is a property that fills ``_seq_lens_cpu`` with a
    blocking device-to-host copy: the guard reads fields, never it."""
    shared = harness.shared_metadata(harness.Batch(4))
    shared.__dict__["_seq_lens_cpu"] = None
    shared.__dict__["_num_computed_tokens_cpu"] = None
    guarded_call.run(lambda m: None, "Lazy", shared)
    assert shared._seq_lens_cpu is None and shared._num_computed_tokens_cpu is None


def test_containers_are_put_back():
    shared = harness.shared_metadata(harness.Batch(2))
    shared.__dict__["vendor_ranges"] = {0: [(0, 1)]}

    def capture(metadata):
        metadata.vendor_ranges[0].append((1, 2))

    guarded_call.run(capture, "Fake", shared)
    assert shared.vendor_ranges == {0: [(0, 1)]}


def test_host_arrays_are_kept_by_their_bytes_and_a_numpy_scalar_costs_nothing(
    caplog,
):
    """Model Runner V2's metadata holds a host array (its request indices):
    a dense one is kept as its bytes, in place, whatever wrote them; a view
    that is not dense is kept by a copy; a numpy scalar, which nothing can
    change in place, is kept without a word."""
    import numpy as np

    shared = harness.shared_metadata(harness.Batch(2))
    dense, strided = np.arange(8, dtype=np.int64), np.arange(16)[::2]
    shared.__dict__.update(req_idx=dense, vendor_np=strided, scalar_np=np.int64(3))
    address = dense.__array_interface__["data"][0]

    def capture(metadata):
        metadata.req_idx[:] = 0
        metadata.vendor_np[:] = -1

    with caplog.at_level(logging.WARNING):
        guarded_call.run(capture, "Arrays", shared)
    assert shared.req_idx is dense and dense.tolist() == list(range(8))
    assert dense.__array_interface__["data"][0] == address  # in place
    assert strided.tolist() == list(range(0, 16, 2))
    assert shared.scalar_np == 3
    assert not [r for r in caplog.records if _ours_warned(r)], caplog.text


def test_host_is_where_a_tensor_lives_when_the_device_fields_are_on_a_gpu():
    """Device fields that report a GPU (tests.fake_device): every CPU tensor
    and array is a host value, whatever its name; device writes land."""
    import numpy as np

    shared = harness.shared_metadata(harness.Batch(4))
    shared.query_start_loc = shared.query_start_loc.as_subclass(DeviceTensor)
    neutral = shared.query_start_loc_cpu[:]  # a host view, neutrally named
    shared.__dict__["vendor_offsets"] = neutral
    shared.__dict__["vendor_array"] = np.arange(4)
    saved = {v.field for v in restore.save(shared).values}
    assert {"query_start_loc_cpu", "vendor_offsets", "vendor_array"} <= saved
    assert "query_start_loc" not in saved

    def capture(metadata):
        metadata.vendor_offsets.zero_()
        metadata.vendor_array[:] = 0
        metadata.query_start_loc.zero_()

    guarded_call.run(capture, "Fake", shared)
    assert neutral.tolist() == harness.Batch(4).offsets()
    assert shared.vendor_array.tolist() == [0, 1, 2, 3]
    assert shared.query_start_loc.eq(0).all()
    # on an all-CPU host names decide: the neutral name is not host there
    plain = harness.shared_metadata(harness.Batch(4))
    plain.__dict__["vendor_offsets"] = plain.query_start_loc_cpu[:]
    assert "vendor_offsets" not in {v.field for v in restore.save(plain).values}


def test_the_log_says_once_what_the_capture_wrote(rocm, caplog):
    PATCH.apply()
    base = rocm.RocmAttentionMetadataBuilder
    vendor = type(
        "SaysOnce", (base,), {METHOD: zeroing(original_of(base.__dict__[METHOD]))}
    )
    PATCH.apply()
    with caplog.at_level(logging.INFO, logger="vllm.capture_guard"):
        builder = direct(vendor)
        for _ in range(3):
            assert host_writes(builder) == []
    said = [r.getMessage() for r in caplog.records if "SaysOnce" in r.getMessage()]
    assert said == [
        "vllm-capture-guard: SaysOnce's capture wrote query_start_loc_cpu (size 4); "
        "kept from the other builders (backport of PR #51585)"
    ]


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
    assert revert(PATCH)
    assert base.__dict__[METHOD] is capture


def test_build_stays_vllms_own_function(rocm):
    base = rocm.RocmAttentionMetadataBuilder
    build = base.__dict__["build"]
    PATCH.apply()
    assert base.__dict__["build"] is build


def test_per_patch_switch_leaves_that_patch_out(rocm, monkeypatch):
    base = rocm.RocmAttentionMetadataBuilder
    capture = base.__dict__[METHOD]
    monkeypatch.setenv(switch.DISABLE_ENV, PATCH.name)
    assert PATCH.apply().status is Status.DISABLED
    assert base.__dict__[METHOD] is capture
    assert by_name("rocm-aiter-unified-builder").apply().status is not Status.DISABLED


# --- our own failure handling: fakes allowed here ---------------------------


def test_a_metadata_it_cannot_read_runs_vllms_own_call_with_one_warning(caplog):
    class Unreadable:  # neither an instance dict nor slots: no fields to read
        __slots__ = ()
        query_start_loc = property(lambda self: offsets)
        query_start_loc_cpu = property(lambda self: offsets_cpu)

    offsets, offsets_cpu = torch.arange(3), torch.arange(3)
    cm = Unreadable()

    def zeroes(metadata):
        metadata.query_start_loc_cpu.zero_()
        metadata.query_start_loc.zero_()
        return "built"

    with caplog.at_level(logging.WARNING, logger="vllm.capture_guard"):
        assert guarded_call.run(zeroes, "Unreadable", cm) == "built"
        assert guarded_call.run(zeroes, "Unreadable", cm) == "built"
    warnings = [r.getMessage() for r in caplog.records if _ours_warned(r)]
    assert len(warnings) == 1 and "ran unguarded" in warnings[0], warnings  # once
    assert offsets.eq(0).all()


def test_memory_that_moved_is_never_written_and_the_others_are_put_back(caplog):
    """A capture that frees or shrinks a host tensor's storage: the guard does
    not touch that memory; every other host value is still put back."""
    shared = harness.shared_metadata(harness.Batch(4))
    shared.__dict__["workspace_cpu"] = torch.zeros(1 << 20, dtype=torch.int32)

    def capture(metadata):
        metadata.query_start_loc_cpu.zero_()
        metadata.workspace_cpu.untyped_storage().resize_(0)

    with caplog.at_level(logging.WARNING, logger="vllm.capture_guard"):
        guarded_call.run(capture, "Frees", shared)
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()
    warnings = [r.getMessage() for r in caplog.records if _ours_warned(r)]
    assert len(warnings) == 1 and "could not keep workspace_cpu" in warnings[0]


def test_a_value_it_cannot_save_leaves_the_others_guarded(caplog):
    class Unsaveable:
        __array__ = None

        def copy(self):
            raise TypeError("no copies")

    shared = harness.shared_metadata(harness.Batch(4))
    shared.__dict__["vendor_state"] = Unsaveable()

    def capture(metadata):
        metadata.query_start_loc_cpu.zero_()

    with caplog.at_level(logging.WARNING, logger="vllm.capture_guard"):
        guarded_call.run(capture, "Unsaveable", shared)
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()
    warnings = [r.getMessage() for r in caplog.records if _ours_warned(r)]
    assert len(warnings) == 1 and "could not keep vendor_state" in warnings[0]


def test_a_failure_after_the_capture_never_reaches_vllm(monkeypatch, caplog):
    shared = harness.shared_metadata(harness.Batch(2))
    monkeypatch.setattr(restore, "restore", lambda *a: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="vllm.capture_guard"):
        assert guarded_call.run(lambda m: "built", "Broken", shared) == "built"
    assert any("could not put back" in r.getMessage() for r in caplog.records)
