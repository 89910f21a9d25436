# SPDX-License-Identifier: Apache-2.0
"""The seed scenario as a verdict: would full-graph capture of a MiniMax-M3 on
this vLLM get past the metadata builders, for each ROCm backend?

Used by ``vllm-capture-guard check`` and by the tests, which run it in fresh
interpreters with the guard switched on and off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_capture_guard.runtime.plugin import report, vllm_version
from vllm_capture_guard.tools import scenarios as sc


def run_record(run: sc.CaptureRun) -> dict[str, Any]:
    """A JSON-able account of one capture sequence."""
    failed = run.failed
    return {
        "backend": run.backend,
        "batch": dataclasses.asdict(run.batch) | {"label": run.batch.label()},
        "ok": failed is None,
        "error": failed.error if failed else None,
        "error_site": failed.error_site if failed else None,
        "error_line": failed.error_line if failed else None,
        "decode_query_len": run.decode_query_len,
        "query_start_loc_cpu_before": run.query_start_loc_cpu_before,
        "query_start_loc_cpu_after": run.query_start_loc_cpu_after,
        "query_start_loc_after": run.query_start_loc_after,
        "groups": [
            {
                "group": g.group,
                "builder": g.builder,
                "writes": [w.to_json() for w in g.writes],
            }
            for g in run.groups
        ],
    }


def run_seed(
    backends: tuple[str, ...] = sc.ROCM_BACKENDS,
    batches: tuple[sc.Batch, ...] = sc.DEFAULT_BATCHES,
) -> dict[str, Any]:
    """Every backend x batch of the seed scenario, on the CPU."""
    runs: list[dict[str, Any]] = []
    unavailable: dict[str, str] = {}
    for backend in backends:
        try:
            sc.backend_class(backend)
        except Exception as e:  # e.g. a backend module that needs a GPU to import
            unavailable[backend] = f"{type(e).__name__}: {e}"
            continue
        for batch in batches:
            runs.append(run_record(sc.run_capture(backend, batch)))
    guard = report()
    return {
        "vllm": vllm_version(),
        "guard": None if guard is None else guard.message,
        "ok": bool(runs) and all(r["ok"] for r in runs),
        "runs": runs,
        "unavailable": unavailable,
    }
