# SPDX-License-Identifier: Apache-2.0
"""On a fixed vLLM (0.29.0 and later) the promise is "no behaviour changes".

The guard acts on every release (it guards every capture, whatever the
code), so "nothing changes" is told by values, not by identity: for every
registered backend the audit builds on this host, the capture at the
audit's batches, recorded field by field (the shared metadata before and
after, what the capture rebound, what it returned), is the same with the
guard off and on. Two processes, loaded through vLLM's plugin loader, record
(``lab.oracle.record.record_backends``); the differential oracle compares.

A release is "fixed" when vLLM's own capture keeps the shared host values,
judged by running it unguarded in this process (never by the guard's own
detection). On 0.27.x/0.28.0 the same comparison must find exactly the host
writes the guard keeps from the other builders, and nothing else.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_fresh
from vllm_capture_guard.lab import oracle
from vllm_capture_guard.tools import harness

RECORD = (
    "import json; from vllm_capture_guard.lab.oracle.record import "
    "record_backends; print(json.dumps(record_backends()))"
)


def _affected() -> str | None:
    """Why this vLLM is affected, or None if it is fixed: its own capture
    sequence, run unguarded."""
    batch = harness.Batch(4)
    for backend in harness.seed_backends():
        try:
            harness.backend_class(backend)
        except Exception:  # 0.33's AITER module on a CPU host
            continue
        run = harness.run_capture(backend, batch)
        if run.failed is not None:
            return f"{backend} capture then indexer: {run.failed.error}"
        if run.values("query_start_loc_cpu") != batch.offsets():
            return f"{backend} capture writes query_start_loc_cpu"
        aiter = backend == "ROCM_AITER_UNIFIED_ATTN"
        if aiter and run.values("query_start_loc") != batch.offsets():
            return f"{backend} capture zeroes query_start_loc"
    return None


@pytest.fixture(scope="module")
def records() -> dict:
    why = _affected()
    if why is not None:
        pytest.skip(
            f"this vLLM is affected ({why}): the guard changes what its captures "
            "write, as tests/runtime/test_guard_at_use.py asserts"
        )
    out = {}
    for mode in ("off", "on"):
        proc = run_fresh(["-c", RECORD], VLLM_CAPTURE_GUARD=mode)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_every_backend_built_here_captures_the_same_guarded_and_not(records):
    """Field by field, shared and returned metadata, the guard changes
    nothing (workspaces a builder never writes are filled by torch, so that
    two runs compare)."""
    off, on = records["off"], records["on"]
    assert off["guard_action"] == "disabled" and on["guard_action"] == "patched"
    assert set(off["cases"]) == set(on["cases"])
    assert off["unavailable"] == on["unavailable"]
    built = {c["backend"] for c in off["cases"].values()}
    assert len(built) >= 15, built  # 17-25 registered backends build on a CPU
    result = oracle.compare(off, on)
    assert result.compared > 1000
    assert result.ok, result.report()
