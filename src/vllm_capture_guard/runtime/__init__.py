# SPDX-License-Identifier: Apache-2.0
"""The runtime wing: the only code that runs inside ``vllm serve``.

vLLM loads :func:`vllm_capture_guard.runtime.plugin.register` in every process
it starts. Everything under this package stays small, imports nothing from
:mod:`vllm_capture_guard.tools`, imports no vLLM attention module at load and
initialises no CUDA/HIP.
"""
