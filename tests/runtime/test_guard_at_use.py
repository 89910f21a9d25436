# SPDX-License-Identifier: Apache-2.0
"""The guard at use, on captures derived at test time
(:mod:`tests.runtime.at_use`), through vLLM's own V1 start-up on the CPU
(:mod:`tests.runtime.cpu_runner`): ``profile_cudagraph_memory`` (builders made
inside it), ``initialize_kv_cache``, ``capture_model`` at every size vLLM
derives (51, 512 down to 1), and a serving-time ``execute_dummy_batch``, with
MiniMax-M3's indexer in the other KV-cache group.

Two processes, loaded through vLLM's plugin loader, run every case: with the
guard off each case must fail as vLLM fails (the indexer's ``assert
decode_query_len > 0``, at the step where the hazard reaches it), with it on
it must get through every step, its builder captured at every size, and the
guard must say once what the capture wrote. A capture that sizes a workspace
on its first call passes both ways: the guard runs nothing of vLLM's. A host
view with a neutral name is kept where the device fields are on a GPU (by
where it lives), and where everything is on the CPU because its memory is
the named host offsets'.

Stubs, in those processes only (``cpu_runner``): streams and events, device
synchronisation, memory queries, compute-unit count, pinned host memory and
the model's forward.
"""

from __future__ import annotations

import json

import pytest

from tests import variants as vv
from tests import warm
from tests.conftest import fresh_env
from tests.runtime import at_use

INDEXER = "vllm/models/minimax_m3/common/indexer.py:"
STEPS = ["profile_cudagraph_memory", "initialize_kv_cache", "capture_model",
         "execute_dummy_batch"]  # fmt: skip
#: Where the hazard first reaches the indexer with the guard off.
FAILS_AT = {"dummy-batch": "execute_dummy_batch"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = at_use.write(tmp_path_factory.mktemp("at-use"))
    handles = {
        mode: warm.start(
            ["-m", "tests.runtime.at_use"],
            fresh_env(
                PYTHONPATH=f"{folder}:{vv.ROOT}",
                VLLM_CAPTURE_GUARD=mode,
                VLLM_LOGGING_LEVEL="INFO",
            ),
            cwd=vv.ROOT,
        )
        for mode in ("off", "on")
    }
    out = {}
    for mode, handle in handles.items():
        proc = handle.wait(900)
        assert proc.returncode == 0, (mode, proc.stderr[-4000:])
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _failed(run: dict) -> dict | None:
    return next((s for s in run["steps"] if s["error"]), None)


@pytest.mark.parametrize("case", list(at_use.CASES))
def test_case_through_vllms_start_up(case, runs):
    spec = at_use.CASES[case]
    off, on = runs["off"]["cases"][case], runs["on"]["cases"][case]
    sizes = runs["on"]["sizes"]
    assert sizes == 51, sizes  # vLLM's own capture sizes, 512 down to 1
    failed = _failed(off)
    if spec.passes_unguarded:
        assert failed is None, failed
    else:
        assert failed is not None, f"{case}: the unguarded start-up did not fail"
        assert failed["name"] == FAILS_AT.get(case, STEPS[0]), failed
        assert failed["error"] == "AssertionError", failed
        assert failed["site"].startswith(INDEXER), failed
    assert _failed(on) is None, _failed(on)
    assert [s["name"] for s in on["steps"]] == STEPS
    builder = next(b for b in on["builders"] if b.startswith("Case"))
    # profiling's two sizes, capture_model's 51, the dummy batch
    assert on["calls"][builder] == 2 + sizes + 1, on["calls"]
    assert spec.device is False or on["device"] == "DeviceTensor"
    if spec.metadata:  # the runner really made its metadata slotted, both ways
        assert off["slotted_made"] and on["slotted_made"], (off, on)
    said = [line for line in on["log"] if line.startswith("INFO ") and builder in line]
    assert not [line for line in on["log"] if "not needed" in line]
    if spec.passes_unguarded:
        assert said == [
            f"INFO vllm-capture-guard: {builder}'s capture, watched: it wrote no "
            "shared host value (size 512)"
        ], on["log"]
    else:
        wrote = [line for line in said if "'s capture wrote " in line]
        assert len(wrote) == 1, on["log"]
        assert wrote[0].endswith(
            "; kept from the other builders (backport of PR #51585)"
        ), wrote
        named = wrote[0].split("'s capture wrote ")[1].split(" (size")[0]
        assert sorted(named.split(", ")) == sorted(spec.wrote), wrote
