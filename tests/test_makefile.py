# SPDX-License-Identifier: Apache-2.0
"""``VLLM_VERSION=X make check`` checks release X, and says so; ``make test``
follows VLLM_VERSION too.

The check runs for real, against a release from ``.envs`` that is not the
venv's own; the venv's stamp is taken as up to date (``make -o``), so the
test never rebuilds the venv.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.once,
    pytest.mark.skipif(shutil.which("make") is None, reason="no make here"),
]

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
MAKEFILE = (ROOT / "Makefile").read_text()
ALL = re.search(r"^ALL_VERSIONS := (.+)$", MAKEFILE, re.M).group(1).split()
CHECKS = re.search(r"^CHECK_VERSIONS := (.+)$", MAKEFILE, re.M).group(1).split()
ASK = 'from importlib.metadata import version; print(version("vllm"))'


def _make(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VLLM_VERSION")
    }
    clean.pop("PYTHONPATH", None)
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _own_release() -> str:
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", ASK],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip()


def test_make_test_follows_vllm_version():
    def matrix(out: str) -> str:
        (line,) = [ln for ln in out.splitlines() if "version_matrix.py" in ln]
        return " ".join(line.split())

    plain = _make("-n", "-o", ".venv/.ready", "test").stdout
    assert matrix(plain).endswith(f"--check --versions {' '.join(ALL)}"), plain
    # `make check` on the releases beside the matrix (0.27.0, which ROCm
    # images pin) runs inside it, as a test of the once job (below); its
    # environment is built with the others'
    (envs,) = [ln for ln in plain.splitlines() if "make-envs.sh" in ln]
    assert set(CHECKS) <= set(envs.split()), envs
    one = _make("-n", "-o", ".venv/.ready", "test", VLLM_VERSION="0.27.1").stdout
    assert matrix(one).endswith("version_matrix.py --versions 0.27.1"), one
    assert "make test: tested vLLM 0.27.1" in one, one


@pytest.mark.slow
@pytest.mark.parametrize("other", CHECKS)
def test_make_check_checks_the_release_vllm_version_names(other):
    """``make check`` on each release of CHECK_VERSIONS, for real, as ``make
    test`` runs it (0.27.0: the release ROCm images pin, beside the matrix);
    its environment is built here on first use, as make check builds it."""
    if not (VENV / ".ready").exists():
        pytest.skip("no .venv here (make env)")
    own = _own_release()
    assert other != own
    proc = _make("-o", ".venv/.ready", "check", VLLM_VERSION=other)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert f"== vLLM {other} (" in out and f"in front of the venv's {own}" in out
    assert f"vLLM:        {other}" in out  # status
    assert out.count("\nprotected:   ") == 1, out  # status's one verdict
    assert re.search(rf"^vLLM {re.escape(other)}: \d+ full-graph capture", out, re.M)
    assert re.search(r"^verdict: capture gets past every metadata builder", out, re.M)
    assert out.rstrip().endswith(f"make check: checked vLLM {other}")
    assert f"vLLM {own}" not in out.replace(f"venv's {own}", "")
