# SPDX-License-Identifier: Apache-2.0
"""The runtime wing, the only code that runs inside ``vllm serve``: small, and
importing no tools module, no vLLM attention module at load, no CUDA/HIP."""
