# SPDX-License-Identifier: Apache-2.0
"""The seed bug, on vLLM's real builders: reproduced without the guard, fixed
with the guard loaded by vLLM's own plugin loader in a fresh interpreter."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
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
    """``vllm-capture-guard check --trace`` (every capture size's record, as
    JSON) in a new process: it calls ``vllm.plugins.load_general_plugins()``
    and then runs every backend x capture size of the seed scenario."""
    proc = run_cli("check", "--trace", "-v", VLLM_CAPTURE_GUARD=mode)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.returncode


@pytest.fixture(scope="module")
def guarded() -> tuple[dict, int]:
    return _seed("on")


@pytest.fixture(scope="module")
def unguarded() -> tuple[dict, int]:
    return _seed("off")


def _runs(result: dict, backend: str) -> list[dict]:
    """Every capture size ``check`` ran for ``backend`` (vLLM's own sizes,
    512 down to 1: on the V1 runner, one builder per group; on Model Runner
    V2, its own capture_model, which stops at the first size that fails)."""
    why = result["unavailable"].get(backend)
    if why:  # 0.33's AITER module on a CPU host; see tests/test_fixed_releases.py
        pytest.skip(f"{backend} unavailable on this host: {why}")
    runs = [r for r in result["runs"] if r["backend"] == backend]
    assert len(result["sizes"]) >= 50, result["sizes"]
    if result["stops_at_first_failure"] and not runs[-1]["ok"]:
        assert all(r["ok"] for r in runs[:-1]), runs
    else:
        assert len(runs) == len(result["sizes"]), (len(runs), result["sizes"])
    return runs


BACKENDS = pytest.mark.parametrize("backend", sc.seed_backends())


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
def test_failure_reproduced_with_guard_off(unguarded, backend, affected):
    if not affected:
        pytest.skip("this vLLM's ROCm capture leaves query_start_loc_cpu alone")
    result, rc = unguarded
    assert rc == 1
    assert "VLLM_CAPTURE_GUARD=off" in result["guard"]
    for run in _runs(result, backend):
        assert not run["ok"], run["batch"]
        assert run["error_site"].startswith(INDEXER_FILE + ":")
        assert run["error_line"] == ASSERTION


def test_guard_loaded_through_vllm_plugin_loader(guarded, affected):
    result, rc = guarded
    assert rc == 0
    assert result["ok"]
    # every release: the guard goes on every builder's capture (at use)
    assert result["guard"].startswith("patched"), result["guard"]
    (check,) = [
        c for c in result["checks"] if c["name"] == "MiniMax-M3 indexer after ROCM_ATTN"
    ]
    assert check["ok"] and check["passed"] == check["total"] == len(result["sizes"])


@BACKENDS
def test_capture_sequence_succeeds_with_guard(guarded, backend):
    for run in _runs(guarded[0], backend):
        assert run["ok"], (run["batch"], run["error"])
        # the indexer sees the uniform query length
        assert run["decode_query_len"] == 1
        # the CPU offsets come back bit for bit
        assert run["query_start_loc_cpu_after"] == run["query_start_loc_cpu_before"]
        # and no builder wrote any CPU-side shared field
        for group in run["groups"]:
            assert [w for w in group["writes"] if w["side"] == "cpu"] == []


def test_rocm_attn_still_zeroes_device_offsets(guarded):
    """The #25985 guard against the prefix-prefill fault stays in place."""
    for run in _runs(guarded[0], "ROCM_ATTN"):
        assert set(run["query_start_loc_after"]) == {0}, run["batch"]
        if not run["groups"]:  # Model Runner V2: its builds, not each builder
            continue
        (write,) = [
            w for w in run["groups"][0]["writes"] if w["field"] == "query_start_loc"
        ]
        assert write["before"] == run["query_start_loc_cpu_before"]
