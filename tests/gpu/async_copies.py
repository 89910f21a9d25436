# SPDX-License-Identifier: Apache-2.0
"""The guard on a real accelerator's asynchronous copies: the cases that the
GPU tier (``tests/gpu/test_pinned_async_copies.py``, CUDA) and the ROCm tier
(``tests/rocm/test_async_copies.py``, MI-series GPUs) both run.

The shared metadata is what the runner hands every builder: views of
persistent buffers, the device offsets on the GPU and the host offsets in
pinned memory (``RunnerBuffers``, as vLLM's ``CpuGpuBuffer``). Each case's
builder is a class derived from vLLM's ``AttentionMetadataBuilder`` with a
``build_for_cudagraph_capture`` of its own, made while the guard is loaded,
so the guard watches it as it watches a vendor's. Its capture moves the
offsets between host and device behind a busy stream (``torch.cuda._sleep``):
with ``non_blocking=True`` copies (``copy_``, ``.to``), on the current stream
or a side stream, through a Triton kernel given the pinned host tensor, or
through a device tensor over the pinned memory. The copy engine or the
kernel reads or writes the pinned memory well after the capture returns, so
the unguarded order is deterministic, and a guard that compares or puts back
before the copy has run gets it wrong.

Each case runs unguarded (vLLM's call of that capture, the guard's wrapper
taken off) and guarded, on fresh buffers, and returns what the device and
host offsets hold once the GPU is done, and the guard's log lines.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

METHOD = "build_for_cudagraph_capture"
REQS = 8
#: A busy kernel ahead of each copy: 50M cycles, about 25 ms at 2 GHz, far
#: longer than the guard takes to put back after the capture returns.
CYCLES = 50_000_000


@dataclasses.dataclass
class Outcome:
    device: list[int]  # the device offsets once the GPU is done
    host: list[int]  # the host offsets then
    log: list[str]  # the guard's lines for this builder class


def offsets() -> list[int]:
    from vllm_capture_guard.tools import harness as sc

    return sc.Batch(REQS).offsets()


ZEROS = [0] * (REQS + 1)


def _shared(view: bool = False) -> tuple[Any, Any]:
    """Runner buffers (device on the GPU, host pinned) holding a batch, and
    one metadata of views of them; with ``view``, also a device tensor over
    the pinned host offsets (``query_start_loc_view``)."""
    from vllm_capture_guard.tools import harness as sc

    buffers = sc.RunnerBuffers(max_reqs=REQS, device="cuda")
    assert buffers.query_start_loc_cpu.is_pinned()  # as the runner's are
    batch = sc.Batch(REQS)
    buffers.fill(batch)
    torch.cuda.synchronize()
    shared = buffers.common_metadata(batch)
    if view:
        shared.__dict__["query_start_loc_view"] = _device_view(
            shared.query_start_loc_cpu
        )
    return buffers, shared


@contextlib.contextmanager
def _lines(owner: str) -> Iterator[list[str]]:
    """The guard's log lines that name ``owner``, as they are said."""
    found: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if f"{owner}'s capture" in message:
                found.append(f"{record.levelname} {message}")

    handler = Handler(logging.INFO)
    log = logging.getLogger("vllm.capture_guard")
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield found
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


@contextlib.contextmanager
def guard_loaded() -> Iterator[None]:
    """The guard as vLLM loads it (its plugin loader, ``VLLM_CAPTURE_GUARD=on``),
    applied to vLLM's attention base and runner utilities; undone after."""
    import os

    from vllm_capture_guard.tools.revert import revert

    old = os.environ.get("VLLM_CAPTURE_GUARD")
    os.environ["VLLM_CAPTURE_GUARD"] = "on"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.v1.attention.backend  # noqa: F401
    import vllm.v1.worker.utils  # noqa: F401

    from vllm_capture_guard.runtime.patches import PATCHES

    for patch in PATCHES:  # another module of the session may have undone them
        patch.apply()
    try:
        yield
    finally:
        for patch in reversed(PATCHES):
            revert(patch)
        if old is None:
            os.environ.pop("VLLM_CAPTURE_GUARD", None)
        else:
            os.environ["VLLM_CAPTURE_GUARD"] = old


def builder(name: str, capture: Callable[[Any, Any], Any]) -> Any:
    """One instance of a new builder class ``name`` whose capture is
    ``capture(self, common_attn_metadata)``, derived from vLLM's base."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    def __init__(self) -> None:  # no spec or config: the capture needs none
        pass

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):  # noqa: ANN001, ANN202
        return None

    namespace = {"__init__": __init__, "build": build, METHOD: capture}
    namespace["__module__"] = __name__
    return type(name, (AttentionMetadataBuilder,), namespace)()


def run(
    made: Any, guarded: bool, inside_graph: bool = False, view: bool = False
) -> tuple[Outcome, Any]:
    """``made``'s capture on a fresh shared metadata (a per-group shallow
    copy, as the runner gives it), guarded or not; with ``inside_graph``,
    inside an active CUDA graph capture, whose graph is returned; ``view``:
    see :func:`_shared`."""
    from vllm_capture_guard.runtime.patching import is_guarded, original_of

    own = type(made).__dict__[METHOD]
    assert is_guarded(own), "the guard does not watch this builder class"
    call = (lambda cm: made.build_for_cudagraph_capture(cm)) if guarded else (
        lambda cm: original_of(own)(made, cm)
    )  # fmt: skip
    buffers, shared = _shared(view)
    graph = None
    with _lines(type(made).__name__) as log:
        if inside_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(copy.copy(shared))
        else:
            call(copy.copy(shared))
        torch.cuda.synchronize()
    return _read(shared, log), (graph, buffers, shared)


def _read(shared: Any, log: list[str]) -> Outcome:
    return Outcome(
        shared.query_start_loc.tolist(), shared.query_start_loc_cpu.tolist(), log
    )


def _pair(off: Outcome, on: Outcome) -> dict:
    return {"unguarded": dataclasses.asdict(off), "guarded": dataclasses.asdict(on)}


def _zeros_to_host(cm: Any) -> None:
    """A copy of device zeros into the pinned host offsets."""
    zeros = torch.zeros_like(cm.query_start_loc)
    cm.query_start_loc_cpu.copy_(zeros, non_blocking=True)


# --- the captures ------------------------------------------------------------


def host_to_device(self, cm):  # noqa: ANN001, ANN201
    """Zero the host offsets, then copy them to the device (as a builder's
    ``build`` moves host values to the device), behind a busy stream."""
    torch.cuda._sleep(CYCLES)
    cm.query_start_loc_cpu.zero_()
    cm.query_start_loc.copy_(cm.query_start_loc_cpu, non_blocking=True)


def device_to_host(self, cm):  # noqa: ANN001, ANN201
    """Copy device zeros into the pinned host offsets, behind a busy stream."""
    torch.cuda._sleep(CYCLES)
    _zeros_to_host(cm)


def _on_side_stream(work: Callable[[Any], None], join: bool):  # noqa: ANN202
    def capture(self, cm):  # noqa: ANN001, ANN202
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            work(cm)
        if join:  # the current stream waits for the side stream's work
            torch.cuda.current_stream().wait_stream(side)

    return capture


def _h2d_work(cm) -> None:  # noqa: ANN001
    cm.query_start_loc_cpu.zero_()
    torch.cuda._sleep(CYCLES)
    cm.query_start_loc.copy_(cm.query_start_loc_cpu, non_blocking=True)


def _d2h_work(cm) -> None:  # noqa: ANN001
    torch.cuda._sleep(CYCLES)
    _zeros_to_host(cm)


side_h2d_joined = _on_side_stream(_h2d_work, join=True)
side_h2d = _on_side_stream(_h2d_work, join=False)
side_d2h = _on_side_stream(_d2h_work, join=False)


def captured_h2d(self, cm):  # noqa: ANN001, ANN201
    """Inside a graph capture: zero the host offsets (a host write, done at
    once) and copy them to the device (a graph node, run at replay)."""
    cm.query_start_loc_cpu.zero_()
    cm.query_start_loc.copy_(cm.query_start_loc_cpu, non_blocking=True)


def captured_copy_only(self, cm):  # noqa: ANN001, ANN201
    """The same copy with no host write: what 0.29.0's capture amounts to."""
    cm.query_start_loc.copy_(cm.query_start_loc_cpu, non_blocking=True)


def captured_d2h(self, cm):  # noqa: ANN001, ANN201
    """Inside a graph capture: a copy of device zeros into the host offsets,
    which writes host memory at every replay."""
    _zeros_to_host(cm)


def to_device(self, cm):  # noqa: ANN001, ANN201
    """Zero the host offsets, move them with ``.to(device, non_blocking=True)``
    behind a busy stream, then copy the result into the device offsets."""
    torch.cuda._sleep(CYCLES)
    cm.query_start_loc_cpu.zero_()
    moved = cm.query_start_loc_cpu.to(cm.query_start_loc.device, non_blocking=True)
    cm.query_start_loc.copy_(moved)


class _Unavailable(Exception):
    """What a case needs is not on this host."""


_KERNEL: list = []


def _copy_kernel() -> Any:
    """A Triton kernel that copies ``n`` int32 values from ``src`` to ``dst``."""
    if not _KERNEL:
        try:
            import triton
            import triton.language as tl
        except ImportError as e:
            raise _Unavailable(f"no Triton: {e}") from e

        @triton.jit
        def copy_values(src, dst, n, block: tl.constexpr):
            offs = tl.arange(0, block)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

        _KERNEL.append(copy_values)
    return _KERNEL[0]


def by_kernel(self, cm):  # noqa: ANN001, ANN201
    """Zero the host offsets, then have a Triton kernel, behind a busy stream,
    read them by address into the device offsets."""
    kernel, n = _copy_kernel(), cm.query_start_loc.numel()
    torch.cuda._sleep(CYCLES)
    cm.query_start_loc_cpu.zero_()
    kernel[(1,)](cm.query_start_loc_cpu, cm.query_start_loc, n, block=32)


def _device_view(host: Any) -> Any:
    """A CUDA tensor over ``host``'s pinned memory (through CuPy, where the
    host has it), as Model Runner V2's buffers are on a GPU."""
    try:
        import cupy
    except ImportError as e:
        raise _Unavailable(f"no CuPy: {e}") from e
    memory = cupy.cuda.UnownedMemory(host.data_ptr(), host.nbytes, owner=host)
    array = cupy.ndarray(
        tuple(host.shape), cupy.int32, cupy.cuda.MemoryPointer(memory, 0)
    )
    view = torch.as_tensor(array, device="cuda")
    assert view.data_ptr() == host.data_ptr(), "not a view of the pinned memory"
    return view


def by_view(self, cm):  # noqa: ANN001, ANN201
    """Zero the host offsets, then, behind a busy stream, a kernel reads them
    through the device view the metadata holds into the device offsets."""
    view = cm.query_start_loc_view
    torch.cuda._sleep(CYCLES)
    cm.query_start_loc_cpu.zero_()
    torch.mul(view, 1, out=cm.query_start_loc)


def replay(graph: Any, shared: Any) -> Outcome:
    """Replay ``graph`` once and read the offsets back."""
    graph.replay()
    torch.cuda.synchronize()
    return _read(shared, [])


# --- what the tests assert ----------------------------------------------------


def wrote(owner: str) -> str:
    return (
        f"INFO vllm-capture-guard: {owner}'s capture wrote query_start_loc_cpu "
        f"(size {REQS}); kept from the other builders (backport of PR #51585)"
    )


def wrote_nothing(owner: str) -> str:
    return (
        f"INFO vllm-capture-guard: {owner}'s capture, watched: it wrote no shared "
        f"host value (size {REQS})"
    )


def check_host_to_device(results: dict) -> None:
    """The device receives what it receives without the guard (the zeros the
    capture wrote), the host offsets are kept, the log names the field."""
    made = builder("VendorHostToDevice", host_to_device)
    off, _ = run(made, guarded=False)
    assert (off.device, off.host) == (ZEROS, ZEROS), off
    on, _ = run(made, guarded=True)
    results["host_to_device"] = _pair(off, on)
    assert on.device == off.device, ("the device received other values", on)
    assert on.host == offsets(), on
    assert on.log == [wrote("VendorHostToDevice")], on.log


def check_device_to_host(results: dict) -> None:
    """The copy into the host offsets is seen, put back and named."""
    made = builder("VendorDeviceToHost", device_to_host)
    off, _ = run(made, guarded=False)
    assert (off.device, off.host) == (offsets(), ZEROS), off
    on, _ = run(made, guarded=True)
    results["device_to_host"] = _pair(off, on)
    assert on.device == off.device, on
    assert on.host == offsets(), ("the late device-to-host write was missed", on)
    assert on.log == [wrote("VendorDeviceToHost")], on.log


def check_side_streams(results: dict) -> None:
    """Copies on a side stream are followed on that stream: whether the
    capture joins it to the current stream before it returns or leaves it
    running, the device receives what it receives without the guard, and a
    copy into the host offsets that lands after the capture returned is seen,
    put back and named."""
    joined = builder("VendorSideStreamJoined", side_h2d_joined)
    off, _ = run(joined, guarded=False)
    on, _ = run(joined, guarded=True)
    assert (off.device, off.host) == (ZEROS, ZEROS), off
    assert on.device == off.device and on.host == offsets(), on
    assert on.log == [wrote("VendorSideStreamJoined")], on.log

    left = builder("VendorSideStreamLeftRunning", side_h2d)
    left_off, _ = run(left, guarded=False)
    left_on, _ = run(left, guarded=True)
    assert left_off.device == ZEROS, left_off
    assert left_on.device == ZEROS, ("its copy read other values", left_on)
    assert left_on.host == offsets(), left_on
    assert left_on.log == [wrote("VendorSideStreamLeftRunning")], left_on.log

    late = builder("VendorSideStreamLateWrite", side_d2h)
    late_off, _ = run(late, guarded=False)
    late_on, _ = run(late, guarded=True)
    assert late_off.host == ZEROS, late_off
    assert late_on.host == offsets(), ("its late write was missed", late_on)
    assert late_on.log == [wrote("VendorSideStreamLateWrite")], late_on.log
    results["side_streams"] = {
        "joined": _pair(off, on),
        "left_running_to_device": _pair(left_off, left_on),
        "left_running_to_host": _pair(late_off, late_on),
    }


def check_to_device(results: dict) -> None:
    """``.to(device, non_blocking=True)`` from the saved pinned host offsets
    (a new device tensor the capture then copies into the device offsets):
    the device receives the zeros the capture wrote, the host is kept."""
    made = builder("VendorToDevice", to_device)
    off, _ = run(made, guarded=False)
    assert (off.device, off.host) == (ZEROS, ZEROS), off
    on, _ = run(made, guarded=True)
    results["to_device"] = _pair(off, on)
    assert on.device == off.device, ("the .to() copy read other values", on)
    assert on.host == offsets(), on
    assert on.log == [wrote("VendorToDevice")], on.log


def check_unseen_copies(results: dict) -> None:
    """Where the guard cannot see the copies it waits for the stream, and is
    exact there too: a Triton kernel given the pinned host offsets (it reads
    them by address), and a device tensor over the pinned memory that the
    metadata holds (a kernel reads it where it lies). Each is named in one
    INFO line."""
    found = {}
    cases = (
        ("VendorKernelOnHost", by_kernel, False),
        ("VendorHostView", by_view, True),
    )
    for name, capture, view in cases:
        try:
            made = builder(name, capture)
            off, _ = run(made, guarded=False, view=view)
        except _Unavailable as e:
            found[name] = {"skipped": str(e)}
            continue
        assert (off.device, off.host) == (ZEROS, ZEROS), (name, off)
        on, _ = run(made, guarded=True, view=view)
        found[name] = _pair(off, on)
        assert on.device == off.device, (name, "the kernel read other values", on)
        assert on.host == offsets(), (name, on)
        assert len(on.log) == 2 and on.log[1] == wrote(name), on.log
        assert "cannot see every copy" in on.log[0], on.log
    results["unseen_copies"] = found
    assert "skipped" not in found.get("VendorKernelOnHost", {}), found


def check_inside_a_graph_capture(results: dict) -> None:
    """A capture run inside an active CUDA graph capture: nothing it queues
    runs before replay, so the guard does not wait (a synchronisation there
    would invalidate the graph), puts the host values back at once and says
    so in one WARNING. The graph is valid, and at replay its copy to the
    device reads the kept host values, as the same capture without the host
    write (0.29.0's shape) reads them; a copy it captured into the host
    offsets writes them at every replay."""
    made = builder("VendorInsideGraph", captured_h2d)
    off, (graph_off, _, shared_off) = run(made, guarded=False, inside_graph=True)
    assert (off.device, off.host) == (offsets(), ZEROS), off  # nothing ran yet
    replay_off = replay(graph_off, shared_off)
    assert replay_off.device == ZEROS, replay_off

    on, (graph_on, _, shared_on) = run(made, guarded=True, inside_graph=True)
    assert (on.device, on.host) == (offsets(), offsets()), on
    replay_on = replay(graph_on, shared_on)
    fixed = builder("VendorInsideGraphFixedShape", captured_copy_only)
    _, (graph_fixed, _, shared_fixed) = run(fixed, guarded=True, inside_graph=True)
    replay_fixed = replay(graph_fixed, shared_fixed)
    assert replay_on.device == replay_fixed.device == offsets(), (
        replay_on,
        replay_fixed,
    )
    assert replay_on.host == offsets(), replay_on
    assert len(on.log) == 2 and on.log[0].startswith("WARNING "), on.log
    assert "inside an active stream capture" in on.log[0], on.log
    assert on.log[1] == wrote("VendorInsideGraph"), on.log

    late = builder("VendorInsideGraphToHost", captured_d2h)
    late_on, (graph_late, _, shared_late) = run(late, guarded=True, inside_graph=True)
    assert late_on.host == offsets(), late_on  # nothing ran at capture
    assert "a copy it captured into host memory" in late_on.log[0], late_on.log
    replay_late = replay(graph_late, shared_late)
    assert replay_late.host == ZEROS, replay_late  # written at replay, as said
    results["inside_graph"] = {
        "unguarded_replay": dataclasses.asdict(replay_off),
        "guarded_replay": dataclasses.asdict(replay_on),
        "fixed_shape_replay": dataclasses.asdict(replay_fixed),
        "to_host_replay": dataclasses.asdict(replay_late),
        "warning": on.log[0],
    }


def check_beside_another_threads_capture(results: dict) -> None:
    """While another thread records a CUDA graph (torch's default
    ``capture_error_mode="global"``, as every vLLM capture), a synchronisation
    from this thread would invalidate that graph. The guard's wait runs with
    this thread's capture mode relaxed: the other graph stays valid and
    replays, and this capture is guarded exactly as on an idle GPU."""
    made = builder("VendorBesideACapture", captured_h2d)  # zero, then copy
    _, shared = _shared()  # allocated before the other capture begins
    x = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    started, done, errors = threading.Event(), threading.Event(), []

    def capture_elsewhere() -> None:
        try:
            with torch.cuda.graph(graph, stream=stream):
                x.add_(1)
                started.set()
                done.wait(60)
                x.add_(1)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            started.set()

    other = threading.Thread(target=capture_elsewhere)
    other.start()
    started.wait(60)
    try:
        with _lines("VendorBesideACapture") as log:
            made.build_for_cudagraph_capture(copy.copy(shared))
    finally:
        done.set()
        other.join()
    assert not errors, errors  # the other thread's graph was not invalidated
    torch.cuda.synchronize()
    on = _read(shared, log)
    graph.replay()
    torch.cuda.synchronize()
    results["beside_another_capture"] = {
        "guarded": dataclasses.asdict(on),
        "other_graph_replay": x.tolist(),
    }
    assert x.tolist() == [2.0] * 4, x
    assert (on.device, on.host) == (ZEROS, offsets()), on
    assert on.log == [wrote("VendorBesideACapture")], on.log


CHECKS = {
    "host_to_device": check_host_to_device,
    "device_to_host": check_device_to_host,
    "side_streams": check_side_streams,
    "to_device": check_to_device,
    "unseen_copies": check_unseen_copies,
    "inside_a_graph_capture": check_inside_a_graph_capture,
    "beside_another_threads_capture": check_beside_another_threads_capture,
}
