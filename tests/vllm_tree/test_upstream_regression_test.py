# SPDX-License-Identifier: Apache-2.0
"""Our two tests for vLLM's tree, run inside vLLM's own test tree.

``upstream/vllm/tests/v1/attention/`` holds them:

* ``test_rocm_capture_shared_metadata.py``, the *instance* test (ROCm-gated):
  each ROCm backend's capture, then MiniMax-M3's indexer, on shared metadata;
* ``test_capture_keeps_host_metadata.py``, the *generic* test (not gated):
  every registered backend that can be built here, from the tiny model its
  family serves (MiniMax-M3, DeepSeek-V3, V3.2, V4, V4.1), its capture on
  one shared metadata must leave the host values unchanged.

Both are laid into the ``tests/v1/attention/`` of each release's sdist
(fetched from the package registry, cached: ``tests/vllm_tree/sdist.py``) and
run from that ``tests/`` folder in ONE pytest process per tree, as vLLM's CI
runs them, with that release's own ``conftest.py`` and ``utils.py``, against
the installed release, on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``),
with Triton's interpreter (``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES``
empty, so that vLLM keeps Triton with no GPU driver): the sparse MLA and
DeepSeek-V4 builders launch a Triton kernel in their capture, which then
really runs:

==========  ====================================  ========  =====================
vLLM        form                                  instance  generic fails on
==========  ====================================  ========  =====================
0.27.1      stock                                 fails     ROCM_ATTN,
                                                            ROCM_AITER_UNIFIED_ATTN
0.28.0      stock                                 fails     the same
0.28.0      after ``patch --apply --tree``, and   passes    ROCM_COPY_ATTN
            one new backend whose capture is
            0.28.0's own before the patch
            (``ROCM_COPY_ATTN``,
            ``tests/vllm_tree/copied_backend.py``)
0.29.0      stock                                 passes    nothing
0.33.0      stock                                 passes    nothing
0.28.0      stock, vLLM's general plugins loaded  passes    nothing
            (``VLLM_CAPTURE_GUARD=on``)
==========  ====================================  ========  =====================

A failing instance run fails every test, each on its own check; a failing
generic run fails exactly on those backends, each naming
``query_start_loc_cpu``; nothing errors. A skip is a backend never captured
in a full graph, or one that cannot be built or captured here, whose reason
names what it needs (told by the audit's causes: a placeholder, a compiled
extension, hardware or a package); each release's tree skips no more than
it did when measured (:data:`SKIPS_AT_MOST`; 0.33.0: 19 of 56) and captures
every family it has (:data:`FAMILIES`). On the
four stock releases the same process then runs the audit
(``tests/vllm_tree/plugins/audit_in_tree.py``): its built backends and its
verdicts must be the generic test's. The patched form and the new backend are
in a copy of the installed tree (``tests/tools/overlay.py``); the installed
releases are never written to. The new backend rides on the patched 0.28.0
(the in-tree patch fixes the ROCm builders, as upstream did; it never saw the
new one), which saves one fresh vLLM import: the instance test passes there
and only the generic test sees the copy. The patched form runs on 0.28.0
alone, which saves another run for the wider generic test: 0.27.1's
``rocm_attn.py`` is 0.28.0's, and a patched copy of 0.27.1 is the in-tree
tool's own test (``tests/tools/test_tree_releases.py``: it passes with the
guard off, its AITER builder writes no offsets, it matches 0.29.0). On this
CPU host ``tests/vllm_tree/plugins/rocm_gate_on_cpu.py`` answers the
instance test's ROCm gate and puts vLLM on its own ``CpuPlatform`` where it
detects none (0.27.1).

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
from tests.vllm_tree import copied_backend, sdist
from tests.vllm_tree.plugins.load_vllm_plugins import REPORT
from vllm_capture_guard.lab.oracle import releases
from vllm_capture_guard.tools.audit.causes import Cause, classify

pytestmark = pytest.mark.oracle

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"
OURS = ROOT / "upstream" / "vllm" / "tests" / "v1" / "attention"
INSTANCE = "test_rocm_capture_shared_metadata.py"
GENERIC = "test_capture_keeps_host_metadata.py"
#: Where they sit in vLLM's tree, relative to ``tests/`` (the CI's working dir).
IN_TREE = [f"v1/attention/{INSTANCE}", f"v1/attention/{GENERIC}"]

#: 4 batch specs x (ROCM_ATTN capture; 2 backends then the indexer; AITER).
INSTANCE_TESTS = 16
#: What each instance test fails on where the bug is, as the traceback shows it.
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
ROCM = frozenset({"ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"})
#: The host field that the pre-#51585 capture zeroes.
HOST_FIELD = "query_start_loc_cpu"
#: The audit's verdicts for a backend whose capture ran and wrote no host field.
NO_HOST_WRITE = {"clean", "capture-time only", "contained"}
#: The generic test's skip for a backend whose builder is never captured.
NEVER = "never captured in a full graph"
#: The most backends the generic test skips in each release's tree, as
#: measured on a CPU host with the project's CPU environment (every form of a
#: release builds the same backends, as tested below).
SKIPS_AT_MOST = {"0.27.1": 25, "0.28.0": 22, "0.29.0": 17, "0.33.0": 19}
_ALL_FAMILIES = {"minimax_m3", "deepseek_v3", "deepseek_v32", "deepseek_v4"}
#: The families whose backends the generic test captures in each release
#: (0.27 and 0.28 have no CPU prefill for the MLA layers; V4.1 is 0.33's).
FAMILIES = {
    "0.27.1": {"minimax_m3"},
    "0.28.0": {"minimax_m3", "deepseek_v4"},
    "0.29.0": _ALL_FAMILIES,
    "0.33.0": _ALL_FAMILIES | {"deepseek_v41"},
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    version: str
    form: str  # "stock", "patched" (in-tree patch) or "guard" (plugin loaded)
    instance_passes: bool
    generic_fails: frozenset[str]
    #: the four stock releases: the audit runs after the tests
    audit: bool = False
    #: one new backend whose capture is the installed release's own (pre-fix)
    copied: bool = False

    @property
    def id(self) -> str:
        return f"{self.version}-{self.form}" + ("+copied" if self.copied else "")


COPIED = frozenset({copied_backend.NAME})
NONE: frozenset[str] = frozenset()
SCENARIOS = (
    Scenario("0.27.1", "stock", False, ROCM, audit=True),
    Scenario("0.28.0", "stock", False, ROCM, audit=True),
    Scenario("0.28.0", "patched", True, COPIED, copied=True),
    Scenario("0.29.0", "stock", True, NONE, audit=True),
    Scenario("0.33.0", "stock", True, NONE, audit=True),
    Scenario("0.28.0", "guard", True, NONE),
)


@dataclasses.dataclass
class Case:
    outcome: str  # passed, failed, error, skipped
    text: str  # the failure, error or skip message and its details
    props: dict[str, str]


@dataclasses.dataclass
class Run:
    scenario: Scenario
    rc: int
    output: str
    instance: dict[str, Case]  # test id -> case
    generic: dict[str, Case]  # backend id (``mamba-X`` for Mamba's) -> case
    audit: dict | None
    seconds: float

    def built(self) -> set[str]:
        return {k for k, c in self.generic.items() if "builder" in c.props}

    def failed(self) -> set[str]:
        return {k for k, c in self.generic.items() if c.outcome == "failed"}

    def skip_causes(self) -> dict[str, int]:
        """The generic test's skips, counted by cause."""
        counts: dict[str, int] = {}
        for case in self.generic.values():
            if case.outcome == "skipped":
                cause = "never captured" if NEVER in case.text else None
                cause = cause or classify(case.text)[0].value
                counts[cause] = counts.get(cause, 0) + 1
        return dict(sorted(counts.items()))


def _cases(xml: Path) -> tuple[dict[str, Case], dict[str, Case]]:
    instance, generic = {}, {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, text = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                text = f"{found.get('message', '')}\n{found.text or ''}"
                break
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        name = case.get("name")
        if GENERIC.removesuffix(".py") in case.get("classname", ""):
            backend = name.split("[", 1)[1].rstrip("]")
            generic[backend] = Case(outcome, text, props)
        else:
            instance[name] = Case(outcome, text, props)
    return instance, generic


def vllm_cache_root(version: str) -> str:
    """vLLM's cache for ``version`` (``VLLM_CACHE_ROOT``), as the audit keeps
    it: vLLM caches its model-class inspection (a subprocess that imports
    vLLM again) in one file per class whatever the release, so runs of two
    releases that share the cache redo it in turn."""
    shared = releases.cache_for(version)  # the version matrix's, per release
    if shared:
        return shared["VLLM_CACHE_ROOT"]
    if os.environ.get("VLLM_CACHE_ROOT"):
        return os.environ["VLLM_CACHE_ROOT"]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return str(Path(base) / "vllm-capture-guard" / f"vllm-{version}")


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
        if scenario.copied:  # the patched tree's builder, the installed capture
            files = copied_backend.derive(overlay / "vllm", base / "vllm")
            copied_backend.write_into(overlay / "vllm", files)
        path.insert(0, overlay)
    env = dict(os.environ)
    for name in ("VLLM_PLUGINS", "CAPTURE_GUARD_AUDIT_JSON"):
        env.pop(name, None)
    env.update(
        PYTHONPATH=os.pathsep.join(str(p) for p in [*path, PLUGINS]),
        HF_HUB_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
        VLLM_TARGET_DEVICE="cpu",
        # Triton's interpreter, with no GPU driver: vLLM keeps Triton where no
        # device is visible, and the builders' Triton kernels run on the CPU
        TRITON_INTERPRET="1",
        CUDA_VISIBLE_DEVICES="",
        VLLM_CACHE_ROOT=vllm_cache_root(scenario.version),
        CAPTURE_GUARD_GATED_TEST=IN_TREE[0],
        VLLM_CAPTURE_GUARD="on" if scenario.form == "guard" else "off",
    )
    xml = work / "junit.xml"
    audit_json = work / "audit.json"
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    args += ["-p", "rocm_gate_on_cpu"]
    if scenario.form == "guard":
        args += ["-p", "load_vllm_plugins"]
    if scenario.audit:
        # the audit's captures and writes (its exit status, cpu_writers); the
        # sequenced check, which only grades a write, is left out for time
        env.update(CAPTURE_GUARD_AUDIT_JSON=str(audit_json))
        env.update(CAPTURE_GUARD_AUDIT_LATER="")
        args += ["-p", "audit_in_tree"]
    args += ["-q", "--tb=short", f"--junitxml={xml}", *IN_TREE]
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
    instance, generic = _cases(xml) if xml.is_file() else ({}, {})
    audit = json.loads(audit_json.read_text()) if audit_json.is_file() else None
    seconds = time.monotonic() - start
    return Run(scenario, proc.returncode, output, instance, generic, audit, seconds)


def _counts(cases: dict[str, Case]) -> str:
    return ", ".join(
        f"{n} {o}"
        for o in ("passed", "failed", "error", "skipped")
        if (n := sum(c.outcome == o for c in cases.values()))
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    for version in {s.version for s in SCENARIOS}:
        if release_base(version) is None:
            pytest.fail(f"vLLM {version} is not installed here (make envs)")
    trees = {}
    for version in sorted({s.version for s in SCENARIOS}):
        tree = sdist.extract_tests(version, tmp_path_factory.mktemp(f"vllm-{version}"))
        for name in (INSTANCE, GENERIC):
            shutil.copyfile(OURS / name, tree / "tests" / "v1" / "attention" / name)
        trees[version] = tree
    # two at a time: each run is one interpreter importing vLLM
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            s.id: pool.submit(_run, s, trees[s.version], tmp_path_factory.mktemp(s.id))
            for s in SCENARIOS
        }
        found = {key: f.result() for key, f in futures.items()}
    lines = [
        f"{r.scenario.id}: rc {r.rc}; instance: {_counts(r.instance)}; generic: "
        f"{_counts(r.generic)} ({len(r.built())} built"
        + (f", failed on {', '.join(sorted(r.failed()))}" if r.failed() else "")
        + f"; skips by cause: {r.skip_causes()})"
        + (
            f"; audit: {r.audit.get('built')} built, "
            f"{r.audit.get('in_tree_cpu_s')} s CPU"
            if r.audit
            else ""
        )
        + f" ({r.seconds:.0f} s)"
        for r in found.values()
    ]
    print("\nvLLM's tree, our tests:\n" + "\n".join(lines))
    return found


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_instance_test_in_vllms_own_tree(runs, scenario):
    run = runs[scenario.id]
    tail = run.output[-6000:]
    assert len(run.instance) == INSTANCE_TESTS, tail
    outcomes = {c.outcome for c in run.instance.values()}
    if scenario.instance_passes:
        assert outcomes == {"passed"}, tail
        return
    # affected: every test fails, each on its own check; nothing skips
    assert outcomes == {"failed"}, tail
    for name, case in run.instance.items():
        check = FAILS_ON[name.split("[")[0]]
        assert check in case.text, f"{name} failed on something else:\n{case.text}"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_generic_test_in_vllms_own_tree(runs, scenario):
    """Fails exactly where the scenario has the bug, naming the backend and the
    host field; every other backend passes or skips with a reason; the ROCm
    backends are built and captured in every tree."""
    run = runs[scenario.id]
    tail = run.output[-6000:]
    assert run.generic, tail
    assert run.rc == (
        1 if scenario.generic_fails or not scenario.instance_passes else 0
    )
    assert not [k for k, c in run.generic.items() if c.outcome == "error"], tail
    assert run.failed() == scenario.generic_fails, tail
    for backend in scenario.generic_fails:
        case = run.generic[backend]
        assert case.text.startswith(f"AssertionError: {backend}: "), case.text
        assert HOST_FIELD in case.text, case.text
        assert case.props["host_writes"] == HOST_FIELD, case.props
    for backend, case in run.generic.items():
        if case.outcome == "skipped":
            reason = case.text.removeprefix("Skipped: ")
            assert reason.startswith(f"{backend.removeprefix('mamba-')}: "), case
            if NEVER in reason:
                assert case.props["cudagraph_support"] == "NEVER", case
                continue
            # a placeholder, or what it needs: a compiled extension, hardware
            # or a package
            assert classify(reason)[0] is not Cause.OTHER, case
    # the backends of the bug are built and their capture runs, in every tree
    for backend in ROCM | scenario.generic_fails:
        assert run.generic[backend].outcome in ("passed", "failed"), backend
    # each backend from the model its family serves: every family captured
    skipped = sum(c.outcome == "skipped" for c in run.generic.values())
    assert skipped <= SKIPS_AT_MOST[scenario.version], (skipped, run.skip_causes())
    captured = {
        c.props["family"]
        for c in run.generic.values()
        if c.outcome in ("passed", "failed")
    }
    assert captured == FAMILIES[scenario.version], captured


def test_the_same_backends_build_in_every_form_of_a_release(runs):
    """The in-tree patch and the loaded guard change no backend's build; the
    new backend is the one more in its tree."""
    stock = {r.scenario.version: r for r in runs.values() if r.scenario.form == "stock"}
    for run in runs.values():
        expected = set(stock[run.scenario.version].generic)
        built = stock[run.scenario.version].built()
        if run.scenario.copied:
            expected.add(copied_backend.NAME)
            built = built | {copied_backend.NAME}
        assert set(run.generic) == expected, run.scenario.id
        assert run.built() == built, run.scenario.id


@pytest.mark.parametrize(
    "scenario", [s for s in SCENARIOS if s.audit], ids=lambda s: s.id
)
def test_generic_test_agrees_with_the_audit(runs, scenario):
    """Same process, same vLLM, same platform: the audit builds every backend
    the generic test builds, each from the same family's model, flags
    (``cpu_writers``), among those, the ones the test fails on, and finds the
    same host and device fields wherever the test captured; the one difference
    is a backend that is never captured in a full graph (``NEVER``), which the
    test skips and the audit runs anyway."""
    run = runs[scenario.id]
    audit = run.audit
    assert audit is not None and "error" not in audit, (audit, run.output[-4000:])
    reports = {
        ("mamba-" if "Mamba" in b["registry"] else "") + b["name"]: b
        for b in audit["backends"]
    }
    assert audit["registered"] == len(run.generic) == len(reports)
    assert set(reports) == set(run.generic)
    built = {k for k, b in reports.items() if b["status"] == "built"}
    assert run.built() <= built, run.built() - built
    tested = {k.removeprefix("mamba-") for k in run.built()}
    failed = {k.removeprefix("mamba-") for k in run.failed()}
    assert set(audit["cpu_writers"]) & tested == failed
    for backend in run.built():
        case, report = run.generic[backend], reports[backend]
        assert case.props["builder"] == report["builder_class"].rsplit(".", 1)[1]
        assert case.props["family"] == report["family"], (backend, report)
        if case.props["cudagraph_support"] == "NEVER":
            assert report["cudagraph_support"] == "NEVER", (backend, report)
            assert case.outcome == "skipped", backend
            continue
        if case.outcome == "skipped":  # its capture cannot run here
            continue
        assert case.props["cudagraph_support"] == report["cudagraph_support"], (
            backend,
            report,
        )
        assert report["captured"], (backend, report)
        assert case.props["host_writes"].split(",") == (report["cpu_writes"] or [""])
        assert case.props["device_writes"].split(",") == (
            report["device_writes"] or [""]
        )
        if case.outcome == "passed":
            assert report["verdict"] in NO_HOST_WRITE, (backend, report)


def test_the_gate_was_answered_only_on_the_cpu(runs):
    """Every run was on vLLM's CPU platform with the instance test's gate
    answered. The GPU architecture query of ``vllm.platforms.rocm`` is
    answered only while that module is imported: 0.33's AITER unified backend
    (which the instance test needs) imports it; on other releases the generic
    test's import of every backend may, and 0.27.1's module asks nothing."""
    for key, run in runs.items():
        assert "rocm_gate_on_cpu: platform CpuPlatform" in run.output, key
        answered = "the GPU architecture query of vllm.platforms.rocm answered" in (
            run.output
        )
        if run.scenario.version == "0.33.0":
            assert answered, key
        if run.scenario.version == "0.27.1":
            assert not answered, key


def test_the_guard_was_loaded_by_vllms_plugin_loader_where_asked(runs):
    """The guard scenario's pass is the loaded guard's: vLLM's loader imported
    its entry point there (and in no other run; the tests themselves never
    import it)."""
    for key, run in runs.items():
        reports = [line for line in run.output.splitlines() if REPORT in line]
        if run.scenario.form != "guard":
            assert not reports, key
            continue
        (line,) = reports
        found = json.loads(line.split(REPORT, 1)[1])
        assert found["before"].get("capture_guard") is False, line
        assert found["after"].get("capture_guard") is True, line
