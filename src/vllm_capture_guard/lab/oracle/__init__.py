# SPDX-License-Identifier: Apache-2.0
"""The differential oracle: patched releases against upstream's fixed one.

``record``   this vLLM's capture as JSON (through the harness);
``compare``  two records, field by field;
``releases`` running a command against another release's environment
             (shared with ``scripts/version_matrix.py``);
``cli``      ``python -m vllm_capture_guard.lab.oracle record|compare|run``.
"""

from vllm_capture_guard.lab.oracle.cli import CANDIDATES, REFERENCE, main, record_in
from vllm_capture_guard.lab.oracle.compare import Comparison, compare
from vllm_capture_guard.lab.oracle.record import SCHEMA, record

__all__ = [
    "CANDIDATES",
    "REFERENCE",
    "SCHEMA",
    "Comparison",
    "compare",
    "main",
    "record",
    "record_in",
]
