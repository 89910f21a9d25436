# SPDX-License-Identifier: Apache-2.0
"""The ROCm tier: vLLM's engine starts and generates with the guard installed.

For each attention backend (ROCM_ATTN, ROCM_AITER_UNIFIED_ATTN), full-graph
capture mode (FULL_AND_PIECEWISE, FULL_DECODE_ONLY) and tensor-parallel size
(1, and 4 where four GPUs exist), one engine starts on the tiny random-weight
MiniMax-M3 of :mod:`tests.rocm.tiny_model` and generates from token-id
prompts (:mod:`tests.rocm.engine_run`, one fresh process per engine).

* ``test_engine_starts_with_guard``: the guard as a user gets it (installed,
  ``VLLM_CAPTURE_GUARD`` unset, i.e. ``auto``). Startup and generation must
  succeed, and the guard must have logged that it patched this vLLM (or that
  this vLLM does not need it).
* ``test_guard_off_control``: the same engine with ``VLLM_CAPTURE_GUARD=off``.
  On an affected vLLM it must die at startup with vLLM's own
  ``assert decode_query_len > 0`` and ``EngineCore failed to start``; this is
  what shows that the first test exercises the bug and cannot pass by
  accident. On a vLLM that is not affected it must start.

"Affected" is decided by running vLLM's own ROCm capture and the MiniMax-M3
indexer on shared buffers, on the CPU, in a process with no guard loaded
(``engine_run.py --host-info``), never by asking the guard.

Everything skips, with the reason, on a host that is not a ROCm GPU host. No
module-level import touches torch or vLLM, so CPU collection is cheap.

Environment: ``CAPTURE_GUARD_ENGINE_TIMEOUT_S`` (default 900) limits each
engine process; the whole process group is killed when it runs over.
``CAPTURE_GUARD_REQUIRE_GPUS=N`` (CI sets it) turns every skip for a missing
ROCm host or fewer than N GPUs into a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import fresh_env, guard_lines
from tests.rocm import engine_run
from tests.rocm.tiny_model import write_engine_model

ROOT = Path(__file__).resolve().parents[2]
TP_SIZES = (1, 4)
STARTUP_FAILURE = "assert decode_query_len > 0"
ENGINE_FAILED = ("EngineCore failed to start", "Engine core initialization failed")
#: Set by CI: the agent must be a ROCm host with this many GPUs (no skipping).
REQUIRE_GPUS = "CAPTURE_GUARD_REQUIRE_GPUS"

pytestmark = [pytest.mark.rocm, pytest.mark.slow]

_params = pytest.mark.parametrize(
    "backend, cudagraph_mode, tp",
    [
        pytest.param(b, m, tp, id=f"{b}-{m}-tp{tp}")
        for tp in TP_SIZES
        for b in engine_run.BACKENDS
        for m in engine_run.CUDAGRAPH_MODES
    ],
)


def _timeout() -> float:
    return float(os.environ.get("CAPTURE_GUARD_ENGINE_TIMEOUT_S", "900"))


def _run(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, bool]:
    """``python ARGS`` from the repository root in its own process group;
    stdout and stderr together. On timeout, and in any case afterwards, the
    group (engine core, workers) is killed. Returns (status, output, timed out)."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, timed_out


def _last_json(output: str, prefix: str) -> Any:
    lines = [ln for ln in output.splitlines() if ln.startswith(prefix)]
    return json.loads(lines[-1][len(prefix) :]) if lines else None


@dataclasses.dataclass(frozen=True)
class Host:
    info: dict[str, Any]

    @property
    def gpus(self) -> int:
        return int(self.info["gpus"])

    @property
    def affected(self) -> bool:
        return bool(self.info["capture"]["affected"])

    def require_gpus(self, n: int) -> None:
        if self.gpus < n:
            skip_or_fail(
                f"needs {n} GPUs for --tensor-parallel-size {n}; "
                f"this host has {self.gpus}",
                n,
            )


@functools.lru_cache(maxsize=1)
def _probe_host() -> tuple[Host | None, str]:
    """(host, "") on a usable ROCm GPU host, else (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"not a ROCm host: torch is not importable ({e})"
    if torch.version.hip is None:
        return None, (
            f"not a ROCm host: torch.version.hip is None (torch {torch.__version__})"
        )
    code, out, timed_out = _run(
        ["-m", "tests.rocm.engine_run", "--host-info"],
        fresh_env(VLLM_CAPTURE_GUARD="off"),
        timeout=300,
    )
    info = _last_json(out, engine_run.HOST_PREFIX)
    if code != 0 or info is None:
        pytest.fail(
            f"could not inspect this ROCm host (status {code}, timed out "
            f"{timed_out}):\n{out[-4000:]}"
        )
    if not info["gpus"]:
        return None, (
            f"ROCm torch {info['torch']} (HIP {info['hip']}) but no GPU is "
            "visible (torch.cuda.device_count() == 0)"
        )
    if info["entry_point"] != "vllm_capture_guard.runtime.plugin:register":
        pytest.fail(
            "vllm-capture-guard is not installed as a vLLM plugin in this "
            "environment (no 'capture_guard' entry point in group "
            f"vllm.general_plugins; found {info['entry_point']!r}). Run "
            "`pip install -e .` from the repository root first."
        )
    if not isinstance(info.get("capture", {}).get("affected"), bool):
        pytest.fail(f"cannot tell whether this vLLM is affected: {info}")
    return Host(info), ""


def skip_or_fail(why: str, gpus: int = 1) -> None:
    """Skip, unless ``CAPTURE_GUARD_REQUIRE_GPUS`` says this host must have
    ROCm and at least ``gpus`` GPUs: then a skip would hide a broken CI
    agent, so fail."""
    required = os.environ.get(REQUIRE_GPUS, "").strip()
    if required and int(required) >= gpus:
        pytest.fail(f"{REQUIRE_GPUS}={required}, but {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def rocm_host() -> Host:
    host, why = _probe_host()
    if host is None:
        skip_or_fail(why)
    print(f"\nROCm host: {json.dumps(host.info)}")
    return host


@dataclasses.dataclass
class EngineRun:
    returncode: int
    logs: str
    timed_out: bool
    result: dict[str, Any] | None
    log_file: Path

    def tail(self, n: int = 6000) -> str:
        return (
            f"exit status {self.returncode}, timed out {self.timed_out}, "
            f"full log {self.log_file}; last output:\n{self.logs[-n:]}"
        )


def start_engine(
    tmp_path: Path, backend: str, cudagraph_mode: str, tp: int, guard: str | None
) -> EngineRun:
    """One engine in a fresh process; ``guard`` is ``VLLM_CAPTURE_GUARD``
    (None: unset, the default ``auto``)."""
    model_dir = write_engine_model(tmp_path / "model", tp)
    env = fresh_env(
        VLLM_CAPTURE_GUARD=guard,
        # An allowlist that left the guard out would silently disable it.
        VLLM_PLUGINS=None,
        # The guard's one INFO line per process is part of what is checked.
        VLLM_LOGGING_LEVEL="INFO",
        VLLM_CONFIGURE_LOGGING=None,
    )
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    args = [
        "-m",
        "tests.rocm.engine_run",
        "--model-dir",
        str(model_dir),
        "--backend",
        backend,
        "--cudagraph-mode",
        cudagraph_mode,
        "--tp",
        str(tp),
    ]
    code, out, timed_out = _run(args, env, _timeout())
    log_file = tmp_path / "engine.log"
    log_file.write_text(out)
    result = _last_json(out, engine_run.RESULT_PREFIX)
    return EngineRun(code, out, timed_out, result, log_file)


@_params
def test_engine_starts_with_guard(rocm_host, tmp_path, backend, cudagraph_mode, tp):
    rocm_host.require_gpus(tp)
    run = start_engine(tmp_path, backend, cudagraph_mode, tp, guard=None)
    assert run.returncode == 0 and run.result is not None, run.tail()

    outputs = run.result["outputs"]
    assert len(outputs) == len(engine_run.PROMPTS), run.result
    for tokens in outputs:
        assert len(tokens) == engine_run.MAX_TOKENS, run.result
        assert all(0 <= t < engine_run.VOCAB for t in tokens), run.result

    lines = guard_lines(run.logs)
    assert lines, "the guard logged nothing: not loaded as a vLLM plugin\n" + run.tail()
    assert not [ln for ln in lines if "could not" in ln or "failed" in ln], lines
    expected = "patched" if rocm_host.affected else "not needed"
    assert any(f": {expected} (" in ln for ln in lines), (expected, lines)
    guard = run.result["guard"]  # what the plugin did in the LLM's own process
    assert guard and guard["action"] == expected, run.result
    print(
        f"\n{backend} {cudagraph_mode} tp{tp}: started in "
        f"{run.result['startup_s']} s, generated {outputs}"
    )


@_params
def test_guard_off_control(rocm_host, tmp_path, backend, cudagraph_mode, tp):
    rocm_host.require_gpus(tp)
    run = start_engine(tmp_path, backend, cudagraph_mode, tp, guard="off")
    lines = guard_lines(run.logs)
    assert any("VLLM_CAPTURE_GUARD=off" in ln for ln in lines), (
        "the guard did not report itself switched off\n" + run.tail()
    )
    if rocm_host.affected:
        assert not run.timed_out, run.tail()
        assert run.returncode != 0 and run.result is None, (
            "startup succeeded without the guard on a vLLM whose ROCm capture "
            f"zeroes query_start_loc_cpu ({rocm_host.info['capture']}): this "
            "engine does not exercise the bug\n" + run.tail()
        )
        assert STARTUP_FAILURE in run.logs, run.tail()
        assert any(msg in run.logs for msg in ENGINE_FAILED), run.tail()
        print(
            f"\n{backend} {cudagraph_mode} tp{tp} without the guard: startup "
            f"failed as on an unguarded install ({STARTUP_FAILURE!r})"
        )
    else:
        assert run.returncode == 0 and run.result is not None, (
            f"vLLM {rocm_host.info['vllm']} is not affected "
            f"({rocm_host.info['capture']}) but did not start without the "
            "guard\n" + run.tail()
        )
