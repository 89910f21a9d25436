# SPDX-License-Identifier: Apache-2.0
"""Our regression test for vLLM's tree, run inside vLLM's own test tree.

``upstream/vllm/tests/v1/attention/test_rocm_capture_shared_metadata.py`` is
laid into the ``tests/v1/attention/`` of each release's sdist (fetched from the
package registry, cached: ``tests/vllm_tree/sdist.py``) and run from that
``tests/`` folder as vLLM's CI runs it, with vLLM's own ``conftest.py`` and
``utils.py`` of that release, against the installed release:

============  =================================================  ========
vLLM          form                                               expected
============  =================================================  ========
0.27.1        stock                                              fails
0.28.0        stock                                              fails
0.27.1        after ``vllm-capture-guard patch --apply --tree``   passes
0.28.0        after ``vllm-capture-guard patch --apply --tree``   passes
0.29.0        stock                                              passes
0.33.0        stock                                              passes
0.28.0        stock, guard loaded (``VLLM_CAPTURE_GUARD=on``,     passes
              ``vllm.plugins.load_general_plugins()``)
============  =================================================  ========

A failing release must fail every test, each on its own check (the indexer's
``assert decode_query_len > 0``, or the kept-offsets check); a passing one
must pass every test; no test may skip or error. The patched form is a copy
of the installed tree (``tests/tools/overlay.py``); the installed release is
never written to. On this CPU host the ROCm gate is answered by
``tests/vllm_tree/plugins/rocm_gate_on_cpu.py``, which also puts vLLM on its
own ``CpuPlatform`` where it detects none.

Marked ``oracle``: it needs the other releases (``make envs``) and the
registry (once; the sdists are cached), and the version matrix runs it once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.tools.overlay import PURELIB, make_overlay, release_base
from tests.vllm_tree import sdist
from tests.vllm_tree.plugins.load_vllm_plugins import REPORT

pytestmark = pytest.mark.oracle

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"
NAME = "test_rocm_capture_shared_metadata.py"
OURS = ROOT / "upstream" / "vllm" / "tests" / "v1" / "attention" / NAME
#: Where it sits in vLLM's tree, relative to ``tests/`` (the CI's working dir).
IN_TREE = f"v1/attention/{NAME}"

#: 4 batch specs x (ROCM_ATTN capture; 2 backends then the indexer; AITER).
EXPECTED_TESTS = 16
#: What each test of ours fails on where the bug is, as the traceback shows it.
FAILS_ON = {
    "test_rocm_attn_capture_keeps_host_query_start_loc": (
        "assert torch.equal(common.query_start_loc_cpu, expected_cpu)"
    ),
    "test_minimax_m3_indexer_builds_after_rocm_capture": (
        "assert decode_query_len > 0"
    ),
    "test_aiter_unified_capture_leaves_query_start_loc": (
        "assert torch.equal(common.query_start_loc, expected)"
    ),
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    version: str
    form: str  # "stock", "patched" (in-tree patch) or "guard" (plugin loaded)
    passes: bool

    @property
    def id(self) -> str:
        return f"{self.version}-{self.form}"


SCENARIOS = (
    Scenario("0.27.1", "stock", False),
    Scenario("0.28.0", "stock", False),
    Scenario("0.27.1", "patched", True),
    Scenario("0.28.0", "patched", True),
    Scenario("0.29.0", "stock", True),
    Scenario("0.33.0", "stock", True),
    Scenario("0.28.0", "guard", True),
)


@dataclasses.dataclass
class Run:
    scenario: Scenario
    rc: int
    output: str
    cases: dict[str, tuple[str, str]]  # test id -> (outcome, failure text)
    seconds: float


def _cases(xml: Path) -> dict[str, tuple[str, str]]:
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, text = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                text = f"{found.get('message', '')}\n{found.text or ''}"
                break
        out[case.get("name")] = (outcome, text)
    return out


def _run(scenario: Scenario, tree: Path, work: Path) -> Run:
    base = release_base(scenario.version)
    path = [base] if base != PURELIB else []
    if scenario.form == "patched":
        overlay = make_overlay(base, work / "overlay")
        applied = subprocess.run(
            [sys.executable, "-m", "vllm_capture_guard", "patch", "--apply"]
            + ["--tree", str(overlay)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert applied.returncode == 0, applied.stdout + applied.stderr
        path.insert(0, overlay)
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env.update(
        PYTHONPATH=os.pathsep.join(str(p) for p in [*path, PLUGINS]),
        HF_HUB_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
        CAPTURE_GUARD_GATED_TEST=IN_TREE,
        VLLM_CAPTURE_GUARD="on" if scenario.form == "guard" else "off",
    )
    xml = work / "junit.xml"
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    args += ["-p", "rocm_gate_on_cpu"]
    if scenario.form == "guard":
        args += ["-p", "load_vllm_plugins"]
    args += ["-q", "--tb=short", f"--junitxml={xml}", IN_TREE]
    start = time.monotonic()
    proc = subprocess.run(
        args,
        cwd=tree / "tests",
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = proc.stdout + proc.stderr
    cases = _cases(xml) if xml.is_file() else {}
    return Run(scenario, proc.returncode, output, cases, time.monotonic() - start)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    for s in SCENARIOS:
        if release_base(s.version) is None:
            pytest.fail(f"vLLM {s.version} is not installed here (make envs)")
    trees = {}
    for version in sorted({s.version for s in SCENARIOS}):
        tree = sdist.extract_tests(version, tmp_path_factory.mktemp(f"vllm-{version}"))
        shutil.copyfile(OURS, tree / "tests" / IN_TREE)
        trees[version] = tree
    # two at a time: each run is one interpreter importing vLLM
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            s.id: pool.submit(_run, s, trees[s.version], tmp_path_factory.mktemp(s.id))
            for s in SCENARIOS
        }
        found = {key: f.result() for key, f in futures.items()}
    lines = [
        f"{r.scenario.id}: rc {r.rc}, "
        + ", ".join(
            f"{n} {o}"
            for o in ("passed", "failed", "error", "skipped")
            if (n := sum(v[0] == o for v in r.cases.values()))
        )
        + f" ({r.seconds:.0f} s)"
        for r in found.values()
    ]
    print("\nvLLM's tree, our test:\n" + "\n".join(lines))
    return found


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_outcome_in_vllms_own_tree(runs, scenario):
    run = runs[scenario.id]
    tail = run.output[-6000:]
    assert len(run.cases) == EXPECTED_TESTS, tail
    outcomes = {outcome for outcome, _ in run.cases.values()}
    if scenario.passes:
        assert outcomes == {"passed"}, tail
        assert run.rc == 0, tail
        return
    # affected: every test fails, each on its own check; nothing skips
    assert outcomes == {"failed"}, tail
    assert run.rc == 1, tail
    for name, (_, text) in run.cases.items():
        check = FAILS_ON[name.split("[")[0]]
        assert check in text, f"{name} failed on something else:\n{text[-3000:]}"


def test_the_gate_was_answered_only_on_the_cpu(runs):
    """The tests ran on vLLM's CPU platform with the gate answered; the GPU
    architecture query was answered on 0.33 (whose AITER backend imports
    ``vllm.platforms.rocm``) and nowhere else."""
    for key, run in runs.items():
        assert "rocm_gate_on_cpu: platform CpuPlatform" in run.output, key
        answered = "the GPU architecture query of vllm.platforms.rocm answered" in (
            run.output
        )
        assert answered == (run.scenario.version == "0.33.0"), key


def test_the_guard_acted_where_it_was_loaded(runs):
    for key, run in runs.items():
        reports = [line for line in run.output.splitlines() if REPORT in line]
        if run.scenario.form != "guard":
            assert not reports, key
            continue
        (line,) = reports
        found = json.loads(line.split(REPORT, 1)[1])
        assert found.get("outcomes"), line
        assert set(found["outcomes"].values()) == {"patched"}, line
