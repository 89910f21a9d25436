# SPDX-License-Identifier: Apache-2.0
"""The operator's tools: the command line (``status``, ``check``, ``audit``,
``patch``), the capture harness, the judge, the in-tree patcher, each
backport's tools module and the test helpers. None of it is loaded by vLLM.
What only maintainers run is in :mod:`vllm_capture_guard.lab`, which nothing
here imports.
"""
