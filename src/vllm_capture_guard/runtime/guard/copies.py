# SPDX-License-Identifier: Apache-2.0
"""The copies and the wait. While a capture runs, a ``TorchFunctionMode`` records
an event after each copy from or into the saved pinned bytes, on its stream; the
guard waits on those events alone. Where it cannot see the copies (a raw pointer,
a custom op, a device tensor over those bytes), it waits for the stream."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

from vllm_capture_guard.runtime.logs import short_error, warn_once

#: ``watch()`` inside an active stream capture: nothing has run yet.
CAPTURING = "inside a stream capture"
#: What a torch call may do with the saved bytes.
COPY = "a copy"  # queues a copy: record an event after it
RAW = "a raw pointer"  # hands them on unseen: wait for the stream
NOT_A_COPY = ""
ATEN_COPIES = frozenset({"copy_", "_to_copy", "to", "copy", "_copy_from"})
#: cudaStreamCaptureModeRelaxed and hipStreamCaptureModeRelaxed: waiting on an
#: event in this mode invalidates no graph that another thread captures.
RELAXED_CAPTURE_MODE = 2
EXCHANGE = "ThreadExchangeStreamCaptureMode"  # cu... of the CUDA driver, hip... of HIP


class Watch:
    """A capture's saved pinned bytes, the latest event of each stream a copy of
    them was queued on, and why it must wait for the stream instead, if so."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.ranges: list[tuple[int, int]] = []  # (first byte, past the last)
        self.events: dict[int, Any] = {}  # stream handle -> its latest event
        self.unfollowed: str | None = None

    def hits(self, value: Any) -> bool:
        lo, hi = _bounds(value)
        return any(lo < top and bottom < hi for bottom, top in self.ranges)

    def add(self, name: str, value: Any, bounds: tuple | None = None) -> None:
        """Note a saved host value's bytes (``bounds``, if known) where pinned."""
        try:
            torch = sys.modules["torch"]
            if not isinstance(value, torch.Tensor):  # an array: asked through torch
                if not value.flags.writeable:
                    raise ValueError("a read-only array")
                value = torch.from_numpy(value)
            if _pinned(value):
                self.ranges.append(bounds or _bounds(value))
        except Exception as e:  # cannot tell what overlaps it: wait for the stream
            self.unfollowed = self.unfollowed or f"{name} ({short_error(e)})"

    def settled(self, device_fields: list[tuple[str, Any]]) -> Watch | None:
        """Itself, once the ``(name, device tensor)`` fields are checked; None if
        nothing saved is pinned (no copy can read or write it later)."""
        try:  # a device tensor over the saved bytes: kernels read it there, unseen
            for name, value in device_fields if self.ranges else ():
                if value.is_cuda and self.hits(value):
                    self.unfollowed = f"{name}, a device tensor over the saved memory"
        except Exception as e:  # cannot tell: wait for the stream
            self.unfollowed = self.unfollowed or f"a device field ({short_error(e)})"
        return self if self.ranges or self.unfollowed else None


def watch(device: Any) -> Watch | str | None:
    """A :class:`Watch` on a CUDA or HIP device; :data:`CAPTURING` inside a
    stream capture; None elsewhere, or before CUDA/HIP is initialised."""
    torch = sys.modules["torch"]
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    return CAPTURING if torch.cuda.is_current_stream_capturing() else Watch(device)


def _pinned(value: Any) -> bool:  # torch asks the driver: under a microsecond
    return value.is_pinned()


def _bounds(value: Any) -> tuple[int, int]:
    """The bytes it lies in, ``(first, past the last)``: the whole storage where
    it is not one dense block."""
    if value.is_contiguous():
        first = value.data_ptr()
        return first, first + value.nbytes
    storage = value.untyped_storage()
    first = storage.data_ptr()
    return first, first + storage.nbytes()


def follow(watch: Any) -> Any:
    """The mode that follows the copies for ``watch``, or None."""
    return _mode()(watch) if type(watch) is Watch else None


@functools.cache
def _mode() -> type:
    torch = sys.modules["torch"]
    tensor, ops = torch.Tensor, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    kinds = dict.fromkeys((tensor.copy_, tensor.to, tensor.cuda, tensor.type), COPY)
    kinds[torch._foreach_copy_] = COPY
    raw = (tensor.data_ptr, tensor.untyped_storage, tensor.storage, tensor.__dlpack__)
    kinds.update(dict.fromkeys(raw, RAW))
    compiling = torch.compiler.is_compiling

    class FollowCopies(torch.overrides.TorchFunctionMode):  # on every torch call
        def __init__(self, watch: Watch) -> None:
            self.watch = watch

        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if compiling():  # traced: it runs later, unseen
                return func(*args, **(kwargs or {}))
            try:
                kind = kinds.get(func) or (
                    _op_kind(func) if type(func) in ops else NOT_A_COPY
                )
            except TypeError:  # not hashable: no copy function of torch's
                kind = NOT_A_COPY
            result = func(*args, **kwargs) if kwargs else func(*args)
            if kind:  # after the call, as the copy it queued
                _note_copy(self.watch, kind, func, args, kwargs or {}, result)
            return result

    return FollowCopies


def _op_kind(op: Any) -> str:
    """An aten copy, another aten operator, or a custom one (it may copy unseen)."""
    namespace, _, name = str(op).partition(".")  # aten.copy_(.default)
    if namespace not in ("aten", "prims", "prim"):
        return RAW
    if name.split(".")[0] in ATEN_COPIES:
        return COPY
    return NOT_A_COPY


def _note_copy(watch: Watch, kind: str, func: Any, args: tuple, kwargs: dict, out: Any):  # noqa: ANN202
    """After a call: an event where it queued a copy of the saved bytes; where
    it handed them on unseen, why the guard must wait for the stream."""
    torch = sys.modules["torch"]
    try:
        with torch._C.DisableTorchFunction():  # unseen by another guard's mode
            values = [*args, *kwargs.values(), out]
            values += [v for a in values if isinstance(a, list | tuple) for v in a]
            found = [a for a in values if isinstance(a, torch.Tensor)]
            if not any(map(watch.hits, found)):
                return
            device = next((t.device for t in found if t.is_cuda), None)
            if kind is RAW:
                watch.unfollowed = (
                    watch.unfollowed or f"{kind}, through {func.__name__}"
                )
            elif device and not torch.cuda.is_current_stream_capturing():  # no graph's
                stream = torch.cuda.current_stream(device)
                with relaxed():  # the latest event of a stream covers the rest
                    watch.events[stream.cuda_stream] = stream.record_event()
    except Exception as e:  # the guard's own: wait for the stream instead
        why = f"a call it could not follow ({short_error(e)})"
        watch.unfollowed = watch.unfollowed or why


def wait(watch: Watch) -> None:
    """Until the copies followed are done, each on its stream (or, where some
    could not be followed, the metadata's current stream), in relaxed mode."""
    events = list(watch.events.values())
    if not events and not watch.unfollowed:
        return  # no copy of the saved bytes: nothing to wait for
    torch = sys.modules["torch"]
    with relaxed():
        if watch.unfollowed:
            stream = torch.cuda.current_stream(watch.device.index)
            events.append(stream.record_event())
        for event in events:
            event.synchronize()


@contextlib.contextmanager
def relaxed() -> Iterator[None]:
    """This thread's stream-capture mode relaxed, and given back after."""
    exchange, mode = _exchange(), ctypes.c_int(RELAXED_CAPTURE_MODE)
    exchanged = exchange(ctypes.byref(mode)) == 0  # mode now holds the old one
    try:
        yield
    finally:
        if exchanged:  # back to the mode this thread had
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
        why = f"{lib} has no {EXCHANGE} ({short_error(e)})"
        warn_once(f"{why}: a graph captured in another thread while it waits is lost")
        return lambda mode: 1
