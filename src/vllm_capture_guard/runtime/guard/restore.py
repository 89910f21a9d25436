# SPDX-License-Identifier: Apache-2.0
"""Saving and restoring: a metadata's host values before its capture, and after
it each one that the capture changed in place, restored in place."""

from __future__ import annotations

import collections
import copy
import dataclasses
import sys
from ctypes import memmove, string_at
from typing import Any

from vllm_capture_guard.runtime.guard import copies
from vllm_capture_guard.runtime.guard.metadata import fields_of, is_host_field
from vllm_capture_guard.runtime.logs import short_error

PLAIN = frozenset({type(None), bool, int, float, str})  # nothing to change in place


@dataclasses.dataclass(slots=True)
class SavedValue:
    field: str  # the metadata's field, or a path into it: "extra['key']"
    value: Any  # the object itself, which a capture may change in place
    before: Any  # its bytes where ``address`` is set, else a copy of it
    address: int | None  # where its bytes lie; None where ``before`` is a copy


@dataclasses.dataclass(slots=True)
class Saved:
    values: list[SavedValue]
    unsaved: list[str]  # "field (why)" for each value that could not be saved
    watch: Any  # copies.Watch, copies.CAPTURING, or None: see copies.watch()
    num_actual_tokens: Any  # the batch's size, for the log lines


def save(metadata: Any) -> Saved:
    """The host values of ``metadata``, and the watch on their copies: every
    array and container, and each CPU tensor where the device offsets are on an
    accelerator, else those named as host values or held in a container."""
    fields, torch = fields_of(metadata), sys.modules.get("torch")
    offsets = fields.get("query_start_loc")  # on the device the capture uses
    on_device = not getattr(offsets, "is_cpu", True)
    watch = copies.watch(offsets.device) if on_device else None
    pinned = watch if type(watch) is copies.Watch else None  # notes pinned bytes
    tensor = torch.Tensor if torch is not None else ()
    saved, unsaved, device_fields, seen = [], [], [], set()
    # (field, value, whether it is held in a dict, list or tuple of the metadata)
    queue = collections.deque((n, v, False) for n, v in fields.items())
    while queue:
        name, value, in_a_container = queue.popleft()
        if type(value) in PLAIN or id(value) in seen:
            continue  # a scalar, or a value another field holds
        seen.add(id(value))
        try:
            if isinstance(value, tensor):
                if not value.is_cpu:
                    if pinned is not None:  # is it a view of the saved bytes?
                        device_fields.append((name, value))
                elif on_device or in_a_container or is_host_field(name):
                    address = _dense_tensor_address(value, torch)
                    saved.append(_save(name, value, address, value.clone, pinned))
            elif isinstance(value, (dict, list, tuple)):
                items = value.items() if isinstance(value, dict) else enumerate(value)
                queue.extend([(f"{name}[{k!r}]", v, True) for k, v in items])
                if not isinstance(value, tuple):
                    saved.append(SavedValue(name, value, copy.copy(value), None))
            elif hasattr(value, "__array__") and hasattr(value, "copy"):  # numpy
                address = _dense_array_address(value)
                saved.append(_save(name, value, address, value.copy, pinned))
        except Exception as e:  # that value alone goes unsaved
            unsaved.append(f"{name} ({short_error(e)})")
    if pinned is not None:
        watch = pinned.settled(device_fields)
    return Saved(saved, unsaved, watch, fields.get("num_actual_tokens", "?"))


def _dense_tensor_address(value: Any, torch: Any) -> int:
    """Its first byte where it is one dense block of memory, else 0."""
    dense = type(value) is torch.Tensor and value.layout is torch.strided
    return value.data_ptr() if dense and value.is_contiguous() else 0


def _dense_array_address(value: Any) -> int:
    """A numpy array's first byte where dense, writeable and of plain values."""
    flags = value.flags  # what has none is no array: it goes unsaved
    dense = type(value) is sys.modules["numpy"].ndarray
    dense = dense and flags.c_contiguous and flags.writeable
    return _address(value) if dense and not value.dtype.hasobject else 0


def _save(name: str, value: Any, address: int, copy_of: Any, pinned: Any) -> SavedValue:
    """Its bytes where ``address`` is set, else ``copy_of()``; noted on ``pinned``."""
    if address:
        size = value.nbytes
        saved = SavedValue(name, value, string_at(address, size), address)
        bounds = (address, address + size)
    else:
        saved, bounds = SavedValue(name, value, copy_of(), None), None
    if pinned is not None:  # once saved: a copy is taken before anything else
        pinned.add(name, value, bounds)
    return saved


def _address(value: Any) -> int:
    """A tensor's, or an array's, first byte."""
    return value.data_ptr() if hasattr(value, "data_ptr") else value.ctypes.data


def _same(saved: SavedValue) -> bool:
    """Whether ``saved.value`` still holds what it held before the capture."""
    now, before = saved.value, saved.before
    if saved.address is not None:  # bytes; the memory moved if the pointer did
        if _address(now) != saved.address or now.nbytes != len(before):
            raise ValueError("its memory moved or changed size")
        return string_at(saved.address, len(before)) == before
    if isinstance(now, dict):  # the very same objects, or equal scalars
        return now.keys() == before.keys() and all(
            _kept(now[k], before[k]) for k in now
        )
    if isinstance(now, list):
        return len(now) == len(before) and all(map(_kept, now, before))
    if now.shape != before.shape:
        return False
    both_nan = (now != now) & (before != before)  # NaN for NaN: no write
    return bool(((now == before) | both_nan).all())


def _kept(now: Any, before: Any) -> bool:  # the same object, or an equal scalar
    return now is before or (
        type(now) in PLAIN and type(now) is type(before) and now == before
    )


def changed(saved: list[SavedValue]) -> tuple[list[SavedValue], list[str]]:
    """The values changed in place, and the fields that could not be compared."""
    changes, failed = [], []
    for each in saved:  # all compared before any is restored: values share memory
        try:
            if not _same(each):
                changes.append(each)
        except Exception as e:
            failed.append(f"{each.field} ({short_error(e)})")
    return changes, failed


def restore(changes: list[SavedValue]) -> list[str]:
    """Restore each changed value in place: the fields that could not be."""
    failed = []
    for each in changes:
        try:
            if each.address is not None:
                memmove(each.address, each.before, len(each.before))
            elif isinstance(each.value, dict):
                each.value.clear()
                each.value.update(each.before)
            elif isinstance(each.value, list):
                each.value[:] = each.before
            else:  # a tensor or an array
                each.value[...] = each.before
        except Exception as e:
            failed.append(f"{each.field} ({short_error(e)})")
    return failed
