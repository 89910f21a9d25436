# SPDX-License-Identifier: Apache-2.0
"""Why a backend is not built or not captured here, by cause, told from the
exception that stopped it (its type, message and the module it names):

* ``placeholder``: a registry slot that names no backend (``CUSTOM``,
  ``TORCH_SDPA`` until registered, a module that does not exist);
* ``package``: a pure-Python package that is not installed; the report
  names the package that would add the backend;
* ``compiled extension``: a compiled kernel library (AITER, FlashMLA,
  vLLM's ``_C``, its flash-attention build, ...);
* ``hardware``: a GPU itself (a CUDA driver, a device capability, a kernel
  launched on a device);
* ``other``: anything else (a finding in itself: read the reason).
"""

from __future__ import annotations

import re

from vllm_capture_guard.runtime.logs import Words


class Cause(Words):
    PLACEHOLDER = "placeholder"
    PACKAGE = "package"
    COMPILED = "compiled extension"
    HARDWARE = "hardware"
    OTHER = "other"


#: Pure-Python packages a backend imports: module -> the package to install.
PACKAGES = {
    "flashinfer": "flashinfer-python",
    "compressed_tensors": "compressed-tensors",
    "pynvml": "nvidia-ml-py",
    "tabulate": "tabulate",
    "click": "click",
}

#: Compiled kernel libraries: module (top level) -> what it is.
COMPILED = {
    "aiter": "AMD's AITER kernels (amd-aiter, built for ROCm)",
    "hpc": "Tencent's hpc-ops kernels (built for Hopper)",
    "tokenspeed_mla": "TokenSpeed's MLA kernels (CuTe DSL, Blackwell)",
    "deep_gemm": "DeepGEMM (CUDA)",
    "flash_mla": "FlashMLA (CUDA)",
    "cutlass": "NVIDIA CUTLASS DSL",
}

_MISSING = re.compile(r"No module named '([\w.]+)'")
_CANNOT_IMPORT = re.compile(r"cannot import name '\w+' from '([\w.]+)'")


def _module_cause(module: str) -> tuple[Cause, str] | None:
    top = module.split(".")[0]
    if top == "vllm":
        if module.startswith("vllm._") or "flash_attn" in module:
            return Cause.COMPILED, f"vLLM's compiled extension {module}"
        return Cause.PLACEHOLDER, f"{module} does not exist in this release"
    if top in PACKAGES:
        return Cause.PACKAGE, PACKAGES[top]
    if top in COMPILED:
        return Cause.COMPILED, COMPILED[top]
    return None


def classify(reason: str) -> tuple[Cause, str]:
    """``(cause, what it needs)`` for a skip or capture reason."""
    if "must be registered before use" in reason:
        return Cause.PLACEHOLDER, "a backend registered in this slot"
    found = _MISSING.search(reason)
    if found:
        known = _module_cause(found.group(1))
        if known:
            return known
        return Cause.PACKAGE, f"the module {found.group(1)}"
    for needle, need in (
        ("_flashmla_C", "vLLM's compiled FlashMLA extension (vllm._flashmla_C)"),
        ("_vllm_fa", "vLLM's compiled flash-attention (vllm.vllm_flash_attn)"),
        ("'_C' object has no attribute", "vLLM's compiled CPU/GPU ops (vllm._C)"),
        ("fa_utils", "vLLM's compiled flash-attention (vllm.vllm_flash_attn)"),
        ("requires the hpc module", COMPILED["hpc"]),
        ("tokenspeed_mla requires", COMPILED["tokenspeed_mla"]),
    ):
        if needle in reason:
            return Cause.COMPILED, need
    cannot = _CANNOT_IMPORT.search(reason)
    if cannot:
        known = _module_cause(cannot.group(1))
        if known:
            return known
    for needle, need in (
        ("NVIDIA driver", "an NVIDIA GPU (its driver)"),
        ("CUDA error", "an NVIDIA GPU (CUDA's runtime)"),
        ("must be a cuda device", "an NVIDIA GPU (a CUDA device)"),
        ("Torch not compiled with CUDA", "a GPU (torch's CUDA or HIP)"),
        ("requires a CUDA device", "an NVIDIA GPU (its device capability)"),
        ("'function' object is not subscriptable", "a GPU to launch its Triton kernel"),
        ("module 'triton", "Triton with a GPU driver (vLLM disables it here)"),
        ("triton.language", "Triton with a GPU driver (vLLM disables it here)"),
    ):
        if needle in reason:
            return Cause.HARDWARE, need
    return Cause.OTHER, "see the reason"
