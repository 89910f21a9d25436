# SPDX-License-Identifier: Apache-2.0
"""The runtime wing, all that runs inside ``vllm serve`` (no tools, no CUDA/HIP)."""
