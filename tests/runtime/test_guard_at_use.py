# SPDX-License-Identifier: Apache-2.0
"""The guard at use, on modified vLLM files derived at test time
(``tests/runtime/at_use.py``), at vLLM's real capture sizes (51 sizes, 512
down to 1, one builder instance per group, the runner's buffers, MiniMax-M3's
indexer after every attention capture).

Each case runs in fresh interpreters, loaded through vLLM's plugin loader:
with the guard off the capture must fail (a host field changed, or the
indexer's assertion), with it on it must pass. The cases that change vLLM
after the import also run with the guard on but without vLLM's capture entry
(``GPUModelRunner.capture_model``): they must fail there, which shows that the
re-check at that entry is what saves them. A capture that sizes a workspace on
its first call must pass both ways: the guard runs nothing of vLLM's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import variants as vv
from tests.runtime import at_use

AFTER_IMPORT = ("put-back", "late-reload", "custom-subclass")


@pytest.fixture(scope="module")
def installed_version() -> str:
    from importlib.metadata import version

    return version("vllm")


def _overlay(case: str, dest) -> None:  # noqa: ANN001
    files = at_use.derive(case)
    vllm_files = {k: v for k, v in files.items() if not k.startswith("../")}
    vv.make_overlay(vllm_files, dest)
    for rel, text in files.items():
        if rel.startswith("../"):
            (dest / rel[3:]).write_text(text)


def _runs(case: str, dest, modes: list[str]) -> dict[str, dict]:  # noqa: ANN001
    """Run the case once per mode, two interpreters at a time."""
    procs = {}
    for mode in modes:
        env = vv.overlay_env(dest)
        env["VLLM_CAPTURE_GUARD"] = "off" if mode == "off" else "on"
        extra = ["no-entry"] if mode == "no-entry" else []
        procs[mode] = subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.at_use", case, *extra],
            env=env,
            cwd=vv.ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, (mode, stderr[-3000:])
        out[mode] = json.loads(stdout.strip().splitlines()[-1])
        out[mode]["log"] = stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(at_use.CASES))
def test_case_at_vllms_capture_sizes(case, tmp_path):
    _overlay(case, tmp_path)
    modes = ["off", "on"] + (["no-entry"] if case in AFTER_IMPORT else [])
    runs = _runs(case, tmp_path, modes)
    for run in runs.values():
        assert run["sizes"] >= 50 and run["largest"] == 512, run
    on = runs["on"]
    assert on["failures"] == [], on["failures"][:2]
    if case == "first-call-workspace":
        assert runs["off"]["failures"] == []
        return
    off = runs["off"]["failures"]
    assert off, f"{case}: the unguarded capture did not fail"
    assert all(f["error"] or f["host_writes"] for f in off)
    if case in AFTER_IMPORT:
        assert runs["no-entry"]["failures"], "passed without the capture entry"
