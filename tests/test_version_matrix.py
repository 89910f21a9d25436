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
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_fresh

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
MATRIX = str(ROOT / "scripts" / "version_matrix.py")


def _warm(flag: str, root: Path) -> dict:
    proc = run_fresh([MATRIX, flag], VLLM_CACHE_ROOT=str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cached(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / "modelinfos").glob("*.json")}


def test_the_warmed_model_info_cache_is_what_vllm_writes(tmp_path):
    """The same tiny models' configs, once with vLLM inspecting each class in
    its own subprocess (vLLM's way), once in the warming process: the same
    files, byte for byte, for every class."""
    theirs, ours = tmp_path / "vllm", tmp_path / "warmed"
    as_vllm = _warm("--warm-as-vllm", theirs)
    warmed = _warm("--warm", ours)
    # a family this release lacks is said, not fatal (DeepSeek-V4.1 on 0.28.0)
    assert warmed == as_vllm
    assert {"minimax_m3", "rocm-tier"} <= set(warmed["warmed"]), warmed
    wrote = _cached(theirs)
    # one file a class (DeepSeek-V3.2's architecture may map to V3's class)
    for cls in ("MiniMaxM3SparseForCausalLM", "DeepseekV3ForCausalLM"):
        assert any(cls in name for name in wrote), sorted(wrote)
    assert _cached(ours) == wrote


def test_a_process_of_each_release_gets_that_releases_vllm_cache(monkeypatch, tmp_path):
    """Where the matrix names a folder of caches, a process started against
    release X gets X's (vLLM's model-info files are one per class, whatever
    the release), by each way the tools and tests start one; the venv's own
    release where no folder of X's is there; a cache the caller names wins;
    without the folder, a process keeps what it inherits."""
    from tests.tools.overlay import PURELIB, overlay_env
    from vllm_capture_guard.lab.oracle import releases

    own = releases.own_version()
    assert (PURELIB / f"vllm-{own}.dist-info").is_dir()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "the-callers"))
    monkeypatch.setenv(releases.CACHES_VAR, str(tmp_path))
    envs = tmp_path / "envs"
    (envs / "vllm-0.27.1").mkdir(parents=True)
    env = releases.env_for("0.27.1", envs=envs)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-0.27.1")
    for asked in (None, "0.0.1"):  # the venv's own vLLM runs
        env = releases.env_for(asked, envs=envs)
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / f"vllm-{own}")
    named = releases.env_for("0.27.1", {"VLLM_CACHE_ROOT": "named"}, envs=envs)
    assert named["VLLM_CACHE_ROOT"] == "named"
    env = overlay_env(tmp_path / "overlay", PURELIB)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / f"vllm-{own}")
    proc = subprocess.run(
        [ROOT / "scripts" / "with-vllm.sh", sys.executable, envs, own, "env"],
        env={**os.environ, "PYTHONPATH": ""},
        capture_output=True,
        text=True,
    )
    assert f"VLLM_CACHE_ROOT={tmp_path / f'vllm-{own}'}\n" in proc.stdout, proc
    monkeypatch.delenv(releases.CACHES_VAR)
    env = releases.env_for("0.27.1", envs=envs)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "the-callers")


def _matrix_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("version_matrix", MATRIX)
    module = importlib.util.module_from_spec(spec)
    sys.modules["version_matrix"] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


def _facts(version: str, fails: bool) -> dict:
    """What ``--facts`` reports, in the shape the table is rendered from."""
    capture = {"ok": 0 if fails else 6, "runs": 6, "errors": []}
    if fails:
        capture["errors"] = [
            "AssertionError in vllm/models/minimax_m3/common/indexer.py"
        ]
    return {
        "vllm": version,
        "runner": ["the V1 model runner", "vLLM's choice"],
        "backends": ["ROCM_ATTN"],
        "unguarded": {"ROCM_ATTN": capture},
        "read": {"graph-capture-stream": [{"where": "capture", "needed": fails}]},
        "patches": ["builder-capture-guard", "graph-capture-stream"],
        "read_only": ["graph-capture-stream"],
        "guard_action": "patched",
        "outcomes": {"builder-capture-guard": ["patched", "every builder"]},
        "wrote": {"RocmAttentionMetadataBuilder": {"query_start_loc_cpu": 512}},
        "guarded": {"ROCM_ATTN": {"ok": 6, "runs": 6, "errors": []}},
        "in_tree": {"verdict": "applies", "fixes": {"rocm-attn-cpu-offsets": "needed"}},
    }


def test_the_version_table_is_written_and_checked_in_its_docs_page(tmp_path):
    """``--write`` puts the table between the markers of docs/version-matrix.md
    (the README holds none); ``--check`` compares that table alone (a new
    timing elsewhere on the page is no difference) and finds a changed cell."""
    vm = _matrix_module()
    assert vm.DOC == ROOT / "docs" / "version-matrix.md"
    assert not hasattr(vm, "README"), "the version matrix still writes the README"
    readme = (ROOT / "README.md").read_text()
    assert vm.START not in readme and vm.END not in readme
    committed = vm.DOC.read_text()
    assert committed.count(vm.START) == committed.count(vm.END) == 1
    table = committed.split(vm.START, 1)[1].split(vm.END, 1)[0]
    assert [v for v in vm.VERSIONS if f"\n| {v} | " in table] == list(vm.VERSIONS)

    tests = {"passed": 1, "failed": 0, "skipped": 0, "seconds": 1, "skips": {}}
    results = {
        v: {"facts": _facts(v, fails), "tests": tests}
        for v, fails in (("0.28.0", True), ("0.29.0", False))
    }
    section = vm.table_section(results)
    page = tmp_path / "version-matrix.md"
    page.write_text(vm.doc(results, {}, section, total=10, cpu=20))
    assert vm.stale_table(section, page) == []
    page.write_text(page.read_text().replace("10 s wall", "11 s wall"))
    assert vm.stale_table(section, page) == [], "a timing is no table difference"
    results["0.29.0"]["facts"]["guard_action"] = "not needed"
    diff = "".join(vm.stale_table(vm.table_section(results), page))
    assert "| 0.29.0 |" in diff and "not needed" in diff
    page.write_text("no table here\n")
    with pytest.raises(SystemExit, match="markers"):
        vm.stale_table(section, page)
