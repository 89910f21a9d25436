# SPDX-License-Identifier: Apache-2.0
"""Every command's ``--json`` object carries ``exit``, the process's own exit
status, and ``cannot_judge``, true exactly where that status is 2 (the
command could not run, or could not judge). Each command is run through its
command line on each path it has: pass, fail, could not run, and check with
a check that did not run, or audit with nothing built (docs/json.md).

Which of 0 and 1 a path gives depends on the release (a fixed release has
nothing to fail); the invariant holds on every one, and the paths that must
give 2 give it everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import variants as vv
from tests import warm
from tests.conftest import fresh_env, run_cli
from vllm_capture_guard.tools.tree.plan import FILES

pytestmark = pytest.mark.once

#: A ``vllm`` package that fails to import, first on the path: every command
#: that imports vLLM could not run.
BROKEN_VLLM = "raise ImportError('stand-in: a vLLM that does not import')\n"


@pytest.fixture(scope="module")
def broken_vllm(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("broken-vllm")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(BROKEN_VLLM)
    return str(root)


def _json(proc) -> dict:
    text = proc.stdout.strip()
    assert text, f"no JSON on stdout (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(text)


def _holds(proc) -> dict:
    found = _json(proc)
    assert found["exit"] == proc.returncode, (found["exit"], proc.returncode)
    assert found["cannot_judge"] is (proc.returncode == 2), found
    if proc.returncode == 2:
        assert found.get("error"), found
    return found


def _fresh(args: list[str], **env: str | None):
    """A fresh interpreter: a warm child has vLLM imported already."""
    return warm.python(
        ["-m", "vllm_capture_guard", *args], fresh_env(**env), fresh=True
    )


# --- status ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, "off"])
def test_status_json_exit(mode):
    found = _holds(run_cli("status", "--json", VLLM_CAPTURE_GUARD=mode))
    assert found["ok"] is True
    if mode == "off" and found["affected"]:
        assert found["exit"] == 1 and found["protected"] == "no"


def test_status_json_could_not_run(broken_vllm):
    proc = _fresh(["status", "--json"], PYTHONPATH=broken_vllm)
    assert proc.returncode == 2, proc.stderr[-2000:]
    found = _holds(proc)
    assert found["ok"] is False and "stand-in" in found["error"]


# --- check ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["on", "off"])
def test_check_json_exit(mode):
    found = _holds(run_cli("check", "--json", VLLM_CAPTURE_GUARD=mode))
    assert found["ok"] is (found["exit"] == 0)
    if mode == "on":
        assert found["exit"] == 0 and found["not_checked"] == [], found["not_checked"]


def test_check_json_could_not_run(broken_vllm):
    proc = _fresh(["check", "--json"], PYTHONPATH=broken_vllm)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _holds(proc)["ok"] is False


@pytest.fixture(scope="module")
def without_rocm_backends(tmp_path_factory) -> dict:
    """The installed vLLM with its ROCm attention module made to fail on
    import (an overlay derived from the installed file): neither ROCm
    backend can be made, so check runs no capture at all."""
    rel = "v1/attention/backends/rocm_attn.py"
    text = vv.read_installed(rel)
    broken = text + "\nraise ImportError('stand-in: a dependency missing here')\n"
    dest = vv.make_overlay({rel: broken}, tmp_path_factory.mktemp("no-rocm"))
    return vv.overlay_env(dest)


def test_check_with_no_capture_cannot_judge(without_rocm_backends):
    env = dict(without_rocm_backends)
    proc = warm.python(["-m", "vllm_capture_guard", "check", "--json"], env)
    found = _holds(proc)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert found["backends"] == {}, found["backends"]  # no capture ran
    said = " ".join(found["not_checked"])
    assert "ROCM_ATTN (" in said and "stand-in" in said, said
    text = warm.python(["-m", "vllm_capture_guard", "check"], env)
    assert text.returncode == 2
    assert "verdict: capture gets past" not in text.stdout
    assert "check cannot judge" in text.stderr or "could not run" in text.stderr


# --- audit ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "mode"),
    [
        ("TRITON_ATTN", "off"),
        ("ROCM_ATTN", "off"),
        ("FLASHINFER", "off"),
        ("CUSTOM", "off"),
        ("NOPE", None),
    ],
)
def test_audit_json_exit(backend, mode):
    """TRITON_ATTN: clean; ROCM_ATTN unguarded: a hazard where the release
    zeroes the host offsets; FLASHINFER: built, but its capture needs a CUDA
    device; CUSTOM: a placeholder slot, nothing built; NOPE: no such
    backend, the audit could not run."""
    proc = run_cli("audit", "--json", "--backend", backend, VLLM_CAPTURE_GUARD=mode)
    found = _holds(proc)
    if backend in ("FLASHINFER", "CUSTOM", "NOPE"):  # no capture ran: no verdict
        assert found["exit"] == 2, found
        assert found.get("captured", 0) == 0, found
    if backend == "TRITON_ATTN":
        assert found["exit"] == 0, found.get("error")
    if backend == "ROCM_ATTN" and found["cpu_writers"]:
        assert found["exit"] == 1, found


# --- patch --check --------------------------------------------------------------


def _tree(root: Path) -> Path:
    """The installed vLLM's files that the in-tree form reads, as a tree."""
    installed = vv.installed_vllm_dir()
    for inside in FILES:
        src = installed / inside
        if src.is_file():
            dest = root / "vllm" / inside
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(src.read_bytes())
    (root / "vllm" / "__init__.py").write_bytes(b"")
    return root


def test_patch_check_json_exit(tmp_path):
    from vllm_capture_guard.tools.cli import main

    tree = _tree(tmp_path / "tree")
    before = _holds(run_cli("patch", "--check", "--json", "--tree", str(tree)))
    assert before["exit"] in (0, 1)
    if before["exit"] == 1:
        assert main(["patch", "--apply", "--tree", str(tree)]) == 0
        args = ["patch", "--check", "--json", "--tree", str(tree)]
        after = _holds(warm.python(["-m", "vllm_capture_guard", *args], fresh_env()))
        assert after["exit"] == 0, after
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = _holds(run_cli("patch", "--check", "--json", "--tree", str(empty)))
    assert refused["exit"] == 2 and refused["ok"] is False
