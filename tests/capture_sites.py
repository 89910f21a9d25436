# SPDX-License-Identifier: Apache-2.0
"""vLLM's three capture functions of PR #53818, driven on the CPU through
their ``torch.cuda.graph`` call: the tools' harness
(:mod:`vllm_capture_guard.tools.harness.streams`, which ``check`` runs),
re-exported under the names the tests use."""

from vllm_capture_guard.tools.harness.streams import (
    CUDAGRAPH,
    DRIVERS,
    ENCODER,
    GEMMA4,
    SITES,
    STREAM,
    Recorder,
    Stream,
    cpu_capture,
    drive_capture,
    drive_encoder,
    drive_gemma4,
    import_sites,
    present,
    record,
    summary,
    where,
)

__all__ = [
    "CUDAGRAPH",
    "DRIVERS",
    "ENCODER",
    "GEMMA4",
    "SITES",
    "STREAM",
    "Recorder",
    "Stream",
    "cpu_capture",
    "drive_capture",
    "drive_encoder",
    "drive_gemma4",
    "import_sites",
    "present",
    "record",
    "summary",
    "where",
]
