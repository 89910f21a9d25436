# SPDX-License-Identifier: Apache-2.0
"""Ask an installed builder what its capture does, instead of reading versions.

Vendor ROCm images carry versions such as ``0.27.2rc1.dev77+g...rocm723``, so
the plugin never compares version strings. It runs the installed builder's own
``build_for_cudagraph_capture`` on a tiny runner-shaped metadata and records
which shared fields it wrote in place. It does so twice:

``cpu``
    every tensor is a plain CPU tensor and the builder's device is the CPU;
``gpu``
    the builder's device is ``cuda:0`` and every device-side field reports
    ``cuda:0`` (``.device``, ``.is_cuda``), while its values live in a CPU
    tensor underneath (:class:`GpuLike`). Factory calls that ask for a CUDA
    device get the same kind of tensor. Nothing reaches CUDA/HIP: any attempt
    to initialise it from this thread makes the probe inconclusive instead.

A write is seen in the values of the tensors underneath, which every path
keeps on the CPU, so a capture that writes only when its tensors are on the
GPU is caught on a CPU-only host.

The builder is made with ``object.__new__`` and gets only what the base
``AttentionMetadataBuilder.__init__`` sets: no ``VllmConfig`` is needed. A
capture that needs more (a vendor builder reading ``self.block_size``, an
extra argument...) makes the probe *inconclusive*: :class:`Finding` says why,
and the patches then fail closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from vllm_capture_guard.runtime.contract import CPU, field_side

#: The probe batches: the first is the default; a capture whose writes depend
#: on the batch (speculative query lengths, a request count) is run on all.
PROBE_QUERY_LENS = (1, 1)
PROBE_BATCHES = ((1, 1), (1,), (2, 2, 2), (1,) * 8, (4, 4))
PROBE_SEQ_LEN = 5
CUDA = torch.device("cuda", 0)
PATHS = ("cpu", "gpu")


class ProbeRefused(RuntimeError):
    """The capture tried to initialise CUDA/HIP during the probe."""


class GpuLike(torch.Tensor):
    """A tensor that reports ``cuda:0`` and keeps its values on the CPU.

    Every torch function runs on the CPU tensor underneath; results that are
    tensors come back as :class:`GpuLike` again, except ``.cpu()``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> GpuLike:
        made = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            dtype=inner.dtype,
            device=CUDA,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            requires_grad=False,
        )
        made.inner = inner
        return made

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in _REPORTS:
            return _REPORTS[func]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        if func is torch.Tensor.cpu or func is torch.Tensor.numpy:
            return out
        return tree_map(_wrap, out)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        raise ProbeRefused(f"{func} reached the dispatcher")

    def __repr__(self) -> str:
        return f"GpuLike({self.inner!r})"


_REPORTS = {
    torch.Tensor.device.__get__: CUDA,
    torch.Tensor.is_cuda.__get__: True,
    torch.Tensor.is_cpu.__get__: False,
    torch.Tensor.get_device: 0,
}


class PinnedLike(torch.Tensor):
    """A CPU tensor that says it is pinned, as the runner's host buffers are
    on a GPU host (the ``*_cpu`` fields on the probe's ``gpu`` path)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.Tensor.is_pinned:
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


def _unwrap(x: Any) -> Any:
    return x.inner if isinstance(x, GpuLike) else x


def _wrap(x: Any) -> Any:
    return GpuLike(x) if type(x) is torch.Tensor else x


def _asks_for_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    return False


class _CudaOnCpu(TorchFunctionMode):
    """Factories and ``.to()`` that ask for CUDA get a :class:`GpuLike`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return _wrap(_unwrap(args[0]).clone())
        if func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if _asks_for_cuda(target):
                rest = [a for a in args[2:] if isinstance(a, torch.dtype)]
                dtype = kwargs.get("dtype", rest[0] if rest else None)
                src = _unwrap(args[0])
                return _wrap(src.to(dtype) if dtype is not None else src.clone())
            return func(*args, **kwargs)
        device = kwargs.get("device")
        if (
            device is not None
            and _asks_for_cuda(device)
            and not isinstance(device, int)
        ):
            kwargs["device"] = "cpu"
            return tree_map(_wrap, func(*args, **kwargs))
        return func(*args, **kwargs)


_probing = threading.local()


@contextlib.contextmanager
def _no_cuda_init() -> Iterator[None]:
    """Make CUDA/HIP initialisation from *this* thread raise; others pass."""
    import torch.cuda as tc

    original = tc._lazy_init
    me = threading.get_ident()

    def lazy_init() -> None:
        if (
            getattr(_probing, "active", False)
            and threading.get_ident() == me
            and not tc.is_initialized()  # a worker's GPU is up: nothing to start
        ):
            raise ProbeRefused("the capture tried to initialise CUDA/HIP")
        return original()

    _probing.active = True
    tc._lazy_init = lazy_init
    try:
        yield
    finally:
        _probing.active = False
        if tc._lazy_init is lazy_init:
            tc._lazy_init = original


def probe_metadata(
    path: str = "cpu", query_lens: tuple[int, ...] = PROBE_QUERY_LENS
) -> Any:
    """A ``CommonAttentionMetadata`` built only from the fields the installed
    vLLM's dataclass declares; on the ``gpu`` path its device-side tensors
    are :class:`GpuLike` and its host-side ones :class:`PinnedLike`."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    lens = torch.tensor(query_lens, dtype=torch.int32)
    num_reqs, num_tokens = len(query_lens), int(lens.sum())
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    values = dict(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.full((num_reqs,), PROBE_SEQ_LEN, dtype=torch.int32),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=PROBE_SEQ_LEN,
        block_table_tensor=torch.zeros((num_reqs, 1), dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
    )
    if path == "gpu":
        values = {
            k: (
                v
                if not isinstance(v, torch.Tensor)
                else v.as_subclass(PinnedLike)
                if field_side(k) == CPU
                else GpuLike(v)
            )
            for k, v in values.items()
        }
    declared = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in declared})


def bare_builder(builder_cls: type, device: torch.device) -> Any:
    """A builder instance with only the base class's attributes set."""
    builder = object.__new__(builder_cls)
    builder.kv_cache_spec = None
    builder.layer_names = []
    builder.vllm_config = None
    builder.device = device
    return builder


def _state(metadata: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    held = {}
    for f in dataclasses.fields(metadata):
        value = getattr(metadata, f.name, None)
        if isinstance(value, torch.Tensor):
            inner = _unwrap(value).as_subclass(torch.Tensor)
            held[f.name] = (inner, inner.clone())
    return held


def _written(before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> set[str]:
    """Fields whose tensor holds other values now. Values, not version
    counters: a capture that writes and then puts the values back (as our
    own wrappers do) leaves nothing for a later builder to trip on."""
    return {name for name, (obj, copy) in before.items() if not torch.equal(obj, copy)}


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one capture did to the shared metadata, on both device paths.

    ``written`` holds the fields it wrote in place on any path. ``complete`` is
    True only if the capture ran to the end on every path; otherwise
    ``reason`` says where it stopped, and ``written`` is what was seen before."""

    written: frozenset[str]
    complete: bool
    reason: str = ""

    def proves_untouched(self, *fields: str) -> bool:
        return self.complete and not self.written.intersection(fields)


def probe(builder_cls: type, capture: Any = None) -> Finding:
    """Run ``capture`` (default: the class's own, through the MRO) as a
    ``builder_cls`` on both device paths, for every probe batch."""
    fn = capture if capture is not None else builder_cls.build_for_cudagraph_capture
    written: set[str] = set()
    for query_lens in PROBE_BATCHES:
        for path in PATHS:
            metadata = probe_metadata(path, query_lens)
            before = _state(metadata)
            device = CUDA if path == "gpu" else torch.device("cpu")
            try:
                # On both paths: a capture that asks for CUDA gets a GpuLike,
                # and one that would initialise CUDA/HIP stops the probe.
                with _no_cuda_init(), _CudaOnCpu():
                    fn(bare_builder(builder_cls, device), metadata)
            except Exception as e:
                written |= _written(before)
                why = f"{path} path: {type(e).__name__}: {str(e)[:160]}"
                return Finding(frozenset(written), False, why)
            written |= _written(before)
    return Finding(frozenset(written), True)
