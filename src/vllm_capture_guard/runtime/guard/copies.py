# SPDX-License-Identifier: Apache-2.0
"""The copies and the wait. On a CUDA or HIP device a capture may move values
between the saved pinned host memory and the device with ``non_blocking=True``
copies, which the copy engine runs after the capture returns; the guard tells
and puts back only once they are done, and waits for nothing else.

While the capture runs, a ``TorchFunctionMode`` (this thread's only) looks at
each copy function (``Tensor.copy_``, ``.to``, ``.cuda``, aten's copies) called
with ``non_blocking`` whose source or destination overlaps the bytes of a saved
pinned host value, and records an event right after it on the stream it was
queued on. After the capture the guard waits on those events alone. Where it
cannot see the copies (a custom op or a raw pointer given that memory, a device
tensor over it), it waits for the metadata's current stream, as before."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

from vllm_capture_guard.runtime.base import say, short

CAPTURING = "inside a stream capture"  # save()'s watch: nothing has run yet
EXCHANGE = "ThreadExchangeStreamCaptureMode"  # of the CUDA driver, or HIP
COPY, RAW = "a copy", "a raw pointer"
ATEN_COPIES = frozenset({"copy_", "_to_copy", "to", "copy", "_copy_from"})
ATEN = frozenset({"aten", "prims", "prim"})
_PINNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage: pinned


class Watch:
    """One capture's saved pinned host memory (byte ranges) and what it queued
    there: the latest event per stream, and why it waits for the stream
    (``blind``) where it could not see the copies."""

    def __init__(self, device: Any) -> None:
        self.device, self.ranges, self.events = device, [], {}
        self.blind: str | None = None

    def hits(self, value: Any) -> bool:
        lo, hi = _bounds(value)
        return any(lo < top and bottom < hi for bottom, top in self.ranges)


def watch(device: Any) -> Any:
    """What to follow for a capture on ``device``: a :class:`Watch` on a CUDA
    or HIP device, :data:`CAPTURING` inside an active stream capture, None
    elsewhere (or before CUDA/HIP is initialised)."""
    torch = sys.modules["torch"]
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    return CAPTURING if torch.cuda.is_current_stream_capturing() else Watch(device)


def add(watch: Any, name: str, value: Any) -> None:
    """Note a saved host value's bytes where it is pinned."""
    if type(watch) is Watch and _pinned(value):
        try:
            watch.ranges.append(_bounds(value))
        except Exception as e:  # cannot tell what overlaps it: wait for the stream
            watch.blind = watch.blind or f"{name} ({short(e)})"


def settled(watch: Any, devices: list) -> Any:
    """The watch for the capture, once every value is saved: None where no
    pinned host value was saved (nothing to follow)."""
    if type(watch) is not Watch:
        return watch
    for name, value in devices:  # read by kernels where it lies: unseen copies
        with contextlib.suppress(Exception):
            if watch.ranges and watch.hits(value):
                watch.blind = f"{name}, a device tensor over shared pinned host memory"
    return watch if watch.ranges or watch.blind else None


def _pinned(value: Any) -> bool:
    """Is this host tensor's or array's memory pinned? Yes where torch cannot
    tell. Asked once per storage (a storage keeps its allocator for life)."""
    torch = sys.modules["torch"]
    try:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if (known := _PINNED.get(storage)) is None:
                known = _PINNED[storage] = value.is_pinned()
            return known
        return not value.flags.writeable or torch.from_numpy(value).is_pinned()
    except Exception:
        return True


def _bounds(value: Any) -> tuple[int, int]:
    """The bytes a tensor or an array spans: ``(first, past the last)``."""
    if hasattr(value, "data_ptr"):
        ptr = value.data_ptr()
        if value.is_contiguous():
            return ptr, ptr + value.nbytes
        size = value.element_size()
        strides = [s * size for s in value.stride()]
    else:  # numpy: strides in bytes
        ptr, strides, size = value.ctypes.data, value.strides, value.itemsize
    lo = hi = 0
    for n, stride in zip(value.shape, strides, strict=True):
        if n == 0:
            return ptr, ptr
        lo, hi = lo + min(0, (n - 1) * stride), hi + max(0, (n - 1) * stride)
    return ptr + lo, ptr + hi + size


def follow(watch: Any) -> Any:
    """The mode that follows the copies for ``watch``, or None."""
    return _mode()(watch) if type(watch) is Watch else None


@functools.cache
def _mode() -> type:
    torch = sys.modules["torch"]
    tensor, ops = torch.Tensor, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    kinds = {tensor.copy_: COPY, tensor.to: COPY, tensor.cuda: COPY}
    kinds.update(dict.fromkeys((tensor.data_ptr, tensor.untyped_storage), RAW))
    kinds[tensor.__dlpack__] = RAW

    class Follow(torch.overrides.TorchFunctionMode):
        def __init__(self, watch: Watch) -> None:
            super().__init__()
            self.watch = watch

        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            try:
                kind = kinds.get(func) or (_op_kind(func) if type(func) in ops else 0)
            except TypeError:  # not hashable: no copy function of torch's
                kind = 0
            if not kind:
                return func(*args, **kwargs)
            result = None
            try:
                result = func(*args, **kwargs)
                return result
            finally:
                _look(self.watch, kind, func, args, kwargs, result)

    return Follow


def _op_kind(op: Any) -> str | int:
    """An aten copy, a custom op (which may copy from what it is given), or 0."""
    space, _, name = getattr(op, "_qualified_op_name", "").partition("::")
    if not name:
        space, name = op.namespace, op._opname
    return RAW if space not in ATEN else COPY if name in ATEN_COPIES else 0


def _non_blocking(args: tuple, kwargs: dict) -> bool:
    """A copy call's ``non_blocking``: its keyword, else its first bool argument."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return next((a for a in args[1:] if type(a) is bool), False)


def _look(watch: Watch, kind: str, func: Any, args: tuple, kwargs: dict, out: Any):  # noqa: ANN202
    """After one call: record an event where it queued a copy that touches the
    saved pinned memory; where it handed that memory on unseen, note why."""
    try:
        if kind is COPY and not _non_blocking(args, kwargs):
            return  # a blocking copy is done when it returns
        tensor = sys.modules["torch"].Tensor
        found = [a for a in (*args, *kwargs.values(), out) if isinstance(a, tensor)]
        if not any(map(watch.hits, found)):
            return
        if kind is RAW:
            watch.blind = watch.blind or f"{kind}, through {func.__name__}"
            return
        device = next((t.device for t in found if t.device.type == "cuda"), None)
        if device is not None:
            _record(watch, device)
    except Exception as e:  # the guard's own: wait for the stream instead
        watch.blind = watch.blind or f"a call it could not follow ({short(e)})"


def _record(watch: Watch, device: Any) -> None:
    torch = sys.modules["torch"]
    if torch.cuda.is_current_stream_capturing():
        return  # a copy recorded into a graph runs at replay, not now
    stream = torch.cuda.current_stream(device)
    with relaxed():
        event = torch.cuda.Event()
        event.record(stream)
    watch.events[stream.cuda_stream] = event  # the latest covers the earlier


def wait(watch: Watch) -> None:
    """Until the copies ``watch`` followed are done, each on its own stream,
    and, where it could not see them, the metadata's current stream; relaxed
    meanwhile, so no graph capture elsewhere is invalidated. Never the device."""
    events = list(watch.events.values())
    if not (events or watch.blind):
        return  # no copy it queued touches the saved memory: nothing to wait for
    torch = sys.modules["torch"]
    with relaxed():
        if watch.blind:
            events.append(torch.cuda.Event())
            events[-1].record(torch.cuda.current_stream(watch.device.index))
        for event in events:
            event.synchronize()


@contextlib.contextmanager
def relaxed() -> Iterator[None]:
    """This thread's stream-capture mode relaxed, and given back after."""
    exchange, mode = _exchange(), ctypes.c_int(2)  # 2: the relaxed mode
    done = exchange(ctypes.byref(mode)) == 0
    try:
        yield
    finally:
        if done:  # back to the mode this thread had
            exchange(ctypes.byref(mode))


@functools.cache
def _exchange() -> Any:
    """The capture-mode exchange of the CUDA driver or HIP torch loaded, or a no-op."""
    hip = sys.modules["torch"].version.hip
    lib = f"libamdhip64.so.{hip.split('.')[0]}" if hip else "libcuda.so.1"
    try:
        found = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD)
        found = getattr(found, ("hip" if hip else "cu") + EXCHANGE)
        found.argtypes, found.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        return found
    except (OSError, AttributeError) as e:
        say(
            f"{lib} has no {EXCHANGE} ({short(e)}): a graph captured in another "
            "thread while the guard waits would be invalidated",
            True,
        )
        return lambda mode: 1
