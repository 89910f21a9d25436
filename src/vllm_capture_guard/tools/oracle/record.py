# SPDX-License-Identifier: Apache-2.0
"""``record``: this vLLM's capture, as JSON.

Load the plugins as a worker does (``VLLM_CAPTURE_GUARD`` decides whether the
guard acts; ``auto`` counts as ``on``), then for each backend a patch fixes x
batch run the seed scenario through the harness with ``record=True``: for
each builder every field of the shared metadata (CPU and device) before and
after its capture, the fields it rebound on its own copy, its error, and
every field of the metadata it returned, all encoded by
:func:`vllm_capture_guard.tools.contract.encode`.
"""

from __future__ import annotations

from typing import Any

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.tools import harness

#: Bumped when the record's layout changes.
SCHEMA = 2
#: Sections of a group record whose fields are compared.
SECTIONS = ("before", "after", "rebound", "returned")


def record_case(backend: str, batch: harness.Batch) -> dict[str, Any]:
    """One backend x batch: every builder's capture, recorded."""
    run = harness.run_capture(backend, batch, record=True)
    groups = [
        {
            "group": g.group,
            "builder": g.builder,
            "error": g.error,
            "error_site": g.error_site,
            **(g.record or {}),
        }
        for g in run.groups
    ]
    return {"backend": backend, "batch": batch.label(), "groups": groups}


def record() -> dict[str, Any]:
    """Load the plugins as a worker does, then record every case."""
    from vllm_capture_guard.runtime import plugin
    from vllm_capture_guard.tools.guard import load_plugins_as_worker

    load_plugins_as_worker()
    guard = plugin.report()
    cases: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for backend in harness.seed_backends():
        try:
            harness.backend_class(backend)
        except Exception as e:  # 0.33 asks the GPU for its arch at import
            unavailable[backend] = harness.error_text(e)
            continue
        for batch in harness.DEFAULT_BATCHES:
            cases[f"{backend}/{batch.label()}"] = record_case(backend, batch)
    mode, _ = switch.read_mode()
    return {
        "schema": SCHEMA,
        "vllm": plugin.vllm_version(),
        "mode": mode.value,
        "guard_action": None if guard is None else guard.action,
        "guard": None if guard is None else guard.message,
        "unavailable": unavailable,
        "cases": cases,
    }
