# SPDX-License-Identifier: Apache-2.0
"""The seed bug, on vLLM's real builders: reproduced without the guard, fixed
with the guard loaded by vLLM's own plugin loader in a fresh interpreter."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_fresh
from vllm_capture_guard.tools import harness as sc

INDEXER_FILE = "vllm/models/minimax_m3/common/indexer.py"
ASSERTION = "assert decode_query_len > 0"


@pytest.fixture(scope="module")
def affected() -> bool:
    """Judged by running vLLM's own ROCm capture unguarded (this process never
    loads the guard), not by the guard's detection: a detection that wrongly
    said "not needed" must fail these tests, not skip them."""
    batch = sc.Batch(4)
    run = sc.run_capture("ROCM_ATTN", batch)
    return run.values("query_start_loc_cpu") != batch.offsets()


def _seed(mode: str) -> tuple[dict, int]:
    """``vllm-capture-guard check --json`` in a fresh interpreter: it calls
    ``vllm.plugins.load_general_plugins()`` and then runs every backend x batch
    of the seed scenario."""
    proc = run_fresh(
        ["-m", "vllm_capture_guard", "check", "--json"], VLLM_CAPTURE_GUARD=mode
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.returncode


@pytest.fixture(scope="module")
def guarded() -> tuple[dict, int]:
    return _seed("on")


@pytest.fixture(scope="module")
def unguarded() -> tuple[dict, int]:
    return _seed("off")


def _run(result: dict, backend: str, batch: sc.Batch) -> dict:
    why = result["unavailable"].get(backend)
    if why:  # 0.33's AITER module on a CPU host; see tests/test_fixed_releases.py
        pytest.skip(f"{backend} unavailable on this host: {why}")
    (run,) = [
        r
        for r in result["runs"]
        if r["backend"] == backend and r["batch"] == batch.label()
    ]
    return run


BACKENDS = pytest.mark.parametrize("backend", sc.seed_backends())
BATCHES = pytest.mark.parametrize("batch", sc.DEFAULT_BATCHES, ids=sc.Batch.label)


@BACKENDS
def test_failure_reproduced_in_process(backend, affected):
    """No plugin loaded: the real ROCm capture, then the real indexer build on
    the same shared metadata, raise the startup AssertionError from vLLM."""
    if not affected:
        pytest.skip("this vLLM's ROCm capture leaves query_start_loc_cpu alone")
    run = sc.run_capture(backend, sc.Batch(4))
    failed = run.failed
    assert failed is not None and failed.group == "indexer"
    assert failed.error.startswith("AssertionError")
    assert failed.error_site.startswith(INDEXER_FILE + ":")
    assert failed.error_line == ASSERTION
    assert run.values("query_start_loc_cpu") == [0] * 5


@BACKENDS
@BATCHES
def test_failure_reproduced_with_guard_off(unguarded, backend, batch, affected):
    if not affected:
        pytest.skip("this vLLM's ROCm capture leaves query_start_loc_cpu alone")
    result, rc = unguarded
    assert rc == 1
    assert "VLLM_CAPTURE_GUARD=off" in result["guard"]
    run = _run(result, backend, batch)
    assert not run["ok"]
    assert run["error_site"].startswith(INDEXER_FILE + ":")
    assert run["error_line"] == ASSERTION


def test_guard_loaded_through_vllm_plugin_loader(guarded, affected):
    result, rc = guarded
    assert rc == 0
    assert result["ok"]
    expected = "patched" if affected else "not needed"
    assert result["guard"].startswith(expected), result["guard"]


@BACKENDS
@BATCHES
def test_capture_sequence_succeeds_with_guard(guarded, backend, batch):
    run = _run(guarded[0], backend, batch)
    assert run["ok"], run["error"]
    # the indexer sees the uniform query length (1, or 1 + speculative tokens)
    assert run["decode_query_len"] == batch.query_len
    # the CPU offsets come back bit for bit
    assert run["query_start_loc_cpu_after"] == run["query_start_loc_cpu_before"]
    assert run["query_start_loc_cpu_after"] == batch.offsets()
    # and no builder wrote any CPU-side shared field
    for group in run["groups"]:
        assert [w for w in group["writes"] if w["side"] == "cpu"] == []


@BATCHES
def test_rocm_attn_still_zeroes_device_offsets(guarded, batch):
    """The #25985 guard against the prefix-prefill fault stays in place."""
    run = _run(guarded[0], "ROCM_ATTN", batch)
    assert run["query_start_loc_after"] == [0] * (batch.total_reqs + 1)
    (write,) = [
        w for w in run["groups"][0]["writes"] if w["field"] == "query_start_loc"
    ]
    assert write["before"] == batch.offsets()
