# SPDX-License-Identifier: Apache-2.0
"""``make newest`` (``scripts/newest.py``, its report ``scripts/newest_report.py``).

* The comparison, on small hand-made results (two audits that differ by one
  backend, a command that could not run, ...): each kind of drift is found,
  named and counted, and identical results drift nowhere. No vLLM is
  imported: marked ``once``.
* The whole run, with the newest release the matrix pins (the last of the
  Makefile's ``ALL_VERSIONS``) named as "the newest" (no registry lookup):
  status, check, the audit and vLLM's generic test really run on it, once,
  and the report says no drift; a second run reads the kept results. It
  starts that release's own environment (``make envs``) whatever the venv
  holds, and needs its sdist (the registry, once; cached): marked
  ``oracle``, so the version matrix runs it once.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # newest.py imports its report by this name
    spec.loader.exec_module(module)
    return module


report = _load("newest_report")
newest = _load("newest")

# --- hand-made results ------------------------------------------------------------


def backend(name: str, **fields) -> dict:
    """An audit's entry: built and captured, writing no shared CPU field."""
    entry = {
        "registry": "AttentionBackendEnum",
        "name": name,
        "status": "built",
        "captured": True,
        "cpu_writes": [],
        "verdict": "clean",
        "cause": None,
        "needs": None,
        "reason": None,
        "captures": [],
    }
    return entry | fields


def audit(*backends: dict) -> dict:
    return {
        "vllm": "x",
        "registered": len(backends),
        "built": sum(b["status"] == "built" for b in backends),
        "captured": sum(b["captured"] for b in backends),
        "cpu_writers": [b["name"] for b in backends if b["cpu_writes"]],
        "skipped_by_cause": {},
        "not_captured_by_cause": {},
        "backends": list(backends),
    }


def item(name: str, passed: int, unit: str) -> dict:
    """One of ``check --json``'s checks, passing."""
    return {"name": name, "ok": True, "passed": passed, "total": passed, "unit": unit}


CHECK = {
    "ok": True,
    "runner": "Model Runner V2 (vllm/v1/worker/gpu/model_runner.py): the only one",
    "checks": [
        item("indexer after ROCM_ATTN", 51, "capture sizes"),
        item("capture stream", 2, "sites"),
    ],
}
STATUS = {
    "protected": "not affected",
    "affected": False,
    "patches": [{"name": "builder-capture-guard", "status": "not needed"}],
}
GENERIC = {
    "rc": 0,
    "outcomes": {"passed": 2},
    "backends": {
        "FLASH_ATTN": {"outcome": "passed", "host_writes": ""},
        "ROCM_ATTN": {"outcome": "passed", "host_writes": ""},
    },
}
AUDIT = audit(backend("FLASH_ATTN"), backend("ROCM_ATTN"))


def ran(found: dict, rc: int = 0) -> dict:
    return {"rc": rc, "json": found, "reason": None, "seconds": 1}


def results(release: str = "0.34.0", **json) -> dict:
    """A release's results: every command ran; ``json`` replaces one's."""
    found = {"status": STATUS, "check": CHECK, "audit": AUDIT, "generic": GENERIC}
    found.update(json)
    return {"release": release, "commands": {k: ran(v) for k, v in found.items()}}


def drifts(pinned: dict, new: dict) -> list[tuple[str, str]]:
    return [(d.kind, d.text) for d in report.compare(pinned, new)]


# --- the comparison ------------------------------------------------------------------


@pytest.mark.once
def test_the_same_results_drift_nowhere():
    same = results()
    assert report.compare(same, results("0.35.0")) == []
    assert report.exit_status([]) == 0
    lines = report.render(same, results("0.35.0"), [])
    assert lines[-1].startswith("newest: no drift: vLLM 0.35.0 runs as 0.34.0")
    for kind in report.KINDS:
        assert f"{kind}: none" in lines


@pytest.mark.once
def test_a_backend_registered_in_one_release_only():
    more = audit(backend("FLASH_ATTN"), backend("ROCM_ATTN"), backend("NEW_ATTN"))
    new = results("0.35.0", audit=more)
    assert drifts(results(), new) == [("newly registered", "NEW_ATTN: captured")]
    assert drifts(new, results()) == [("no longer registered", "NEW_ATTN")]
    # the Mamba registry's backends are told apart as vLLM's generic test does
    mamba = audit(*AUDIT["backends"], backend("CUSTOM", registry="MambaBackendEnum"))
    assert drifts(results(), results(audit=mamba)) == [
        ("newly registered", "mamba-CUSTOM: captured")
    ]


@pytest.mark.once
def test_a_backend_that_stops_building_is_newly_skipped_with_its_cause():
    skipped = backend(
        "ROCM_ATTN",
        status="skipped",
        captured=False,
        cause="compiled extension",
        needs="vLLM's compiled CPU/GPU ops (vllm._C)",
        reason="import: ModuleNotFoundError: No module named 'vllm._C'",
    )
    new = results("0.35.0", audit=audit(backend("FLASH_ATTN"), skipped))
    ((kind, text),) = drifts(results(), new)
    assert kind == "newly skipped"
    assert text.startswith("ROCM_ATTN: captured -> not built: compiled extension")
    assert "No module named 'vllm._C'" in text
    ((kind, text),) = drifts(new, results())
    assert kind == "no longer skipped"
    assert text.startswith("ROCM_ATTN: not built (compiled extension")
    # built, but its capture cannot run here: the capture's error tells why
    stuck = backend(
        "ROCM_ATTN",
        captured=False,
        cause="hardware",
        captures=[{"batch": "reqs4xq1", "error": "RuntimeError: CUDA error"}],
    )
    new = results("0.35.0", audit=audit(backend("FLASH_ATTN"), stuck))
    ((kind, text),) = drifts(results(), new)
    assert (kind, text) == (
        "newly skipped",
        "ROCM_ATTN: captured -> built, its capture cannot run here: hardware: "
        "RuntimeError: CUDA error",
    )


@pytest.mark.once
def test_a_capture_that_writes_shared_cpu_metadata_is_newly_hazardous():
    writer = backend("ROCM_ATTN", cpu_writes=["query_start_loc_cpu"], verdict="HAZARD")
    new = results("0.35.0", audit=audit(backend("FLASH_ATTN"), writer))
    assert drifts(results(), new) == [
        (
            "newly hazardous",
            "ROCM_ATTN: the audit: its capture writes query_start_loc_cpu",
        )
    ]
    assert [k for k, _ in drifts(new, results())] == ["no longer hazardous"]
    # vLLM's generic test failing on a backend is the same hazard, told by it
    failing = {
        "rc": 1,
        "outcomes": {"passed": 1, "failed": 1},
        "backends": {
            "FLASH_ATTN": {"outcome": "passed", "host_writes": ""},
            "ROCM_ATTN": {"outcome": "failed", "host_writes": "query_start_loc_cpu"},
        },
    }
    assert drifts(results(), results("0.35.0", generic=failing)) == [
        (
            "newly hazardous",
            "ROCM_ATTN: vLLM's generic test fails: its capture writes "
            "query_start_loc_cpu",
        )
    ]


@pytest.mark.once
def test_a_capture_that_writes_another_field_is_newly_hazardous_too():
    """A backend that wrote one shared field and now writes another (or one
    more) drifts, though it was a writer on both sides."""
    old = backend("ROCM_ATTN", cpu_writes=["query_start_loc_cpu"], verdict="HAZARD")
    new = backend("ROCM_ATTN", cpu_writes=["seq_lens_cpu"], verdict="HAZARD")
    pinned = results(audit=audit(backend("FLASH_ATTN"), old))
    newer = results("0.35.0", audit=audit(backend("FLASH_ATTN"), new))
    assert drifts(pinned, newer) == [
        ("newly hazardous", "ROCM_ATTN: the audit: its capture writes seq_lens_cpu"),
        (
            "no longer hazardous",
            "ROCM_ATTN: the audit: its capture no longer writes query_start_loc_cpu",
        ),
    ]


@pytest.mark.once
def test_fewer_capture_sizes_or_a_smaller_count_is_a_drift():
    """A check that still passes, on fewer sizes or sites, is not the same
    check: its counts and the capture sizes are compared too."""
    fewer = {
        **CHECK,
        "capture_sizes": {"count": 35, "largest": 256, "smallest": 1},
        "checks": [item("indexer after ROCM_ATTN", 35, "capture sizes")]
        + CHECK["checks"][1:],
    }
    pinned = results(
        check={**CHECK, "capture_sizes": {"count": 51, "largest": 512, "smallest": 1}}
    )
    found = drifts(pinned, results("0.35.0", check=fewer))
    assert (
        "check's verdict",
        "indexer after ROCM_ATTN: PASS, 51/51 capture sizes -> PASS, 35/35 capture "
        "sizes",
    ) in found, found
    assert ("check's verdict", "capture sizes: 51 (512..1) -> 35 (256..1)") in found


@pytest.mark.once
def test_a_generic_test_outcome_that_changes_otherwise_drifts():
    """vLLM's generic test: a backend that passed and is now skipped, or that
    is gone from the test, is newly skipped; the reverse, no longer."""
    skipped = {
        **GENERIC,
        "backends": {
            "FLASH_ATTN": {"outcome": "skipped", "host_writes": ""},
        },
    }
    found = drifts(results(), results("0.35.0", generic=skipped))
    assert found == [
        ("newly skipped", "FLASH_ATTN: vLLM's generic test: passed -> skipped"),
        ("newly skipped", "ROCM_ATTN: vLLM's generic test: passed -> not run"),
    ], found
    back = drifts(results("0.35.0", generic=skipped), results())
    assert [k for k, _ in back] == ["no longer skipped", "no longer skipped"], back


@pytest.mark.once
def test_a_command_that_could_not_run_is_listed_with_its_reason():
    new = results("0.35.0")
    error = "ImportError: cannot import name 'AttentionGroup'"
    new["commands"]["check"] = {
        "rc": 2,
        "json": {"ok": False, "command": "check", "error": error},
        "reason": error,
        "seconds": 3,
    }
    assert drifts(results(), new) == [("could not run", f"check: exit 2: {error}")]
    assert report.exit_status(report.compare(results(), new)) == 1
    # the other way round, it runs again; nothing of it is compared
    assert drifts(new, results()) == [
        ("runs again", f"check: could not run there: {error}")
    ]
    lines = report.render(results(), new, report.compare(results(), new))
    assert "could not run: 1" in lines
    assert lines[-1].startswith("newest: 1 drift item(s) from vLLM 0.34.0 to 0.35.0")


@pytest.mark.once
def test_check_verdict_and_runner():
    failing = {
        **CHECK,
        "ok": False,
        "runner": "the V1 model runner (vllm/v1/worker/gpu_model_runner.py): chosen",
        "checks": [{**CHECK["checks"][0], "ok": False, "failure": "AssertionError"}]
        + CHECK["checks"][1:],
    }
    new = results("0.35.0")
    new["commands"]["check"] = ran(failing, rc=1)
    assert drifts(results(), new) == [
        ("check's verdict", "pass -> fail: indexer after ROCM_ATTN"),
        (
            "check's verdict",
            "indexer after ROCM_ATTN: PASS, 51/51 capture sizes -> FAIL, 51/51 "
            "capture sizes (AssertionError)",
        ),
        (
            "check's runner",
            "Model Runner V2 (vllm/v1/worker/gpu/model_runner.py) -> the V1 model "
            "runner (vllm/v1/worker/gpu_model_runner.py): chosen",
        ),
    ]


@pytest.mark.once
def test_status_verdict_and_a_fix_it_could_not_read():
    unread = {
        **STATUS,
        "patches": [
            {
                "name": "builder-capture-guard",
                "status": "not read here",
                "detail": "cannot import vllm.v1.attention.backends.rocm_attn",
            }
        ],
    }
    assert drifts(results(), results("0.35.0", status=unread)) == [
        (
            "status's verdict",
            "builder-capture-guard: not needed -> not read here (cannot import "
            "vllm.v1.attention.backends.rocm_attn)",
        )
    ]
    affected = {**STATUS, "protected": "yes", "affected": True}
    assert drifts(results(), results("0.35.0", status=affected)) == [
        ("status's verdict", "protected: not affected -> yes"),
        ("status's verdict", "affected: False -> True"),
    ]


@pytest.mark.once
def test_the_report_puts_the_figures_side_by_side_and_marks_what_differs():
    more = audit(backend("FLASH_ATTN"), backend("ROCM_ATTN"), backend("NEW_ATTN"))
    new = results("0.35.0", audit=more)
    lines = report.render(results(), new, report.compare(results(), new))
    (registered,) = [line for line in lines if line.strip().startswith("registered")]
    assert registered.split()[1:] == ["2", "3", "<-", "differs"]
    (built,) = [line for line in lines if line.strip().startswith("built ")]
    assert "differs" in built
    (runner,) = [line for line in lines if line.strip().startswith("runner")]
    assert "differs" not in runner
    assert "newly registered: 1" in lines and "  NEW_ATTN: captured" in lines


@pytest.mark.once
def test_every_kind_of_drift_is_explained_in_the_docs():
    text = (ROOT / "docs" / "newest.md").read_text()
    assert [k for k in report.KINDS if f"- **{k}**" not in text] == []
    assert "[newest.md](newest.md)" in (ROOT / "docs" / "testing.md").read_text()


# --- which releases, and the kept results -------------------------------------------


@pytest.mark.once
def test_the_newest_final_release_wins_over_pre_releases():
    listing = "vllm (0.35.0rc1)\nAvailable versions: 0.35.0rc1, 0.34.0, 0.9.2\n"
    assert newest.pick_newest(listing) == "0.34.0"
    assert newest.pick_newest("Available versions: 0.35.0rc2, 0.35.0rc1") == (
        "0.35.0rc2"
    )
    with pytest.raises(newest.CannotRun):
        newest.pick_newest("ERROR: No matching distribution found for vllm")


@pytest.mark.once
def test_a_named_release_asks_no_registry(monkeypatch):
    def no_registry(*args, **kwargs):
        raise AssertionError(f"asked the registry: {args}")

    monkeypatch.setattr(newest.subprocess, "run", no_registry)
    assert newest.resolve_newest("0.35.0")[0] == "0.35.0"
    monkeypatch.setenv(newest.ENV, "0.36.0")
    assert newest.resolve_newest(None) == ("0.36.0", f"named by {newest.ENV}")


@pytest.mark.once
def test_the_pinned_release_is_the_last_of_all_versions():
    assert newest.pinned_release("X := 1\nALL_VERSIONS := 0.28.0 0.34.0\n") == "0.34.0"
    with pytest.raises(newest.CannotRun):
        newest.pinned_release("VERSIONS := 0.28.0\n")


@pytest.mark.once
def test_results_are_kept_only_where_every_command_ran(tmp_path, monkeypatch):
    calls = []

    def fake(release: str, name: str) -> dict:
        calls.append((release, name))
        why = "exit 2" if (release, name) == ("0.35.0", "check") else None
        return {"rc": 2 if why else 0, "json": {}, "reason": why, "seconds": 0}

    monkeypatch.setattr(newest, "run_one", fake)
    found = newest.results_for(["0.34.0", "0.34.0", "0.35.0"], tmp_path, False)
    assert sorted(calls) == sorted(
        (r, n) for r in ("0.34.0", "0.35.0") for n in newest.ORDER
    )  # each release once
    assert set(found["0.34.0"]["commands"]) == set(newest.ORDER)
    kept = list(tmp_path.iterdir())
    assert [p.name.startswith("vllm-0.34.0-") for p in kept] == [True]
    calls.clear()
    again = newest.results_for(["0.34.0", "0.35.0"], tmp_path, False)
    assert again["0.34.0"] == found["0.34.0"]
    assert {r for r, _ in calls} == {"0.35.0"}  # it could not run: tried again


@pytest.mark.once
def test_json_is_read_from_the_line_that_opens_it():
    assert newest.parse_json('warning: x\n{\n  "ok": true\n}\n') == {"ok": True}
    assert newest.parse_json("Traceback (most recent call last):\n") is None


# --- the whole run ------------------------------------------------------------------


@pytest.mark.oracle
def test_the_pinned_release_as_the_newest_drifts_nowhere(tmp_path):
    """Status, check, the audit and vLLM's generic test really run on the
    pinned release, once for both sides (kept results are not read: the
    cache is this test's own), and the report says no drift."""
    pinned = newest.pinned_release((ROOT / "Makefile").read_text())
    env = {k: v for k, v in os.environ.items() if k != newest.ENV}
    args = [sys.executable, str(SCRIPTS / "newest.py"), "--release", pinned]
    args += ["--cache", str(tmp_path / "kept")]
    start = time.monotonic()
    proc = subprocess.run(
        args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    print(f"\nscripts/newest.py on {pinned}: {time.monotonic() - start:.0f} s wall")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    lines = proc.stdout.splitlines()
    assert f"== vLLM {pinned} against {pinned}, " in proc.stdout, out[-6000:]
    assert lines[-2].startswith("newest: no drift: "), out[-6000:]
    for kind in report.KINDS:
        assert f"{kind}: none" in lines, out[-6000:]
    for name in newest.ORDER:  # each ran once, and ran
        assert proc.stderr.count(f"vLLM {pinned}: {name}: exit ") == 1, out[-6000:]
    kept = list((tmp_path / "kept").iterdir())
    assert [p.name.startswith(f"vllm-{pinned}-") for p in kept] == [True]
