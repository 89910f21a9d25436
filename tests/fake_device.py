# SPDX-License-Identifier: Apache-2.0
"""Tensors that report a GPU device while their data stays on the CPU.

A vendor capture may zero the shared offsets only when they are on the GPU
(``if query_start_loc.is_cuda:``, ``if x.device.type != "cpu":``,
``if self.device.type == "cuda":``). A probe or a test on plain CPU tensors
then sees nothing, while a ROCm host (HIP tensors report ``cuda``) sees the
writes. These tensors let the CPU tier run that GPU path for real:

* :class:`DeviceTensor` is a ``torch.Tensor`` subclass sharing a CPU tensor's
  storage (``as_subclass``, no copy) whose ``device``, ``is_cuda``, ``is_cpu``
  and ``get_device()`` say ``cuda:0``. Every op runs on the CPU data, so
  in-place writes (``zero_``, ``fill_``, ``copy_``, slice assignment) change the
  values, and views keep the subclass (``__torch_function__``), so
  ``buf[:n]`` reports ``cuda`` too. ``.cpu()`` / ``.to("cpu")`` return a plain
  CPU *copy*, as a device-to-host copy does; ``.cuda()`` / ``.to("cuda")``
  return the tensor itself.
* :func:`fake_cuda` is a ``TorchFunctionMode`` under which a factory call with
  ``device="cuda"`` (``torch.zeros(..., device=self.device)`` in a builder's
  ``__init__``) makes a :class:`DeviceTensor` instead of asking the driver.

Neither initialises CUDA: ``torch.cuda.is_initialized()`` stays False. (A
``_make_wrapper_subclass`` with ``device="cuda"`` and ``__torch_dispatch__``
does not work here: indexing such a tensor enters a CUDA device guard, which
initialises the driver.) ``torch.device("cuda")`` objects themselves need no
driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CUDA = torch.device("cuda", 0)


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, (str, torch.device)):
        return torch.device(value).type == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor)


class DeviceTensor(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0`` (data shared, not copied)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CUDA

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return CUDA.index

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu:
            return _plain(args[0]).clone()
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            return _to(args[0], *args[1:], **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` on a :class:`DeviceTensor`: a CPU target copies out, a
    CUDA target stays (dtype conversions run on the CPU data)."""
    device = kwargs.pop("device", None)
    rest = []
    for a in args:
        if isinstance(a, (str, torch.device)) or (
            isinstance(a, int) and not isinstance(a, bool)
        ):
            device = a
        elif isinstance(a, torch.Tensor):  # .to(other): its dtype and device
            device, rest = a.device, [*rest, a.dtype]
        else:
            rest.append(a)
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    plain = _plain(self)
    out = plain.to(*rest, **kwargs)
    if device is not None and not _is_cuda_device(device):
        return out.clone() if out is plain else out
    if out is plain:
        return self
    return out.as_subclass(DeviceTensor)


def on_device(tensor: torch.Tensor) -> DeviceTensor:
    """``tensor``'s storage, reporting ``cuda:0``."""
    return _plain(tensor).as_subclass(DeviceTensor)


class fake_cuda(TorchFunctionMode):
    """Factories asked for a CUDA device build a :class:`DeviceTensor` on the
    CPU instead: ``with fake_cuda(): builder = Cls(spec, names, cfg, "cuda")``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if func in (torch.Tensor.to, torch.Tensor.cuda):  # DeviceTensor's own
            return func(*args, **kwargs)
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            return on_device(out) if isinstance(out, torch.Tensor) else out
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_cuda_init() -> Iterator[None]:
    """Fail if the block initialised CUDA (the trick must not need a driver)."""
    before = torch.cuda.is_initialized()
    yield
    assert torch.cuda.is_initialized() == before, "CUDA was initialised"
