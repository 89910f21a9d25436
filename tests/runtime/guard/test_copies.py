# SPDX-License-Identifier: Apache-2.0
"""The copies and the wait (``runtime/guard/copies.py``) in this process:
which calls of a capture the guard follows and what it waits for, decided by
the guard's own code; and its handling of the wait (order, device errors, its
own failures, a stream capture, the capture mode). Fakes stand in for the
device here (a CPU tensor that says ``cuda``, a recording ``torch.cuda``);
the GPU tier runs the same on real streams and copies
(``tests/gpu/async_copies.py``)."""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch

from tests.fake_device import DeviceTensor, on_device
from vllm_capture_guard.runtime.guard import copies, guarded_call, restore
from vllm_capture_guard.tools import harness


def _ours_warned(record) -> bool:  # noqa: ANN001
    """A WARNING of the guard's (not another library's, logged meanwhile)."""
    return record.levelno == logging.WARNING and record.name == "vllm.capture_guard"


def _waiting(monkeypatch, wait, mark=None) -> list:  # noqa: ANN001
    """``save`` as it is, but saying there are copies to wait for (as on a GPU
    where a capture queued one on pinned host memory), or ``mark``; the wait
    replaced, and no copies followed (the GPU tier follows real ones)."""
    save, order = restore.save, []
    if mark is None:
        mark = copies.Watch("cuda:0")
        mark.unfollowed = "a copy it cannot see"

    def waiting_save(metadata):  # noqa: ANN001, ANN202
        saved = save(metadata)
        saved.watch = mark
        return saved

    monkeypatch.setattr(restore, "save", waiting_save)
    monkeypatch.setattr(copies, "follow", lambda watch: None)
    monkeypatch.setattr(copies, "wait", lambda watch: wait(watch.device, order))
    return order


def _device_fault(device, order):  # noqa: ANN001, ANN202
    error = getattr(torch, "AcceleratorError", RuntimeError)
    raise error("CUDA error: an illegal memory access was encountered")


def _zeroes(metadata):  # noqa: ANN001, ANN202
    metadata.query_start_loc_cpu.zero_()
    return "built"


def test_the_host_values_are_told_after_the_wait(monkeypatch):
    """Order only (the GPU tier shows the copies themselves): what lands in a
    host value while the guard waits, as a device-to-host copy does, is told
    and put back."""
    shared = harness.shared_metadata(harness.Batch(4))

    def late_copy(device, order):  # noqa: ANN001, ANN202
        order.append(device)
        shared.query_start_loc_cpu.zero_()

    order = _waiting(monkeypatch, late_copy)
    guarded_call.run(lambda m: None, "LateCopy", shared)
    assert order == ["cuda:0"]
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()
    assert guarded_call.SEEN["LateCopy"].wrote == {"query_start_loc_cpu": 4}


def test_a_device_error_at_the_wait_reaches_vllm_after_the_put_back(monkeypatch):
    """An asynchronous fault of the stream's work surfaces at the wait: it goes
    on to vLLM as it would have at vLLM's next synchronisation, and the host
    values are kept all the same."""
    _waiting(monkeypatch, _device_fault)
    shared = harness.shared_metadata(harness.Batch(2))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        guarded_call.run(_zeroes, "Faults", shared)
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(2).offsets()


def test_a_capture_that_raises_keeps_its_own_error(monkeypatch):
    _waiting(monkeypatch, _device_fault)
    shared = harness.shared_metadata(harness.Batch(2))

    def capture(metadata):  # noqa: ANN001, ANN202
        metadata.query_start_loc_cpu.zero_()
        raise ValueError("the capture's own")

    with pytest.raises(ValueError, match="the capture's own"):
        guarded_call.run(capture, "RaisesToo", shared)
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(2).offsets()


@pytest.mark.parametrize(
    "error",
    [NotImplementedError("no events here"),
     getattr(torch, "AcceleratorError", RuntimeError)(
         "operation not permitted when stream is capturing"),
     AttributeError("no current_stream")],
    ids=["not-a-device-error", "capture-mode", "attribute"],
)  # fmt: skip
def test_the_guards_own_failure_to_wait_is_one_warning(monkeypatch, caplog, error):
    """Not CUDA's or HIP's own error (or one of the capture mode): the
    guard's; it never reaches vLLM, and the values are told without waiting."""

    def fails(device, order):  # noqa: ANN001, ANN202
        raise error

    _waiting(monkeypatch, fails)
    shared = harness.shared_metadata(harness.Batch(2))
    owner = f"CannotWait{type(error).__name__}{len(str(error))}"
    with caplog.at_level(logging.WARNING, logger="vllm.capture_guard"):
        assert guarded_call.run(_zeroes, owner, shared) == "built"
    said = [r.getMessage() for r in caplog.records if _ours_warned(r)]
    assert len(said) == 1 and f"could not wait for {owner}'s capture" in said[0], said
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(2).offsets()


def test_inside_a_stream_capture_it_puts_back_at_once_with_one_warning(
    monkeypatch, caplog
):
    """Nothing has run yet: no wait (it would invalidate the graph), the host
    values put back, one WARNING per builder class."""

    def never(device, order):  # noqa: ANN001, ANN202
        pytest.fail("the guard waited inside a stream capture")

    _waiting(monkeypatch, never, mark=copies.CAPTURING)
    shared = harness.shared_metadata(harness.Batch(2))
    with caplog.at_level(logging.WARNING, logger="vllm.capture_guard"):
        guarded_call.run(_zeroes, "InsideAGraph", shared)
        guarded_call.run(_zeroes, "InsideAGraph", shared)
    said = [r.getMessage() for r in caplog.records if _ours_warned(r)]
    assert len(said) == 1 and "inside an active stream capture" in said[0], said
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(2).offsets()


class _FakeCuda:
    """What the wait asks of ``torch.cuda``, recorded in order."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def Event(self):  # noqa: ANN202, N802
        calls = self.calls

        class Event:
            def record(self, stream):  # noqa: ANN001, ANN202
                calls.append(("record", str(stream)))

            def synchronize(self):  # noqa: ANN202
                calls.append(("synchronize",))

        return Event()

    def current_stream(self, index):  # noqa: ANN001, ANN202
        return _Stream(f"stream of {index}", record=lambda: self.Event())


@pytest.mark.parametrize("exchanged", [0, 1], ids=["relaxed", "exchange-failed"])
def test_the_wait_runs_relaxed_and_gives_the_mode_back(monkeypatch, exchanged):
    """Where the guard cannot see the copies: one event on the device's
    current stream, with the thread's capture mode relaxed (2) around it and
    the previous mode given back, only where the exchange succeeded."""
    import ctypes

    calls: list = []

    def exchange(pointer):  # noqa: ANN001, ANN202
        mode = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int)).contents
        calls.append(("exchange", mode.value))
        mode.value = 0  # the previous mode: global
        return exchanged

    watch = copies.Watch(torch.device("cuda", 3))
    watch.unfollowed = "a copy it cannot see"
    fake = type("FakeTorch", (), {"cuda": _FakeCuda(calls)})()
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(copies, "_exchange", lambda: exchange)
    copies.wait(watch)
    monkeypatch.undo()
    expected = [("exchange", 2), ("record", "stream of 3"), ("synchronize",)]
    assert calls == expected + ([("exchange", 0)] if exchanged == 0 else [])


def test_pinned_is_told_by_torch_and_an_unreadable_array_waits_for_the_stream():
    import numpy as np

    assert copies._pinned(torch.zeros(3)) is False
    pageable = copies.Watch(torch.device("cuda", 0))
    pageable.add("array", np.zeros(3))  # an array: asked through torch
    assert (pageable.ranges, pageable.unfollowed) == ([], None)
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    for name, value in (("frozen", frozen), ("objects", np.array([object()]))):
        watch = copies.Watch(torch.device("cuda", 0))
        watch.add(name, value)  # torch cannot tell: wait for the stream
        assert watch.unfollowed and watch.unfollowed.startswith(name), watch.unfollowed


def test_no_wait_where_nothing_is_on_a_gpu(monkeypatch):
    """All on the CPU (or a device that only reports a GPU): nothing to
    follow or wait for, and CUDA is never asked."""
    monkeypatch.setattr(copies, "wait", lambda watch: pytest.fail("waited"))
    monkeypatch.setattr(copies, "_mode", lambda: pytest.fail("followed"))
    shared = harness.shared_metadata(harness.Batch(2))
    assert restore.save(shared).watch is None
    shared.query_start_loc = shared.query_start_loc.as_subclass(DeviceTensor)
    assert restore.save(shared).watch is None
    guarded_call.run(lambda m: None, "NoWait", shared)
    assert not torch.cuda.is_initialized()


# --- which calls the guard follows (its own decisions; fakes for the device) --


@torch.library.custom_op("capture_guard_test::host_sum", mutates_args=())
def _host_sum(x: torch.Tensor) -> torch.Tensor:
    """A custom op: what it does with its inputs is not the guard's to see."""
    return x.sum().reshape(1)


class _Stream:
    """A stream as the guard asks it: ``str()`` its device's name, and
    ``record_event()`` records a new event of ``record()`` (``torch.cuda.Event``
    unless given) on it, as ``torch.cuda.Stream.record_event`` does."""

    def __init__(self, device, record=None) -> None:  # noqa: ANN001
        self.device, self.cuda_stream = str(device), hash(str(device))
        self.record = record or (lambda: torch.cuda.Event())

    def __str__(self) -> str:
        return self.device

    def record_event(self):  # noqa: ANN202
        event = self.record()
        event.record(self)
        return event


def fake_cuda(monkeypatch) -> list[str]:  # noqa: ANN001
    """``torch.cuda`` as the guard asks it for an event after a copy: the
    devices of the streams events are recorded on, in order."""
    recorded: list[str] = []

    class Event:
        def record(self, stream):  # noqa: ANN001, ANN202
            recorded.append(stream.device)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(copies, "_exchange", lambda: lambda mode: 1)
    return recorded


@pytest.fixture
def followed(monkeypatch):
    """A runner-like buffer whose first 9 values are a saved pinned host value
    (as the metadata's ``query_start_loc_cpu[:n + 1]`` is a view of the
    runner's buffer), a device tensor (a CPU tensor that says ``cuda:0``), and
    the guard's watch over the saved bytes; recorded events are the devices of
    the streams they would be recorded on."""
    buffer = torch.arange(16, dtype=torch.int32)
    host, dev = buffer[:9], on_device(torch.zeros(16, dtype=torch.int32))
    watch = copies.Watch(torch.device("cuda", 0))
    watch.ranges.append(copies._bounds(host))  # as on a GPU, where it is pinned
    return buffer, host, dev, watch, fake_cuda(monkeypatch)


FOLLOWED = {
    "copy_-to-device": lambda b, h, d: d[:9].copy_(h, non_blocking=True),
    "blocking": lambda b, h, d: d[:9].copy_(h),
    "whole-buffer": lambda b, h, d: d.copy_(b, non_blocking=True),
    "copy_-to-host": lambda b, h, d: h.copy_(d[:9], non_blocking=True),
    "a-view-positional": lambda b, h, d: d[:4].copy_(h[1:5], True),
    "to-device": lambda b, h, d: h.to(d, non_blocking=True),
    "aten-op": lambda b, h, d: torch.ops.aten.copy_.default(d[:9], h, True),
    "foreach": lambda b, h, d: torch._foreach_copy_([d[:9]], [h], non_blocking=True),
    "numpy-view": lambda b, h, d: d[:9].copy_(
        torch.from_numpy(h.numpy()), non_blocking=True
    ),
}
NOT_FOLLOWED = {
    "another-slice": lambda b, h, d: d[:4].copy_(b[12:], non_blocking=True),
    "host-work": lambda b, h, d: (h.zero_(), h + 1, torch.diff(h), h.tolist()),
    "stays-on-host": lambda b, h, d: h.to(torch.float32, non_blocking=True),
    "device-work": lambda b, h, d: d.add_(1),
    "custom-op-elsewhere": lambda b, h, d: torch.ops.capture_guard_test.host_sum(
        b[12:]
    ),
}
UNSEEN = {
    "data_ptr": lambda b, h, d: h.data_ptr(),
    "storage": lambda b, h, d: h[2:].untyped_storage(),
    "custom-op": lambda b, h, d: torch.ops.capture_guard_test.host_sum(h),
}


@pytest.mark.parametrize("call", FOLLOWED.values(), ids=FOLLOWED)
def test_a_copy_of_the_saved_bytes_is_followed(followed, call):
    """An event after it, on its device's stream: a copy either way whose
    source or destination overlaps the saved bytes (the byte range, not the
    object: the whole buffer, a view, an array over the same memory). A
    blocking one's event is done at once (it synchronised its stream)."""
    buffer, host, dev, watch, recorded = followed
    with copies.follow(watch):
        call(buffer, host, dev)
    assert recorded == ["cuda:0"] and watch.unfollowed is None, (
        recorded,
        watch.unfollowed,
    )


@pytest.mark.parametrize("call", NOT_FOLLOWED.values(), ids=NOT_FOLLOWED)
def test_what_queues_no_copy_on_the_saved_bytes_is_not_followed(followed, call):
    """Nothing to wait for: another part of the buffer is not the saved bytes,
    host work is done at once, device work reads no host memory."""
    buffer, host, dev, watch, recorded = followed
    with copies.follow(watch):
        call(buffer, host, dev)
    assert recorded == [] and watch.unfollowed is None, (recorded, watch.unfollowed)


@pytest.mark.parametrize("call", UNSEEN.values(), ids=UNSEEN)
def test_the_saved_bytes_handed_on_unseen_make_it_wait_for_the_stream(followed, call):
    """A raw pointer (a kernel launch reads it) or a custom op given the saved
    memory: the guard cannot see what copies it, so it waits for the stream."""
    buffer, host, dev, watch, recorded = followed
    with copies.follow(watch):
        call(buffer, host, dev)
    assert recorded == [] and watch.unfollowed, watch.unfollowed


def test_a_call_it_cannot_follow_makes_it_wait_for_the_stream(followed, monkeypatch):
    buffer, host, dev, watch, recorded = followed

    def broken(value):  # noqa: ANN001, ANN202
        raise ValueError("no bounds")

    monkeypatch.setattr(watch, "hits", broken)
    with copies.follow(watch):
        assert dev[:9].copy_(host, non_blocking=True) is not None
    assert "could not follow" in watch.unfollowed and "no bounds" in watch.unfollowed


def test_bounds_are_the_bytes_a_value_lies_in(monkeypatch):
    """A dense tensor's own bytes; a strided one's whole storage (a superset:
    more copies followed, none missed); an array's through torch, and one
    torch cannot read makes the guard wait for the stream."""
    import numpy as np

    buffer = torch.arange(32, dtype=torch.int32)
    start = buffer.data_ptr()
    assert copies._bounds(buffer[2:10]) == (start + 8, start + 40)
    assert copies._bounds(buffer[::4]) == (start, start + 128)
    assert copies._bounds(buffer.view(4, 8).t()) == (start, start + 128)
    assert len(set(copies._bounds(buffer[5:5]))) == 1  # no bytes
    watch = copies.Watch(torch.device("cuda", 0))
    monkeypatch.setattr(copies, "_pinned", lambda value: True)
    watch.add("array", buffer.numpy()[3:7])  # an array: through torch
    watch.add("flipped", np.flip(buffer.numpy()))  # torch cannot read it
    assert watch.ranges == [(start + 12, start + 28)], watch.ranges
    assert watch.unfollowed and watch.unfollowed.startswith("flipped"), watch.unfollowed


def _on_a_gpu(monkeypatch):  # noqa: ANN001, ANN202
    """``save`` as on a GPU with pinned host values (the watch and pinning
    asked of fakes), the wait recorded; what the guard decides is its own."""
    waits: list = []
    device = torch.device("cuda", 0)
    monkeypatch.setattr(copies, "watch", lambda d: copies.Watch(device))
    monkeypatch.setattr(copies, "_pinned", lambda value: True)
    fake_cuda(monkeypatch)
    monkeypatch.setattr(copies, "wait", lambda w: waits.append(w))
    shared = harness.shared_metadata(harness.Batch(4))
    shared.query_start_loc = on_device(shared.query_start_loc)
    return shared, waits


def test_a_capture_that_queues_no_copy_there_waits_for_nothing(monkeypatch):
    """vLLM's ROCm captures at serving time: host writes and device work, no
    copy on the saved memory: the guard follows, and has nothing to wait for."""
    shared, waits = _on_a_gpu(monkeypatch)

    def capture(metadata):  # noqa: ANN001, ANN202
        metadata.query_start_loc.fill_(0)  # the device offsets (#25985)
        metadata.query_start_loc_cpu.fill_(0)  # 0.27/0.28's host write

    guarded_call.run(capture, "NoCopy", shared)
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()
    (watch,) = waits
    assert watch.ranges and not watch.events and watch.unfollowed is None


def test_a_copy_there_is_waited_for_and_the_host_kept(monkeypatch):
    shared, waits = _on_a_gpu(monkeypatch)

    def capture(metadata):  # noqa: ANN001, ANN202
        metadata.query_start_loc_cpu.zero_()
        metadata.query_start_loc.copy_(metadata.query_start_loc_cpu, True)

    guarded_call.run(capture, "CopiesThere", shared)
    (watch,) = waits
    assert list(watch.events) == [_Stream("cuda:0").cuda_stream], watch.events
    assert watch.unfollowed is None
    assert shared.query_start_loc.tolist() == [0] * 5  # what it copied, zeros
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()


def test_a_device_tensor_over_the_saved_memory_waits_for_the_stream(
    monkeypatch, caplog
):
    """A device tensor in the metadata over the saved pinned memory (Model
    Runner V2's buffers on a GPU): a kernel reads it where it lies, unseen;
    the guard waits for the stream, and says so once per builder class."""
    shared, waits = _on_a_gpu(monkeypatch)
    shared.__dict__["query_start_loc_view"] = on_device(shared.query_start_loc_cpu)
    with caplog.at_level(logging.INFO, logger="vllm.capture_guard"):
        guarded_call.run(_zeroes, "HoldsAView", shared)
        guarded_call.run(_zeroes, "HoldsAView", shared)
    assert [w.unfollowed for w in waits] == [
        "query_start_loc_view, a device tensor over the saved memory"
    ] * 2
    said = [r.getMessage() for r in caplog.records if "cannot see" in r.getMessage()]
    assert len(said) == 1 and "HoldsAView's capture" in said[0], said
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()


def test_a_device_tensor_over_the_saved_memory_in_a_container_is_found(monkeypatch):
    """The same view held in a list of the metadata: the loop that saves the
    host values meets it there, so the guard waits for the stream as well."""
    shared, waits = _on_a_gpu(monkeypatch)
    shared.__dict__["views"] = [on_device(shared.query_start_loc_cpu)]
    guarded_call.run(_zeroes, "HoldsViews", shared)
    assert [w.unfollowed for w in waits] == [
        "views[0], a device tensor over the saved memory"
    ], waits
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()


def test_a_compiled_function_in_a_capture_is_not_taken_for_a_copy(followed):
    """Dynamo traces through the mode; what it traces runs later, unseen, and
    makes the guard neither follow nor wait (a compiled region's own copies
    are not seen: design.md says so)."""
    buffer, host, dev, watch, recorded = followed
    other = torch.arange(4)

    @torch.compile(fullgraph=True, backend="eager")
    def convert(x):  # noqa: ANN001, ANN202
        return x.to(torch.int32) + 1

    with copies.follow(watch):
        convert(other)
        convert(other)
    assert (recorded, watch.unfollowed) == ([], None), watch.unfollowed


def test_a_guard_inside_a_guarded_capture_is_unseen_by_the_outer_one(monkeypatch):
    """A capture that calls another builder's capture on other metadata over
    the same buffers: the inner guard's own work (its raw reads of the saved
    bytes) is not taken for the outer capture's, so neither waits."""
    shared, waits = _on_a_gpu(monkeypatch)
    other = copy.copy(shared)  # other metadata, the same runner buffers

    def outer(metadata):  # noqa: ANN001, ANN202
        guarded_call.run(_zeroes, "InnerOverTheSameBuffers", other)
        metadata.query_start_loc_cpu.zero_()

    guarded_call.run(outer, "OuterOverTheSameBuffers", shared)
    assert [(w.events, w.unfollowed) for w in waits] == [({}, None)] * 2, waits
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()


@pytest.mark.parametrize("backend", ["ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"])
@pytest.mark.parametrize("reqs", [1, 64], ids=["dummy-batch", "capture-size"])
def test_vllms_real_captures_queue_nothing_to_wait_for(
    backend, reqs, unpatched, monkeypatch
):
    """The serving path, decided by vLLM's own builders: each ROCm builder's
    capture, then MiniMax-M3's indexer's, on one shared metadata as the runner
    hands it (a shallow copy per group), guarded, with every host value taken
    for pinned and the device fields reporting a GPU: the guard follows every
    torch call they make, and none copies the saved bytes, hands them on as a
    raw pointer, or reaches them through a device tensor. So it waits for
    nothing (the GPU tier measures the same on an H200)."""
    from vllm.config import set_current_vllm_config

    from vllm_capture_guard.runtime.patches import PATCHES

    config = harness.make_vllm_config(0)
    try:  # imported, as vLLM imports it before capture
        harness.backend_class(backend)
    except Exception as e:  # 0.33's AITER module asks the GPU at import
        pytest.skip(f"{backend} unavailable here: {e}")
    for patch in PATCHES:
        patch.apply()
    builders = [
        harness.attention_builder(backend, config),
        harness.indexer_builder(config),
    ]
    waits: list = []
    monkeypatch.setattr(copies, "watch", lambda d: copies.Watch(d))
    monkeypatch.setattr(copies, "_pinned", lambda value: True)
    monkeypatch.setattr(copies, "wait", waits.append)
    fake_cuda(monkeypatch)
    buffers, batch = harness.RunnerBuffers(max_reqs=64), harness.Batch(reqs)
    buffers.fill(batch)
    shared = buffers.common_metadata(batch)
    shared.query_start_loc = on_device(shared.query_start_loc)
    for builder in builders:
        with set_current_vllm_config(builder.vllm_config):
            builder.build_for_cudagraph_capture(copy.copy(shared))
    assert len(waits) == 2, waits  # both captures guarded and followed
    assert [(w.events, w.unfollowed) for w in waits] == [({}, None)] * 2
    assert all(w.ranges for w in waits)
    assert shared.query_start_loc_cpu.tolist() == batch.offsets()


def test_a_mode_that_fails_to_enter_is_never_exited(monkeypatch, caplog):
    """Following the copies fails as it starts: the capture runs, the guard
    waits for the stream instead, and the torch-function modes of whoever
    called stay as they were (none popped)."""
    shared = harness.shared_metadata(harness.Batch(4))
    order = _waiting(monkeypatch, lambda device, order: order.append(device))

    class FailsToEnter(torch.overrides.TorchFunctionMode):
        def __enter__(self):  # noqa: ANN204
            raise RuntimeError("cannot follow here")

    class Caller(torch.overrides.TorchFunctionMode):  # vLLM's, or another's
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(copies, "follow", lambda watch: FailsToEnter())
    depth = torch._C._len_torch_function_stack()
    with Caller(), caplog.at_level(logging.INFO):
        inside = torch._C._len_torch_function_stack()
        assert guarded_call.run(_zeroes, "FailsToEnter", shared) == "built"
        assert torch._C._len_torch_function_stack() == inside
    assert torch._C._len_torch_function_stack() == depth
    assert order == ["cuda:0"]  # it waited for the stream
    assert shared.query_start_loc_cpu.tolist() == harness.Batch(4).offsets()
    assert not any("could not stop following" in r.getMessage() for r in caplog.records)
