# SPDX-License-Identifier: Apache-2.0
"""The copies and the wait: while a capture runs, a ``TorchFunctionMode`` records
an event after each copy from or into the saved pinned bytes, on its stream; the
guard waits on those alone. Where it cannot see the copies (a raw pointer or
custom op, a device tensor over them) it waits for the metadata's stream."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

from vllm_capture_guard.runtime.base import say, short

CAPTURING = "inside a stream capture"  # save()'s watch: nothing has run yet
EXCHANGE = "ThreadExchangeStreamCaptureMode"  # of the CUDA driver, or HIP
COPY, RAW = "a copy", "a raw pointer"
ATEN_COPIES = frozenset({"copy_", "_to_copy", "to", "copy", "_copy_from"})


class Watch:
    """A capture's saved pinned bytes, the latest event of each stream a copy of
    them was queued on, and why it must wait for the stream instead, if so."""

    def __init__(self, device: Any) -> None:
        self.device, self.ranges, self.events, self.blind = device, [], {}, None

    def hits(self, value: Any) -> bool:
        lo, hi = _bounds(value)
        return any(lo < top and bottom < hi for bottom, top in self.ranges)

    def add(self, name: str, value: Any, bounds: tuple | None = None) -> None:
        """Note a saved host value's bytes (``bounds``, if known) where pinned."""
        try:
            if not isinstance(value, sys.modules["torch"].Tensor):  # through torch
                if not value.flags.writeable:
                    raise ValueError("a read-only array")
                value = sys.modules["torch"].from_numpy(value)
            if _pinned(value):
                self.ranges.append(bounds or _bounds(value))
        except Exception as e:  # cannot tell what overlaps it: wait for the stream
            self.blind = self.blind or f"{name} ({short(e)})"

    def settled(self, devices: list) -> Watch | None:
        """Self, its ``(name, device tensor)`` checked; None if nothing pinned."""
        try:  # a device tensor over the saved bytes: kernels read it there, unseen
            for name, value in devices if self.ranges else ():
                if value.is_cuda and self.hits(value):
                    self.blind = f"{name}, a device tensor over the saved memory"
        except Exception as e:  # cannot tell: wait for the stream
            self.blind = self.blind or f"a device field ({short(e)})"
        return self if self.ranges or self.blind else None


def watch(device: Any) -> Any:
    """A :class:`Watch` on a CUDA or HIP device, :data:`CAPTURING` inside a stream
    capture, None elsewhere (or before CUDA/HIP is initialised)."""
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
        return (ptr := value.data_ptr()), ptr + value.nbytes
    storage = value.untyped_storage()
    return (ptr := storage.data_ptr()), ptr + storage.nbytes()


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

    class Follow(torch.overrides.TorchFunctionMode):  # on every torch call: lean
        def __init__(self, watch: Watch) -> None:
            self.watch = watch

        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if compiling():  # traced: it runs later, unseen
                return func(*args, **(kwargs or {}))
            try:
                kind = kinds.get(func) or (_op_kind(func) if type(func) in ops else 0)
            except TypeError:  # not hashable: no copy function of torch's
                kind = 0
            result = func(*args, **kwargs) if kwargs else func(*args)
            if kind:  # after the call, as the copy it queued
                _look(self.watch, kind, func, args, kwargs or {}, result)
            return result

    return Follow


def _op_kind(op: Any) -> str | int:
    """An aten copy, a custom op (it may copy from what it is given), or 0."""
    space, _, name = str(op).partition(".")  # aten.copy_(.default)
    ours = space in ("aten", "prims", "prim")
    return (COPY if name.split(".")[0] in ATEN_COPIES else 0) if ours else RAW


def _look(watch: Watch, kind: str, func: Any, args: tuple, kwargs: dict, out: Any):  # noqa: ANN202
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
                watch.blind = watch.blind or f"{kind}, through {func.__name__}"
            elif device and not torch.cuda.is_current_stream_capturing():  # no graph's
                stream = torch.cuda.current_stream(device)
                with relaxed():  # the latest event of a stream covers the rest
                    watch.events[stream.cuda_stream] = stream.record_event()
    except Exception as e:  # the guard's own: wait for the stream instead
        watch.blind = watch.blind or f"a call it could not follow ({short(e)})"


def wait(watch: Watch) -> None:
    """Until the copies followed are done, each on its stream (and, where the
    guard could not see them, the metadata's current stream): never the device,
    and relaxed, so no graph capture elsewhere is invalidated."""
    events = list(watch.events.values())
    if not (events or watch.blind):
        return  # no copy of the saved bytes: nothing to wait for
    torch = sys.modules["torch"]
    with relaxed():
        if watch.blind:
            events.append(torch.cuda.current_stream(watch.device.index).record_event())
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
        why = f"{lib} has no {EXCHANGE} ({short(e)})"
        say(f"{why}: a graph captured in another thread while it waits is lost", True)
        return lambda mode: 1
