# SPDX-License-Identifier: Apache-2.0
"""The guard on vendor-modified vLLM (ROCm nightly images carry modified
copies of vLLM's attention files).

Each variant (:mod:`tests.variants`) is derived from the installed vLLM at test
time and imported in front of it by a new process. For each one:

* with ``VLLM_CAPTURE_GUARD=off`` the seed capture sequence must FAIL (exit 1,
  vLLM's own ``assert decode_query_len > 0``): decided by running vLLM's
  capture, not by our detection, so it proves the variant is affected;
* with ``VLLM_CAPTURE_GUARD=on`` it must PASS (exit 0) as on 0.29.0: CPU
  offsets bit for bit, ROCM_ATTN's device offsets still zeroed (#25985),
  ROCM_AITER_UNIFIED_ATTN's left alone (PR #53821), and the guard's log must
  not claim "not needed".

``zeroing-only-on-gpu`` writes only when the offsets are on the GPU, so on the
CPU ``check`` passes either way; it runs the same sequence on tensors that
report a CUDA device (:mod:`tests.fake_device`), as a ROCm host would.

Cost: one new process per variant and mode, forked from the warm parent
(:mod:`tests.warm`), plus an overlay check per variant. On releases whose capture leaves
the CPU offsets alone (0.29.0 and later) they skip, with the reason.
"""

from __future__ import annotations

import json
import re
import subprocess
from importlib.metadata import version

import pytest

from tests import variants as vv
from tests import warm
from tests.conftest import LOGGING_AS_VLLM_SERVE, guard_lines
from vllm_capture_guard.tools import harness as sc

APPLIES, WHY = vv.applicability()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not APPLIES, reason=WHY)]

INDEXER_FILE = "vllm/models/minimax_m3/common/indexer.py"
ASSERTION = "assert decode_query_len > 0"
CHECK_VARIANTS = [n for n in vv.VARIANTS if n != "zeroing-only-on-gpu"]


def _overlay(name: str, tmp_path_factory) -> tuple[str, dict[str, str]]:
    try:
        files = vv.derive(name)
    except vv.VariantNotApplicable as e:
        pytest.skip(str(e))
    dest = tmp_path_factory.mktemp(name.replace("+", "-"))
    vv.make_overlay(files, dest)
    vv.verify_overlay(dest, files, version("vllm"))
    return str(dest), files


_overlays: dict[str, tuple[str, dict[str, str]]] = {}


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    """``overlay(name)`` -> (PYTHONPATH entry, derived files), made once."""

    def get(name: str) -> tuple[str, dict[str, str]]:
        if name not in _overlays:
            _overlays[name] = _overlay(name, tmp_path_factory)
        return _overlays[name]

    return get


def _fresh(dest: str, args: list[str], mode: str) -> subprocess.CompletedProcess:
    env = vv.overlay_env(dest)
    env["VLLM_CAPTURE_GUARD"] = mode
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout is the JSON
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # the guard's one line is INFO
    return warm.python(args, env, timeout=600, cwd=vv.ROOT)


_checks: dict[tuple[str, str], tuple[dict, int, str]] = {}


def check(overlay, name: str, mode: str) -> tuple[dict, int, str]:
    """``vllm-capture-guard check --trace`` (every capture size's record, as
    JSON) on variant ``name`` (cached)."""
    key = (name, mode)
    if key not in _checks:
        dest, _ = overlay(name)
        proc = _fresh(dest, ["-m", "vllm_capture_guard", "check", "--trace"], mode)
        logs = proc.stdout + proc.stderr
        assert proc.returncode in (0, 1), logs[-4000:]
        _checks[key] = (json.loads(proc.stdout), proc.returncode, proc.stderr)
    return _checks[key]


def _assert_guard_did_not_wave_through(logs: str, guard: str | None) -> None:
    lines = guard_lines(logs)
    assert lines, "the guard was not loaded (no 'vllm-capture-guard:' line)"
    for line in [*lines, guard or ""]:
        assert "not needed" not in line, line


def _batch(label: str) -> sc.Batch:
    """The batch a ``Batch.label()`` names (``reqs7/pad8xq1``)."""
    reqs, pad, query_len = re.fullmatch(
        r"reqs(\d+)(?:/pad(\d+))?xq(\d+)", label
    ).groups()
    padded = int(pad) if pad else None
    return sc.Batch(int(reqs), query_len=int(query_len), padded_reqs=padded)


def _assert_like_029(run: dict) -> None:
    """One guarded capture sequence, as vLLM 0.29.0 runs it."""
    batch = _batch(run["batch"])
    assert batch.label() == run["batch"]
    label = f"{run['backend']} {batch.label()}"
    assert run["ok"], f"{label}: {run['error']} at {run['error_site']}"
    assert run["decode_query_len"] == batch.query_len, label
    assert run["query_start_loc_cpu_after"] == batch.offsets(), label
    for group in run["groups"]:
        cpu = [w for w in group["writes"] if w["side"] == "cpu"]
        assert cpu == [], f"{label}: {group['builder']} wrote {cpu}"
    if run["backend"] == "ROCM_ATTN":  # the #25985 guard stays (PR #51585)
        assert run["query_start_loc_after"] == [0] * (batch.total_reqs + 1), label
    else:  # its kernel reads the offsets at replay (PR #53821)
        assert run["query_start_loc_after"] == batch.offsets(), label


# --- variants that `check` judges on the CPU ---------------------------------


@pytest.mark.parametrize("name", CHECK_VARIANTS)
def test_variant_is_affected_unguarded(overlay, name):
    """Guard off: vLLM's own capture of the variant breaks the indexer, on
    every backend x batch, with the variant's builders in place."""
    result, rc, _ = check(overlay, name, "off")
    assert result["vllm"] == version("vllm")
    assert "VLLM_CAPTURE_GUARD=off" in result["guard"]
    assert rc == 1
    assert not result["unavailable"], result["unavailable"]
    expected = vv.VARIANTS[name].builders
    assert {r["backend"] for r in result["runs"]} == set(expected)
    for run in result["runs"]:
        label = f"{run['backend']} {run['batch']}"
        assert run["groups"][0]["builder"] == expected[run["backend"]], label
        assert not run["ok"], label
        assert run["error_site"].startswith(INDEXER_FILE + ":"), label
        assert run["error_line"] == ASSERTION, label


@pytest.mark.parametrize("name", CHECK_VARIANTS)
def test_variant_passes_with_guard(overlay, name):
    """Guard on: every capture sequence passes as on 0.29.0, and the guard does
    not call this install "not needed"."""
    result, rc, logs = check(overlay, name, "on")
    assert result["vllm"] == version("vllm")
    _assert_guard_did_not_wave_through(logs, result["guard"])
    assert not result["unavailable"], result["unavailable"]
    # every capture size vLLM derives (512 down to 1), per backend
    assert result["sizes"][0] == 512 and result["sizes"][-1] == 1
    assert len(result["runs"]) == len(sc.seed_backends()) * len(result["sizes"])
    for run in result["runs"]:
        _assert_like_029(run)
    assert rc == 0 and result["ok"]


# --- zeroing only on the GPU: tensors that report a CUDA device ---------------

GPU_ONLY = "zeroing-only-on-gpu"

#: Loads the guard as a worker does (VLLM_CAPTURE_GUARD from the environment),
#: then runs the seed sequence twice per backend x batch: on CPU tensors, and
#: on runner buffers and builders whose device tensors report ``cuda:0``.
DEVICE_RUN = """
import dataclasses, json, torch
import vllm.plugins
vllm.plugins.load_general_plugins()
from tests.fake_device import fake_cuda
from vllm_capture_guard.runtime.plugin import report
from vllm_capture_guard.tools import harness as sc
from vllm_capture_guard.tools.check import seed_record

def device_run(backend, batch):
    config = sc.make_vllm_config(max(batch.query_len - 1, 0))
    with fake_cuda():
        buffers = sc.RunnerBuffers(device="cuda")
        builders = [
            ("attention", sc.attention_builder(backend, config, "cuda")),
            ("indexer", sc.indexer_builder(config, "cuda")),
        ]
        assert buffers.query_start_loc.is_cuda
        assert buffers.query_start_loc.device.type == "cuda"
        assert not buffers.query_start_loc_cpu.is_cuda
        run = sc.capture(builders, batch, buffers=buffers)
    return dataclasses.asdict(seed_record(backend, batch, run))

out = {"cpu": [], "device": []}
for backend in sc.seed_backends():
    for batch in sc.DEFAULT_BATCHES:
        run = sc.run_capture(backend, batch)
        out["cpu"].append(dataclasses.asdict(seed_record(backend, batch, run)))
        out["device"].append(device_run(backend, batch))
out["guard"] = None if report() is None else report().message
out["cuda_initialized"] = torch.cuda.is_initialized()
print(json.dumps(out))
"""

_device_runs: dict[str, tuple[dict, str]] = {}


def device_runs(overlay, mode: str) -> tuple[dict, str]:
    if mode not in _device_runs:
        dest, _ = overlay(GPU_ONLY)
        proc = _fresh(dest, ["-c", LOGGING_AS_VLLM_SERVE + DEVICE_RUN], mode)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["cuda_initialized"] is False
        _device_runs[mode] = (out, proc.stderr)
    return _device_runs[mode]


def test_gpu_only_variant_is_affected_on_gpu_tensors(overlay):
    """Guard off: on CPU tensors the variant writes nothing (so a CPU probe
    and a CPU `check` see a healthy vLLM); on tensors that report a GPU it
    zeroes both offsets and the indexer fails, as it would on a ROCm host."""
    out, _ = device_runs(overlay, "off")
    assert "VLLM_CAPTURE_GUARD=off" in out["guard"]
    for run in out["cpu"]:
        assert run["ok"], run["error"]
        writes = {w["field"] for w in run["groups"][0]["writes"]}
        assert not writes & {"query_start_loc", "query_start_loc_cpu"}, writes
    for run in out["device"]:
        label = f"{run['backend']} {run['batch']}"
        writes = {w["field"] for w in run["groups"][0]["writes"]}
        assert {"query_start_loc", "query_start_loc_cpu"} <= writes, label
        assert not run["ok"], label
        assert run["error_site"].startswith(INDEXER_FILE + ":"), label
        assert run["error_line"] == ASSERTION, label


def test_gpu_only_variant_passes_with_guard(overlay):
    """Guard on: the sequence on GPU-reporting tensors runs as on 0.29.0, and
    the guard does not call this install "not needed"."""
    out, logs = device_runs(overlay, "on")
    _assert_guard_did_not_wave_through(logs, out["guard"])
    assert len(out["device"]) == len(sc.seed_backends()) * len(sc.DEFAULT_BATCHES)
    for run in out["device"]:
        _assert_like_029(run)
