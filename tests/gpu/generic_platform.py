# SPDX-License-Identifier: Apache-2.0
"""Test-only vLLM platform plugin for the GPU tier on a lent NVIDIA machine.

vLLM's CUDA platform imports compiled extensions (``vllm._C_stable_libtorch``,
and flash-attention's through MiniMax-M3) that a pure-Python copy of vLLM does
not have. ``scripts/gpu-tier.sh run`` registers this function under the entry
point group ``vllm.platform_plugins`` (in a throw-away ``.dist-info`` on the
device, never in this package's metadata), so every vLLM process, the
model-inspection subprocess included, resolves to vLLM's generic
``UnspecifiedPlatform``. Tensors still live on ``cuda``; vLLM's Triton kernels
run there. On a ROCm host the tier runs on vLLM's own ROCm platform instead
and this file is not used.
"""


def generic_platform() -> str:
    return "vllm.platforms.interface.UnspecifiedPlatform"
