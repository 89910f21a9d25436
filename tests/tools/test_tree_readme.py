# SPDX-License-Identifier: Apache-2.0
"""The two Dockerfile snippets for image builders (``docs/in-tree.md``, the
page the README links for the in-tree form), run without docker: their
``RUN`` commands, taken from the page as written, run in a shell against a
copied tree.

What is left out, and why: ``pip install`` / ``pip uninstall`` of this
package (it is installed here already, and a test must not change the
environment it runs in). ``WORKDIR`` becomes the shell's working folder;
the vLLM that the commands see is a patchable overlay of the installed one
(``tests/tools/overlay.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.overlay import (
    ROOT,
    make_overlay,
    overlay_env,
    release_base,
    snapshot,
    source_checkout,
)
from tests.tools.test_tree import make_tree, release_files
from vllm_capture_guard.tools.cli import main
from vllm_capture_guard.tools.tree.plan import FILES
from vllm_capture_guard.tools.tree.source import MARKER_RE

PAGE = ROOT / "docs" / "in-tree.md"
SECTION = "## In a Dockerfile"


def dockerfiles() -> dict[str, list[str]]:
    """``{"wheels" | "source": [lines]}`` from the page's section."""
    text = PAGE.read_text()
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```dockerfile\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, blocks
    out = {}
    for block in blocks:
        kind = "source" if "--diff" in block else "wheels"
        out[kind] = block.splitlines()
    assert set(out) == {"wheels", "source"}
    return out


def run_commands(lines: list[str]) -> tuple[list[str], str | None]:
    """The shell commands of every ``RUN`` (pip steps left out) and the last
    ``WORKDIR``."""
    joined, commands, workdir = "", [], None
    for line in lines:
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if joined.startswith("RUN "):
            steps = [s.strip() for s in joined[4:].split("&&")]
            commands += [s for s in steps if not s.startswith("pip ")]
        elif joined.startswith("WORKDIR "):
            workdir = joined.split(None, 1)[1]
        joined = ""
    return commands, workdir


def shell(commands: list[str], env: dict[str, str], cwd: Path):
    env = dict(env, PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"])
    return subprocess.run(
        ["bash", "-ec", " && ".join(commands)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_snippets_install_the_built_wheel_not_from_an_index():
    """The package is not on PyPI: each snippet copies the built wheel in and
    installs it with no index."""
    for kind, lines in dockerfiles().items():
        text = " ".join(lines)
        assert "COPY dist/ /capture-guard-dist/" in text, kind
        installs = re.findall(r"pip install [^&\\]*", text)
        assert installs, kind
        for install in installs:
            assert "--no-index --find-links /capture-guard-dist" in install, install


def test_snippets_say_what_the_text_says():
    wheels, _ = run_commands(dockerfiles()["wheels"])
    source, workdir = run_commands(dockerfiles()["source"])
    assert wheels == [
        "vllm-capture-guard patch --apply",
        "VLLM_CAPTURE_GUARD=off vllm-capture-guard check",
    ]
    assert workdir is not None
    assert any(c.startswith("vllm-capture-guard patch --diff --tree .") for c in source)
    assert any("git apply" in c for c in source)


def test_source_snippet_applies_the_diff_to_a_checkout(tmp_path, capsys):
    data = release_files("0.28.0")
    checkout = source_checkout(tmp_path / "checkout", data)
    commands, _ = run_commands(dockerfiles()["source"])
    proc = shell(commands, dict(os.environ), checkout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    applied = make_tree(tmp_path / "applied", data)
    assert main(["patch", "--apply", "--tree", str(applied)]) == 0
    assert snapshot(checkout) == snapshot(applied)  # what --apply writes
    assert not (checkout / "capture-guard.diff").exists()
    # and on a release that has the fixes, the same commands change nothing
    fixed_data = release_files("0.29.0")
    fixed = source_checkout(tmp_path / "fixed", fixed_data)
    proc = shell(commands, dict(os.environ), fixed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert snapshot(fixed) == {k: fixed_data[k] for k in FILES}
    capsys.readouterr()


@pytest.mark.oracle
def test_wheel_snippet_patches_the_installed_vllm_and_checks_it(tmp_path):
    base = release_base("0.28.0")
    if base is None:
        pytest.skip("vLLM 0.28.0 is not installed here")
    overlay = make_overlay(base, tmp_path / "site-packages")
    commands, _ = run_commands(dockerfiles()["wheels"])
    env = overlay_env(overlay, base, VLLM_CAPTURE_GUARD=None)
    proc = shell(commands, env, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "ROCM_ATTN: PASS" in proc.stdout
    assert "ROCM_AITER_UNIFIED_ATTN: PASS" in proc.stdout
    assert "VLLM_CAPTURE_GUARD=off; does nothing" in proc.stdout
    markers = [MARKER_RE.findall(data) for data in snapshot(overlay).values()]
    assert markers == [[b"51585"], [b"53821", b"53821"]] + [[b"53818"] * 2] * 3
