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

* :func:`field_side` says which fields are host (``cpu``) values and which
  are device values, by name, so that the CPU test tier, where "device"
  tensors live on the CPU too, reasons exactly as a GPU host;
* :func:`snapshot` records every tensor (and numpy array) that a metadata
  holds, keeping a reference to the *object* and a copy of its values, and
  :meth:`Snapshot.writes` lists the objects whose values changed since, so a
  field that a builder merely rebound on its own copy is not a write;
* :func:`encode` turns any metadata value (shared fields, returned metadata,
  a builder's buffers) into plain JSON values, and :func:`diff` compares two
  encoded values, path by path: the one encoder and differ of the project;
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from vllm_capture_guard.runtime.logs import Words

try:
    from vllm_capture_guard.runtime.guard.metadata import is_host_field
except ImportError:  # an older runtime (the GPU start-up comparison's baseline)
    from vllm_capture_guard.runtime.guard import is_host_field


class Side(Words):
    """Where a value lives for the kernels: host memory or the device."""

    CPU = "cpu"
    DEVICE = "device"


CPU = Side.CPU
DEVICE = Side.DEVICE


def field_side(name: str) -> Side:
    """``cpu`` for host values, ``device`` for everything else: the runtime's
    one rule (the runtime's ``is_host_field``) on the
    last part of a dotted path. Tested against every field that the supported
    vLLM releases declare on ``CommonAttentionMetadata``."""
    leaf = name.rsplit(".", 1)[-1].split("[", 1)[0].lower()
    return CPU if is_host_field(leaf) or leaf in ("cpu", "host") else DEVICE


def _values(obj: Any) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
        if obj.dtype in (torch.bfloat16, torch.float16):
            obj = obj.float()
        return obj.cpu().reshape(-1).tolist()
    return np.asarray(obj).reshape(-1).tolist()


@dataclasses.dataclass(frozen=True)
class FieldWrite:
    """One shared field whose values a builder changed in place."""

    field: str
    side: Side
    before: list[Any]
    after: list[Any]

    def __str__(self) -> str:
        return f"{self.field} ({self.side}): {self.before} -> {self.after}"


def _same(a: Any, b: Any) -> bool:
    """Bit for bit, so that uninitialised NaNs in a buffer compare equal."""
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == torch.bool or a.numel() == 0:
            return torch.equal(a, b)
        return torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def tensor_fields(metadata: Any) -> Iterator[tuple[str, Any]]:
    """Every (field name, tensor-or-array) pair of a metadata dataclass, read
    from the dataclass itself (each vLLM release adds or drops fields)."""
    for f in dataclasses.fields(metadata):
        value = getattr(metadata, f.name, None)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            yield f.name, value


class Snapshot:
    """Values of a metadata's tensors at one moment, held with the objects."""

    def __init__(self, metadata: Any) -> None:
        self._held = [
            (name, obj, obj.clone() if isinstance(obj, torch.Tensor) else obj.copy())
            for name, obj in tensor_fields(metadata)
        ]

    def writes(self) -> list[FieldWrite]:
        """The fields whose *objects* now hold other values than at snapshot."""
        return [
            FieldWrite(name, field_side(name), _values(copy), _values(obj))
            for name, obj, copy in self._held
            if not _same(obj.detach() if isinstance(obj, torch.Tensor) else obj, copy)
        ]


def snapshot(metadata: Any) -> Snapshot:
    return Snapshot(metadata)


def cpu_writes(writes: Iterable[FieldWrite]) -> list[FieldWrite]:
    return [w for w in writes if w.side == CPU]


# --- the encoder and the differ ----------------------------------------------

#: How deep :func:`encode` follows plain objects and containers.
MAX_DEPTH = 6


def encode(value: Any, _depth: int = 0, _seen: frozenset[int] = frozenset()) -> Any:
    """A JSON value that says everything comparable about ``value``, taken at
    once (views of shared buffers change later).

    Tensors and arrays: ``{"kind": "tensor"|"ndarray", "dtype", "shape",
    "values"}``; dataclasses and plain objects: ``{"kind": "dataclass"|
    "object", "type", "fields"}``; enums ``{"kind": "enum", "type", "name"}``;
    lists, tuples and dicts element by element; anything deeper than
    :data:`MAX_DEPTH`, seen before on the way down, or opaque (a function, a
    stream) as ``{"kind": "opaque", "type"}``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return {
            "kind": "tensor",
            "dtype": dtype,
            "shape": list(value.shape),
            "values": _values(value),
        }
    if isinstance(value, np.ndarray):
        return {
            "kind": "ndarray",
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "values": _values(value),
        }
    if isinstance(value, enum.Enum):
        return {"kind": "enum", "type": type(value).__name__, "name": value.name}
    if isinstance(value, (torch.dtype, torch.device, complex)):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    opaque = {"kind": "opaque", "type": type(value).__qualname__}
    if _depth >= MAX_DEPTH or id(value) in _seen:
        return opaque
    seen, deeper = _seen | {id(value)}, _depth + 1
    if isinstance(value, (list, tuple)):
        return [encode(v, deeper, seen) for v in value]
    if isinstance(value, dict):
        return {
            "kind": "dict",
            "fields": {str(k): encode(v, deeper, seen) for k, v in value.items()},
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = "dataclass"
        items = [
            (f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)
        ]
    elif hasattr(value, "__dict__") and not callable(value):
        kind, items = "object", list(vars(value).items())
    else:
        return opaque
    fields = {k: encode(v, deeper, seen) for k, v in items}
    return {"kind": kind, "type": type(value).__qualname__, "fields": fields}


class Change(Words):
    """What differs at one path of two encoded values."""

    VALUES = "values"  # a tensor's or array's values (same dtype and shape)
    LAYOUT = "layout"  # a tensor's dtype or shape
    TYPE = "type"  # a class name, or one side is not the same kind of thing
    SCALAR = "scalar"  # a Python value
    MISSING = "missing"  # a field or key only one side has


@dataclasses.dataclass(frozen=True)
class Difference:
    """One place where two encoded values differ. ``side`` is the field's
    :func:`field_side` for tensor values (numpy arrays: ``cpu``), else None."""

    path: str
    change: Change
    a: str
    b: str
    side: Side | None = None


def _is_array(v: Any) -> bool:
    return isinstance(v, dict) and v.get("kind") in ("tensor", "ndarray")


def _has_fields(v: Any) -> bool:
    return isinstance(v, dict) and "fields" in v


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        if a == b:  # the fast path; NaN is never == NaN
            return True
        return len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def show(value: Any, other: Any = None, limit: int = 12) -> str:
    """A short text for an encoded value; for a long array compared with
    ``other``, the window ``[lo:hi]`` that holds the elements that differ."""
    if _is_array(value):
        vals = value["values"]
        if len(vals) <= limit:
            return str(vals)
        if _is_array(other):
            diff = [
                i
                for i, (x, y) in enumerate(zip(vals, other["values"], strict=False))
                if not _equal(x, y)
            ]
            if diff:
                lo, hi = diff[0], min(diff[-1] + 1, diff[0] + limit)
                more = "" if hi > diff[-1] else "..."
                return f"[{lo}:{hi}]={vals[lo:hi]}{more} of {len(vals)}"
        return f"{vals[:limit]}... of {len(vals)}"
    if _has_fields(value):
        return f"<{value.get('type', value['kind'])}>"
    if isinstance(value, list):
        return f"<list of {len(value)}>"
    return repr(value)


def diff(a: Any, b: Any, path: str = "") -> list[Difference]:
    """Every difference between two :func:`encoded <encode>` values.

    Dataclasses, objects and dicts compare field by field (a field only one
    side has is a ``missing`` difference), lists element by element, arrays
    by dtype, shape, then values (NaN equals NaN), anything else by type and
    value."""
    here = path or "."
    if _is_array(a) and _is_array(b):
        if (a["dtype"], a["shape"]) != (b["dtype"], b["shape"]):
            return [
                Difference(
                    here,
                    Change.LAYOUT,
                    f"{a['dtype']}{a['shape']}",
                    f"{b['dtype']}{b['shape']}",
                )
            ]
        if _equal(a["values"], b["values"]):
            return []
        side = CPU if a["kind"] == "ndarray" else field_side(here)
        return [Difference(here, Change.VALUES, show(a, b), show(b, a), side)]
    if _has_fields(a) and _has_fields(b) and a["kind"] == b["kind"]:
        out = []
        if a.get("type") != b.get("type"):
            out.append(Difference(here, Change.TYPE, a.get("type"), b.get("type")))
        fa, fb = a["fields"], b["fields"]
        for key in list(fa) + [k for k in fb if k not in fa]:
            sub = f"{path}.{key}" if path else key
            if key not in fa or key not in fb:
                out.append(
                    Difference(
                        sub, Change.MISSING, show(fa.get(key)), show(fb.get(key))
                    )
                )
            else:
                out += diff(fa[key], fb[key], sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in diff(x, y, f"{path}[{i}]")
        ]
    if _equal(a, b):
        return []
    same_kind = type(a) is type(b) and not isinstance(a, (dict, list))
    change = Change.SCALAR if same_kind else Change.TYPE
    return [Difference(here, change, show(a, b), show(b, a))]
