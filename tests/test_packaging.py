# SPDX-License-Identifier: Apache-2.0
"""What someone without this checkout gets: the wheel and sdist that
``make wheel`` builds, installed into a fresh virtualenv that has neither vLLM
nor torch (the package has no dependencies, so nothing else is installed and
no network is used: ``pip install --no-index --find-links``).

In that venv the vLLM plugin entry point is registered, loading it never
raises, and ``vllm-capture-guard status``/``check``/``audit`` exit 2 with a
one-line reason (or one JSON object with ``--json``) instead of a traceback,
both without vLLM and with a vLLM that fails to import.

Marked ``once``: it does not depend on the vLLM release, so the version matrix
runs it in the base venv only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
#: What the build needs from the checkout (copied, so that setuptools' build/
#: and egg-info folders land in a scratch tree, not in the repository).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src")
ENTRY_POINT = "capture_guard = vllm_capture_guard.runtime.plugin:register"


def _run(args, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=300, **kwargs
    )


def _clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH (the version matrix sets one), no vLLM switches."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith(("VLLM_", "PIP_"))
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    assert importlib.util.find_spec("build"), "`build` is in requirements/cpu.txt"
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(
                src,
                tree / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
            )
        else:
            shutil.copy2(src, tree / name)
    out = tmp_path_factory.mktemp("dist")
    proc = _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", out, tree]
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh venv (no pip of its own: the outer pip installs into it) with
    only the built wheel, from the local folder."""
    path = tmp_path_factory.mktemp("fresh") / "venv"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", path])
    assert proc.returncode == 0, proc.stderr
    python = path / "bin" / "python"
    proc = _run(
        [sys.executable, "-m", "pip", "--isolated", "--python", python, "install"]
        + ["--no-index", "--find-links", dist, "vllm-capture-guard"],
        env=_clean_env(),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return path


def test_make_wheel_builds_a_wheel_and_an_sdist(dist):
    names = [p.name for p in dist.iterdir()]
    assert len(names) == 2, names
    assert [n for n in names if re.fullmatch(r"vllm_capture_guard-[\w.]+\.tar\.gz", n)]
    assert [
        n
        for n in names
        if re.fullmatch(r"vllm_capture_guard-[\w.]+-py3-none-any\.whl", n)
    ]
    assert "wheel:" in (ROOT / "Makefile").read_text()


def test_wheel_metadata_entry_points_and_no_dependencies(dist):
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = z.read(info).decode()
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert f"[vllm.general_plugins]\n{ENTRY_POINT}" in entry_points
    assert "vllm-capture-guard = vllm_capture_guard.tools.cli:main" in entry_points
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    # Only extras: pip must never replace the vLLM or torch of an install.
    assert all("extra ==" in r for r in requires), requires


def test_fresh_venv_has_the_plugin_entry_point_and_no_vllm(venv):
    code = (
        "import importlib.util, json\n"
        "from importlib.metadata import entry_points\n"
        "eps = entry_points(group='vllm.general_plugins')\n"
        "[ep] = [e for e in eps if e.name == 'capture_guard']\n"
        "ep.load()()  # vLLM calls register(); without vLLM it must not raise\n"
        "print(json.dumps({'value': ep.value, 'vllm': bool(importlib.util."
        "find_spec('vllm')), 'torch': bool(importlib.util.find_spec('torch'))}))\n"
    )
    proc = _run([venv / "bin" / "python", "-c", code], env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {
        "value": "vllm_capture_guard.runtime.plugin:register",
        "vllm": False,
        "torch": False,
    }


def _assert_could_not_run(proc, command: str, reason: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert proc.stdout == "", out  # errors go to stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, out
    assert lines[0].startswith(f"vllm-capture-guard {command} could not run: "), out
    assert reason in lines[0], out


@pytest.mark.parametrize("command", ["status", "check", "audit"])
def test_without_vllm_each_command_exits_2_with_one_line(venv, command):
    cli = venv / "bin" / "vllm-capture-guard"
    proc = _run([cli, command], env=_clean_env())
    _assert_could_not_run(proc, command, "vLLM is not installed in this Python")
    proc = _run([cli, command, "--json"], env=_clean_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"] is False and result["command"] == command
    assert result["error"].startswith("vLLM is not installed in this Python")


def test_with_a_vllm_that_fails_to_import(venv, tmp_path):
    """A stand-in ``vllm`` whose import raises, as a half-installed vLLM does
    (a missing shared library): this tests our failure handling only."""
    fake = tmp_path / "broken" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ImportError('libamdhip64.so: cannot open shared object file\\n"
        "(second line of the message)')\n"
    )
    env = _clean_env(PYTHONPATH=str(fake.parent))
    cli = venv / "bin" / "vllm-capture-guard"
    reason = "vLLM is installed but fails to import: ImportError: libamdhip64.so"
    for command in ("status", "check", "audit"):
        _assert_could_not_run(_run([cli, command], env=env), command, reason)
    proc = _run([cli, "status", "--json"], env=env)
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"].startswith(reason)
