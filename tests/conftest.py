# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the test tiers.

The CPU tier runs vLLM's real builders on the CPU. Anything about plugin
loading runs in a *new process where the plugin has never loaded*, the way
vLLM loads plugins in each of its processes: a child forked from a warm
parent (:mod:`tests.warm`), or, where freshness is what is tested
(``fresh=True``), a fresh interpreter. The pytest process itself never loads
the guard through vLLM, and tests that patch in-process undo it
(:func:`unpatched`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from typing import Any

import pytest

from tests import warm
from vllm_capture_guard.tools.simulate import triton_interpreter_env

#: Every process the tests start runs as `check` and `audit` set themselves up
#: on a host without a GPU: Triton on (vLLM decides HAS_TRITON at its import;
#: Model Runner V2 needs it), its kernels in Triton's interpreter. The warm
#: parent imports vLLM that way, and each child's environment says so (Triton
#: reads it as a kernel is defined). The pytest process itself, which drives
#: vLLM's builders in-process and never Model Runner V2, keeps Triton off, as
#: before. On a GPU host this is empty.
TRITON = triton_interpreter_env()
warm._PARENT_ENV.update(TRITON)

GUARD_LOG = "vllm-capture-guard:"


def _has_v1_runner() -> bool:
    """By the runner's file, asked of Python alone (the GPU tier runs these
    tests on an older commit's tools too, for its cost baseline)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    except ImportError:
        return False


#: For tests of the V1 runner's own steps: the installed vLLM must have it
#: (0.34.0 and later have Model Runner V2 only; its counterparts are in
#: tests/runtime/guard/test_model_runner_v2.py).
needs_v1_runner = pytest.mark.skipif(
    not _has_v1_runner(),
    reason="this vLLM has no V1 model runner (vllm/v1/worker/gpu_model_runner.py)",
)


def fresh_env(**overrides: str | None) -> dict[str, str]:
    env = {**os.environ, **TRITON}
    env.setdefault("HF_HUB_OFFLINE", "1")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_fresh(
    args: list[str], timeout: float = 600, *, fresh: bool = False, **env: str | None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a new process where the plugin never loaded (a warm
    child; a fresh interpreter with ``fresh=True``); output captured."""
    return warm.python(args, fresh_env(**env), fresh=fresh, timeout=timeout)


_CLI: dict = {}


def run_cli(
    *args: str, fresh: bool = False, **env: str | None
) -> subprocess.CompletedProcess[str]:
    """``python -m vllm_capture_guard ARGS`` in a new process
    (:func:`run_fresh`), once per session for the same arguments and
    environment: the tests that ask the same of a command share one run."""
    full = fresh_env(**env)
    key = (args, fresh, tuple(sorted(full.items())))
    if key not in _CLI:
        cmd = ["-m", "vllm_capture_guard", *args]
        _CLI[key] = warm.python(cmd, full, fresh=fresh, timeout=600)
    return _CLI[key]


#: Configure vLLM's logging as ``vllm serve`` does before any plugin loads.
#: 0.27-0.29 do it when ``vllm.logger`` is imported; later releases (0.33) do it
#: lazily, in the launcher (``configure_logging_from_args``), so a bare process
#: would drop every INFO line.
LOGGING_AS_VLLM_SERVE = """
try:
    from vllm.logger import configure_logging_from_args as _cfg
except ImportError:
    pass
else:
    import argparse as _argparse
    _cfg(_argparse.Namespace())
"""


def run_snippet(
    code: str, *, fresh: bool = False, **env: str | None
) -> tuple[Any, str]:
    """Run ``code`` in a new process (:func:`run_fresh`); it must print one
    JSON line last. Returns (that JSON, everything the process logged)."""
    proc = run_fresh(["-c", LOGGING_AS_VLLM_SERVE + code], fresh=fresh, **env)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), logs


def guard_lines(logs: str) -> list[str]:
    return [line for line in logs.splitlines() if GUARD_LOG in line]


@pytest.fixture(scope="session")
def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")


@pytest.fixture
def unpatched():
    """Undo whatever the test patched in this process."""
    from vllm_capture_guard.runtime.patches import PATCHES

    yield
    from vllm_capture_guard.tools.revert import revert

    for patch in reversed(PATCHES):
        with contextlib.suppress(Exception):
            revert(patch)


@pytest.fixture(scope="session")
def zeroes_cpu_offsets() -> bool:
    """Does this vLLM's ROCm capture zero the shared CPU offsets? Decided by
    running vLLM's capture in the runner's order, unguarded (this process
    never loads the guard through vLLM), never by the guard's detection."""
    from vllm_capture_guard.tools import harness as sc

    batch = sc.Batch(4)
    return sc.run_capture("ROCM_ATTN", batch).values("query_start_loc_cpu") != (
        batch.offsets()
    )


@pytest.fixture(scope="session")
def aiter_zeroes_offsets() -> bool:
    """Does the builder vLLM's AITER unified backend returns zero the device
    offsets its kernel reads at replay? Decided by running it, unguarded."""
    from vllm_capture_guard.tools import harness as sc

    batch = sc.Batch(4)
    try:
        run = sc.run_capture("ROCM_AITER_UNIFIED_ATTN", batch)
    except Exception as e:  # 0.33's AITER module asks the GPU at import
        pytest.skip(f"AITER unified backend unavailable here: {e}")
    return run.values("query_start_loc") != batch.offsets()


def rocm_capture_writes_cpu_offsets() -> bool:
    """Does this vLLM's own ``ROCM_ATTN`` capture (unguarded: the pytest
    process never loads the guard) write ``query_start_loc_cpu``?"""
    from vllm_capture_guard.tools import harness

    config = harness.make_vllm_config(0)
    builder = harness.attention_builder("ROCM_ATTN", config)
    run = harness.capture([("attention", builder)], harness.Batch(4))
    return "query_start_loc_cpu" in [w.field for w in run.groups[0].writes]


@pytest.fixture(scope="session")
def oracle_record(tmp_path_factory):
    """``(version, mode) -> (record, path)``: the oracle's record of vLLM
    ``version`` with the guard in ``mode``, made once per session and shared
    by the tests that compare against it. This process's own release records
    in a warm child; another release in a fresh interpreter of its own."""
    from importlib.metadata import version as installed

    from vllm_capture_guard.lab import oracle

    folder = tmp_path_factory.mktemp("records")
    done: dict = {}

    def get(version: str, mode: str) -> tuple[dict, str]:
        if (version, mode) not in done:
            out = folder / f"{version}-{mode}.json"
            if version == installed("vllm"):
                args = ["-m", "vllm_capture_guard.lab.oracle", "record"]
                proc = run_fresh([*args, "--out", str(out)], VLLM_CAPTURE_GUARD=mode)
                assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
                record = json.loads(out.read_text())
                assert record["vllm"] == version, record["vllm"]
            else:
                record = oracle.record_in(version, out, mode)
            done[version, mode] = json.dumps(record)
        return json.loads(done[version, mode]), str(folder / f"{version}-{mode}.json")

    return get
