# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2 on the GPU tier's host, as the harness makes it
(``vllm_capture_guard.tools.harness.v2``: vLLM's own runner, its own
``load_model``, the KV cache as the engine core plans it, its own
``capture_model``), with real CUDA graphs.

The tier runs vLLM's pure-Python files on vLLM's generic platform
(``tests/gpu/generic_platform.py``), which answers four questions Model
Runner V2 asks of a GPU platform with nothing, and the pure-Python copy
lacks one compiled op. :func:`setup` answers them with torch's own CUDA
calls, as vLLM's CUDA and ROCm platforms answer them:

* the graph pool: ``torch.cuda.graph_pool_handle()``;
* the device memory in use: ``torch.cuda.memory_allocated``;
* the current stream where vLLM has set none: ``torch.cuda.current_stream``;
* allocator pools (sleep mode): none, as on a GPU server without sleep mode
  (the harness's worker, :func:`vllm_capture_guard.tools.harness.v2.make.worker`);
* the device view of pinned host memory (UVA; vLLM's compiled
  ``get_cuda_view_from_cpu_tensor``): the same memory through torch's
  ``__cuda_array_interface__`` import, which on a host with unified
  addressing is the pinned buffer's own address, zero-copy, as vLLM's op
  gives it.
"""

from __future__ import annotations

import sys

import torch

VIEW = "get_accelerator_view_from_cpu_tensor"


class _DeviceView:
    """A pinned host tensor's memory, offered to torch as CUDA memory."""

    def __init__(self, cpu: torch.Tensor) -> None:
        assert cpu.is_pinned(), "a device view needs pinned host memory"
        self.cpu = cpu  # kept alive as long as the view
        item = cpu.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(cpu.shape),
            "strides": tuple(s * item for s in cpu.stride()),
            "typestr": _typestr(cpu.dtype),
            "data": (cpu.data_ptr(), False),
            "version": 3,
        }


def _typestr(dtype: torch.dtype) -> str:
    kinds = {True: "f", False: "i"}
    if dtype is torch.bool:
        return "|b1"
    if dtype in (torch.uint8,):
        return "|u1"
    kind = kinds[dtype.is_floating_point]
    return f"<{kind}{torch.empty((), dtype=dtype).element_size()}"


def device_view(cpu: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over ``cpu``'s pinned memory (see the module)."""
    if cpu.dtype is torch.bfloat16:  # no typestr: as int16, viewed back
        return device_view(cpu.view(torch.int16)).view(torch.bfloat16)
    view = torch.as_tensor(_DeviceView(cpu), device="cuda")
    view._capture_guard_host = cpu  # the host tensor lives as long as the view
    return view


def setup() -> list[str]:
    """Answer what the generic platform and the pure-Python vLLM lack (see
    the module); returns what was answered, one line each."""
    from vllm.platforms import current_platform

    told = []
    if not callable(getattr(current_platform, "graph_pool_handle", None)):
        current_platform.graph_pool_handle = torch.cuda.graph_pool_handle
        told.append("graph pool: torch.cuda.graph_pool_handle()")
    try:
        current_platform.get_current_memory_usage(torch.device("cuda"))
    except NotImplementedError:
        current_platform.get_current_memory_usage = lambda device=None: (
            torch.cuda.memory_allocated(device)
        )
        told.append("device memory in use: torch.cuda.memory_allocated")
    if not callable(getattr(current_platform, "current_stream", None)):
        current_platform.current_stream = torch.cuda.current_stream
        told.append("current stream: torch.cuda.current_stream")
    told += _device_views()
    return told


def _device_views() -> list[str]:
    """vLLM's UVA view, where the compiled op is missing, in every module of
    vLLM that bound it (they import it by name)."""
    import vllm.utils.torch_utils as torch_utils

    real = getattr(torch_utils, VIEW, None)
    probe = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    try:
        real(probe)
        return []  # the op is there
    except Exception:
        pass
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("vllm") and (
            getattr(module, VIEW, None) is real
        ):
            setattr(module, VIEW, device_view)
    return ["UVA views: torch's __cuda_array_interface__ over the pinned memory"]
