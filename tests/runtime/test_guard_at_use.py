# SPDX-License-Identifier: Apache-2.0
"""The guard at use, on captures derived at test time
(:mod:`tests.runtime.at_use`), through vLLM's own start-up on the CPU, with
MiniMax-M3's indexer in the other KV-cache group, on every GPU model runner
the installed vLLM has (by its files):

* the V1 runner (:mod:`tests.runtime.cpu_runner`): ``profile_cudagraph_memory``
  (builders made inside it, its two largest sizes captured),
  ``initialize_kv_cache``, ``capture_model`` at every size vLLM derives (51,
  512 down to 1), and a serving-time ``execute_dummy_batch``;
* Model Runner V2 (:mod:`tests.runtime.v2_runner`, the only runner from
  0.34.0 on, ``VLLM_USE_V2_MODEL_RUNNER=1`` before): its own
  ``profile_cudagraph_memory`` where the worker runs it (it captures where
  the release profiles by capturing, and builds nothing where it answers
  0), the engine core's ``initialize_kv_cache``, its own ``capture_model`` at
  every FULL descriptor of its ``CudaGraphManager`` (51), and vLLM's
  worker's ``execute_dummy_batch``. Every case has its counterpart here: a
  vendor's subclass of Model Runner V2's runner, and a vendor's fork of the
  module its model state builds the metadata through (``attn_utils``).

Two processes per runner, loaded through vLLM's plugin loader, run every
case: with the guard off each case must fail as vLLM fails (the indexer's
``assert decode_query_len > 0``, at the first step whose capture the hazard
reaches), with it on it must get through every step, its builder captured at
every size, and the guard must say once what the capture wrote. A capture
that sizes a workspace on its first call passes both ways: the guard runs
nothing of vLLM's. A host view with a neutral name is kept where the device
fields are on a GPU (by where it lives), and where everything is on the CPU
because its memory is the named host offsets'.

Stubs, in those processes only: for the V1 runner (``cpu_runner``) streams
and events, device synchronisation, memory queries, compute-unit count,
pinned host memory and the model's forward; for Model Runner V2, vLLM's own
CPU set-up (``vllm.v1.worker.cpu.shm``), ``torch.cuda.graph`` recorded, and
the harness model's forward.
"""

from __future__ import annotations

import json
import os

import pytest

from tests import variants as vv
from tests import warm
from tests.conftest import fresh_env
from tests.runtime import at_use
from vllm_capture_guard.tools.harness import runners

INDEXER = "vllm/models/minimax_m3/common/indexer.py:"
STEPS = ["profile_cudagraph_memory", "initialize_kv_cache", "capture_model",
         "execute_dummy_batch"]  # fmt: skip
#: Where the hazard first reaches the indexer with the guard off, where that
#: is not the first step that captures.
FAILS_AT = {"dummy-batch": "execute_dummy_batch"}
#: The runners this vLLM has (by its files).
PRESENT = [r for r in (runners.V1, runners.V2) if runners.present(r)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{(runner, mode): its process's JSON}``: all started at once."""
    folder = at_use.write(tmp_path_factory.mktemp("at-use"))
    path = os.pathsep.join(
        p for p in (str(folder), str(vv.ROOT), os.environ.get("PYTHONPATH")) if p
    )  # the release under test stays on the path (vLLM's own subprocesses)
    handles = {
        (runner, mode): warm.start(
            ["-m", "tests.runtime.at_use_run", runner],
            fresh_env(
                PYTHONPATH=path, VLLM_CAPTURE_GUARD=mode, VLLM_LOGGING_LEVEL="INFO"
            ),
            cwd=vv.ROOT,
        )
        for runner in PRESENT
        for mode in ("off", "on")
    }
    out = {}
    for key, handle in handles.items():
        proc = handle.wait(900)
        assert proc.returncode == 0, (key, proc.stderr[-4000:])
        out[key] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _failed(run: dict) -> dict | None:
    return next((s for s in run["steps"] if s["error"]), None)


def _through_start_up(runner: str, case: str, runs: dict) -> tuple[dict, str]:
    """What every runner must show for ``case``: unguarded it fails (or not)
    as vLLM does, guarded it gets through every step at every size and the
    guard's log names what the capture wrote. Returns the guarded run of the
    case, and its builder's class."""
    spec = at_use.CASES[case]
    off, on = runs[runner, "off"]["cases"][case], runs[runner, "on"]["cases"][case]
    sizes = runs[runner, "on"]["sizes"]
    assert sizes == 51, sizes  # the runner's own capture sizes, 512 down to 1
    failed = _failed(off)
    first = FAILS_AT.get(case) or next(
        (s["name"] for s in on["steps"] if s.get("builds", 1)), None
    )  # the first step that builds metadata for capture (V1: all of them)
    if spec.passes_unguarded:
        assert failed is None, failed
    else:
        assert failed is not None, f"{case}: the unguarded start-up did not fail"
        assert failed["name"] == first, failed
        assert failed["error"] == "AssertionError", failed
        assert failed["site"].startswith(INDEXER), failed
    assert _failed(on) is None, _failed(on)
    assert [s["name"] for s in on["steps"]] == STEPS
    assert spec.device is False or on["device"] == "DeviceTensor"
    if spec.metadata:  # the runner really made its metadata slotted, both ways
        assert off["slotted_made"] and on["slotted_made"], (off, on)
    builder = next(b for b in on["builders"] if b.startswith("Case"))
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
    return on, builder


def _has(runner: str) -> pytest.MarkDecorator:
    why = f"this vLLM has no {runners.FILES[runner]} ({runners.NAMES[runner]})"
    return pytest.mark.skipif(not runners.present(runner), reason=why)


EVERY_CASE = pytest.mark.parametrize("case", list(at_use.CASES))


@_has(runners.V1)
@EVERY_CASE
def test_case_through_vllms_start_up(case, runs):
    """The V1 runner."""
    on, builder = _through_start_up(runners.V1, case, runs)
    # profiling's two sizes, capture_model's 51, the dummy batch
    assert on["calls"][builder] == 2 + 51 + 1, on["calls"]


@_has(runners.V2)
@EVERY_CASE
def test_case_through_model_runner_v2(case, runs):
    """Model Runner V2: profiling captures what it captures (the builds
    counted at the model state), capture_model every descriptor."""
    on, builder = _through_start_up(runners.V2, case, runs)
    assert on["descriptors"] == on["reached"] == 51, on
    builds = {s["name"]: s["builds"] for s in on["steps"]}
    assert builds["capture_model"] >= 51, builds  # warm-up and capture
    assert builds["execute_dummy_batch"] == 1, builds
    # every metadata build for capture, read at the model state, was guarded
    assert on["calls"][builder] == sum(builds.values()), (on["calls"], builds)
