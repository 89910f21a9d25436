# SPDX-License-Identifier: Apache-2.0
"""vllm-capture-guard: keeps vLLM's full CUDA-graph capture on ROCm from
changing the attention metadata that other builders read.

Importing this package imports neither vLLM nor torch; the vLLM plugin entry
point is :func:`vllm_capture_guard.runtime.plugin.register`.
"""

__version__ = "0.2.0"
