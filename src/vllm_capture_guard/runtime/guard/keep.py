# SPDX-License-Identifier: Apache-2.0
"""Saving and putting back: a metadata's host values before its capture, and
after it, each one changed in place put back in place."""

from __future__ import annotations

import copy
import sys
from ctypes import memmove, string_at
from typing import Any

from vllm_capture_guard.runtime.base import short
from vllm_capture_guard.runtime.guard import copies, fields_of, is_host_field

PLAIN = frozenset({type(None), bool, int, float, str})


def save(metadata: Any) -> tuple[list, list[str], Any, Any]:
    """``([(field, value, copy, pointer)], [not saved], watch, size)``: host values."""
    fields, torch = fields_of(metadata), sys.modules.get("torch")
    offsets = fields.get("query_start_loc")  # on the device the capture uses
    on_device = not getattr(offsets, "is_cpu", True)
    watch = copies.watch(offsets.device) if on_device else None
    follow = watch if type(watch) is copies.Watch else None  # pinned bytes to note
    saved, failed, seen, devices = [], [], set(), []  # devices: over those bytes?
    top, tensor = len(fields), torch.Tensor if torch is not None else ()
    for i, (name, value) in enumerate(todo := list(fields.items())):  # it grows
        if type(value) in PLAIN or id(value) in seen:
            continue  # a scalar, or a value another field holds
        seen.add(id(value))
        try:
            if isinstance(value, tensor):
                if not value.is_cpu:
                    follow and devices.append((name, value))
                elif on_device or i >= top or is_host_field(name):
                    dense = type(value) is tensor and value.layout is torch.strided
                    if dense and value.is_contiguous() and (ptr := value.data_ptr()):
                        size = value.nbytes
                        saved.append((name, value, string_at(ptr, size), ptr))
                        follow and follow.add(name, value, (ptr, ptr + size))
                    else:  # not one dense block of memory: a copy by torch
                        saved.append((name, value, value.clone(), None))
                        follow and follow.add(name, value)
            elif isinstance(value, (dict, list, tuple)):
                items = value.items() if isinstance(value, dict) else enumerate(value)
                todo += [(f"{name}[{k!r}]", v) for k, v in items]
                if not isinstance(value, tuple):
                    saved.append((name, value, copy.copy(value), None))
            elif hasattr(value, "__array__") and hasattr(value, "copy"):  # numpy
                f, size, array = value.flags, value.nbytes, sys.modules["numpy"].ndarray
                dense = type(value) is array and f.c_contiguous and f.writeable
                ptr = _address(value) if dense and not value.dtype.hasobject else 0
                kept = (string_at(ptr, size), ptr) if ptr else (value.copy(), None)
                saved.append((name, value, *kept))  # bytes, where dense
                follow and follow.add(name, value, (ptr, ptr + size) if ptr else None)
        except Exception as e:  # that value alone goes unsaved
            failed.append(f"{name} ({short(e)})")
    watch = follow.settled(devices) if follow else watch
    return saved, failed, watch, fields.get("num_actual_tokens", "?")


def _address(value: Any) -> int:  # a tensor's, or an array's, first byte
    return value.data_ptr() if hasattr(value, "data_ptr") else value.ctypes.data


def _same(a: Any, b: Any, ptr: int | None) -> bool:
    if ptr is not None:  # bytes; the memory moved if the pointer did
        if _address(a) != ptr or a.nbytes != len(b):
            raise ValueError("its memory moved or changed size")
        return string_at(ptr, len(b)) == b
    if isinstance(a, dict):  # the very same objects, or equal scalars
        return a.keys() == b.keys() and all(_kept(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_kept, a, b))
    if a.shape != b.shape:
        return False
    return bool(((a == b) | ((a != a) & (b != b))).all())  # NaN for NaN: no write


def _kept(x: Any, y: Any) -> bool:
    return x is y or (type(x) in PLAIN and type(x) is type(y) and x == y)


def changed(saved: list) -> tuple[list, list[str]]:
    """The values changed in place, and the fields that could not be told."""
    out, failed = [], []
    for entry in saved:  # all told before any is put back: values share memory
        try:
            if not _same(entry[1], entry[2], entry[3]):
                out.append(entry)
        except Exception as e:
            failed.append(f"{entry[0]} ({short(e)})")
    return out, failed


def put_back(changes: list) -> list[str]:
    """Put back each changed value in place: the fields that could not be."""
    failed = []
    for name, value, before, ptr in changes:
        try:
            if ptr is not None:
                memmove(ptr, before, len(before))
            elif isinstance(value, dict):
                value.clear()
                value.update(before)
            else:  # a list, a tensor or an array
                value[slice(None) if isinstance(value, list) else ...] = before
        except Exception as e:
            failed.append(f"{name} ({short(e)})")
    return failed
