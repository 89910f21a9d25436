# SPDX-License-Identifier: Apache-2.0
"""What only maintainers run to prove the guard, never an operator's command:

``oracle``    the differential oracle against 0.29.0
              (``python -m vllm_capture_guard.lab.oracle``);
``identity``  did loading the plugins change vLLM's classes?
``cost``      the guard's time by phase, for the GPU tier.

The operator's tools (:mod:`vllm_capture_guard.tools`) never import it, and
the runtime imports neither (``tests/test_layout.py``).
"""
