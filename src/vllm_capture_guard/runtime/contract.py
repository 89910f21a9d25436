# SPDX-License-Identifier: Apache-2.0
"""The one rule this project enforces: capture must not change what other
builders read.

During full CUDA-graph capture vLLM's model runner builds one
``CommonAttentionMetadata`` over its persistent buffers and hands a *shallow*
copy of it to every KV-cache group's metadata builder, one after the other
(``gpu_model_runner._build_attention_metadata``; Model Runner V2 does the same
in ``gpu/attn_utils.py``). Rebinding a field on one copy is private to that
copy, but an in-place write into one of the tensors is seen by every builder
that runs afterwards.

This module states that rule once, in code:

* :func:`snapshot` records every tensor (and numpy array) that a
  ``CommonAttentionMetadata`` holds, keeping a reference to the *object* and a
  copy of its values;
* :meth:`Snapshot.writes` compares those same objects with their copies, so a
  field that a builder merely rebound on its own copy is not a write, while an
  in-place ``zero_()``/``fill_()``/``copy_()`` is;
* :func:`preserved` restores named fields' values after a block, which is how
  the patches undo exactly the writes upstream stopped making.

Fields are classed as ``cpu`` (host copies, named ``*_cpu``, read by later
builders to size and split the batch) or ``device`` (what kernels read). The
class is decided by name, not by ``tensor.device``, so that the CPU test tier,
where the "device" tensors live on the CPU too, reasons exactly as a GPU host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

CPU = "cpu"
DEVICE = "device"


def field_side(name: str) -> str:
    """``cpu`` for the host copies (``query_start_loc_cpu``, ``_seq_lens_cpu``,
    ``encoder_seq_lens_cpu``...), ``device`` for everything else."""
    return CPU if name.endswith("_cpu") else DEVICE


def _values(obj: Any) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().reshape(-1).tolist()
    return np.asarray(obj).reshape(-1).tolist()


@dataclasses.dataclass(frozen=True)
class FieldWrite:
    """One shared field whose values a builder changed in place."""

    field: str
    side: str
    before: list[Any]
    after: list[Any]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"{self.field} ({self.side}): {self.before} -> {self.after}"


@dataclasses.dataclass
class _Held:
    name: str
    obj: Any  # the very tensor / ndarray object the metadata pointed at
    copy: Any  # its values at snapshot time

    def changed(self) -> bool:
        if isinstance(self.obj, torch.Tensor):
            return not torch.equal(self.obj, self.copy)
        return not np.array_equal(self.obj, self.copy)

    def restore(self) -> None:
        if isinstance(self.obj, torch.Tensor):
            self.obj.copy_(self.copy)
        else:
            self.obj[...] = self.copy


def tensor_fields(metadata: Any) -> Iterator[tuple[str, Any]]:
    """Every (field name, tensor-or-array) pair of a metadata dataclass.

    Works on any vLLM version: the field list is read from the dataclass, not
    kept by hand (0.27, 0.29 and 0.33 each add or drop fields)."""
    for f in dataclasses.fields(metadata):
        value = getattr(metadata, f.name, None)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            yield f.name, value


class Snapshot:
    """Values of a ``CommonAttentionMetadata``'s tensors at one moment."""

    def __init__(self, metadata: Any, names: Iterable[str] | None = None) -> None:
        if names is None:
            pairs: Iterable[tuple[str, Any]] = tensor_fields(metadata)
        else:
            pairs = ((n, getattr(metadata, n, None)) for n in names)
        self._held: list[_Held] = []
        for name, obj in pairs:
            if not isinstance(obj, (torch.Tensor, np.ndarray)):
                continue
            copy = obj.clone() if isinstance(obj, torch.Tensor) else obj.copy()
            self._held.append(_Held(name, obj, copy))

    @property
    def names(self) -> list[str]:
        return [h.name for h in self._held]

    def writes(self) -> list[FieldWrite]:
        """The fields whose *objects* now hold other values than at snapshot."""
        return [
            FieldWrite(h.name, field_side(h.name), _values(h.copy), _values(h.obj))
            for h in self._held
            if h.changed()
        ]

    def restore(self) -> None:
        for h in self._held:
            if h.changed():
                h.restore()


def snapshot(metadata: Any, names: Iterable[str] | None = None) -> Snapshot:
    return Snapshot(metadata, names)


def cpu_writes(writes: Iterable[FieldWrite]) -> list[FieldWrite]:
    return [w for w in writes if w.side == CPU]


def shares_memory(a: Any, b: Any) -> bool:
    """True when two tensors overlap in memory (e.g. a runner whose "device"
    buffer is its CPU buffer); then restoring one would undo the other."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.device != b.device:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class preserved:
    """``with preserved(cm, "query_start_loc_cpu"): ...`` runs the block, then
    puts the named fields' values back as they were.

    Only the tensors the metadata held on entry are restored, so a builder that
    rebinds a field on its own copy keeps its private tensor. Kept lean (no
    field scan, no comparison): the patches run it on every capture call."""

    __slots__ = ("_saved",)

    def __init__(self, metadata: Any, *names: str) -> None:
        self._saved = [
            (t, t.clone())
            for t in (getattr(metadata, n, None) for n in names)
            if isinstance(t, torch.Tensor)
        ]

    def __enter__(self) -> preserved:
        return self

    def __exit__(self, *exc: object) -> None:
        for tensor, values in self._saved:
            tensor.copy_(values)
