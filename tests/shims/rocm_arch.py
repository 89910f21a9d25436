# SPDX-License-Identifier: Apache-2.0
"""Test-only shim: let ``vllm.platforms.rocm`` of vLLM 0.33 import on a CPU host.

Why it exists: from some release after 0.29.0 on (0.33.0 here),
``vllm.platforms.rocm`` reads the GPU architecture when it is imported
(``_GCN_ARCH = _get_gcn_arch()``: amdsmi first, then
``torch.cuda.get_device_properties("cuda").gcnArchName``), and
``vllm.v1.attention.backends.rocm_aiter_unified_attn`` imports that module. On a
host without a GPU that import raises, so the plugin honestly reports the AITER
patch as "unavailable" there (tested as such). To still look at 0.33's own
AITER builder from this CPU host, this shim answers that single query with an
MI300X's architecture (gfx942) while the module is imported, then puts torch
back. The architecture only selects kernels; the metadata builders under test
never read it. It is never part of the package.
"""

from __future__ import annotations

import importlib
import sys
import types

ARCH = "gfx942:sramecc+:xnack-"


def install() -> bool:
    """Import ``vllm.platforms.rocm`` with the arch query answered; False if
    it was imported already (then nothing is done)."""
    if "vllm.platforms.rocm" in sys.modules:
        return False
    import torch

    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        gcnArchName=ARCH
    )
    try:
        importlib.import_module("vllm.platforms.rocm")
    finally:
        torch.cuda.get_device_properties = real
    return True
