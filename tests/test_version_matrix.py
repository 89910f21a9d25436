# SPDX-License-Identifier: Apache-2.0
"""What the version matrix does besides running the suite.

Its warm-up (``scripts/version_matrix.py --warm``, in each release before the
jobs start) fills vLLM's model-info cache of that release in one process,
where vLLM would start a subprocess that imports vLLM again for each model
class. What it writes must be what vLLM writes: the processes of every job
read it as vLLM's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_fresh

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
#: The config ``check`` builds: vLLM inspects its model class (MiniMax-M3).
BUILD = (
    "from vllm_capture_guard.tools.harness import make_vllm_config; "
    "make_vllm_config(0, graphs=True)"
)


def _cached(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / "modelinfos").glob("*.json")}


def test_the_warmed_model_info_cache_is_what_vllm_writes(tmp_path):
    theirs, ours = tmp_path / "vllm", tmp_path / "warmed"
    proc = run_fresh(["-c", BUILD], VLLM_CACHE_ROOT=str(theirs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_fresh(
        [str(ROOT / "scripts" / "version_matrix.py"), "--warm"],
        VLLM_CACHE_ROOT=str(ours),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    # a family this release lacks is said, not fatal (DeepSeek-V4.1 on 0.28.0)
    assert "minimax_m3/0" in found["warmed"] and "rocm-tier" in found["warmed"]
    wrote = _cached(theirs)
    assert any("MiniMaxM3" in name for name in wrote), sorted(wrote)
    warmed = _cached(ours)
    assert {name: warmed.get(name) for name in wrote} == wrote


def test_a_process_of_each_release_gets_that_releases_vllm_cache(monkeypatch, tmp_path):
    """Where the matrix names a folder of caches, a process started against
    release X gets X's (vLLM's model-info files are one per class, whatever
    the release); a cache the caller names wins; without the folder, a
    process keeps what it inherits."""
    from vllm_capture_guard.tools.oracle import releases

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "the-callers"))
    monkeypatch.setenv(releases.CACHES_VAR, str(tmp_path))
    env = releases.env_for("0.27.1")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-0.27.1")
    named = releases.env_for("0.27.1", {"VLLM_CACHE_ROOT": "named"})
    assert named["VLLM_CACHE_ROOT"] == "named"
    monkeypatch.delenv(releases.CACHES_VAR)
    assert releases.env_for("0.27.1")["VLLM_CACHE_ROOT"] == str(
        tmp_path / "the-callers"
    )
