# SPDX-License-Identifier: Apache-2.0
"""The set-up's own pieces: uv gets pip's configured sources, and resolves as
pip does across several indexes.

``scripts/make-env.sh`` builds the venv with uv (the one on ``PATH``, else a
pinned one that ``scripts/uv.sh`` installs into ``.tools/``). uv reads none of
pip's configuration, so ``scripts/pip_sources.py`` hands it pip's indexes,
find-links and constraints; ``--index-strategy unsafe-best-match`` lets a pin
that an extra index lacks still resolve from the others, as pip does.

Marked ``once``: nothing here depends on the vLLM release.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "pip_sources", ROOT / "scripts" / "pip_sources.py"
)
pip_sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_sources)


def test_pip_configuration_becomes_uv_flags(tmp_path):
    index = tmp_path / "simple"
    index.mkdir()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    listing = "\n".join(
        [
            f":env:.find-links='{wheels}'",
            "global.cert='/etc/ssl/certs/ca-certificates.crt'",
            f"global.extra-index-url='file://{index} file:///no/such/index'",
            f"global.find-links='{wheels}'",
            "global.index-url='https://pypi.org/simple'",
            "global.timeout='60'",
        ]
    )
    flags = pip_sources.parse(listing)
    assert flags[:2] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(flags[2::2], flags[3::2], strict=True))
    assert ("--find-links", str(wheels)) in pairs
    assert ("--extra-index-url", f"file://{index}") in pairs
    assert ("--index-url", "https://pypi.org/simple") in pairs
    # a local source that does not exist is left out (uv refuses it); the rest
    # (cert, timeout) is not a source
    assert not any("no/such" in v for _, v in pairs)
    assert [k for k, _ in pairs].count("--find-links") == 1


def _fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal, valid wheel of ``name==version`` (metadata only)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = [f"{p},sha256={_digest(t)},{len(t)}" for p, t in files.items()]
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def _digest(text: str) -> str:
    import base64

    raw = hashlib.sha256(text.encode()).digest()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _uv() -> str:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "uv.sh")], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"no uv here: {proc.stderr.strip()}")
    return proc.stdout.strip()


@pytest.mark.parametrize("strategy", ["unsafe-best-match", "first-index"])
def test_a_pin_missing_from_the_extra_index_still_resolves(tmp_path, strategy):
    """An extra index holds ``six`` but not the pinned release: with pip's
    behaviour (``unsafe-best-match``) uv takes the pin from the registry; with
    uv's default (``first-index``) the same install fails, so the flag is what
    makes the set-up work on a machine with such an index."""
    simple = tmp_path / "simple" / "six"
    simple.mkdir(parents=True)
    wheel = _fake_wheel(simple, "six", "1.0.0")
    (simple / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    (tmp_path / "simple" / "index.html").write_text('<a href="six/">six</a>\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    proc = subprocess.run(
        [
            _uv(), "pip", "install", "--dry-run", "--python", sys.executable,
            "--index-strategy", strategy,
            "--extra-index-url", (tmp_path / "simple").as_uri(),
            "six==1.17.0",
        ],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    if strategy == "unsafe-best-match":
        assert proc.returncode == 0, out
        assert "six==1.17.0" in out, out
    else:
        assert proc.returncode != 0, out
        assert "1.17.0" in out, out


def test_make_env_uses_uv_with_pips_sources_and_pip_as_fallback():
    script = (ROOT / "scripts" / "make-env.sh").read_text()
    assert '"$root/scripts/uv.sh"' in script
    assert "pip_sources.py" in script
    assert "CAPTURE_GUARD_NO_UV" in (ROOT / "scripts" / "uv.sh").read_text()
    assert "-m venv" in script  # the fallback
    # the pinned uv is a registry package, installed into the ignored .tools/
    uv = (ROOT / "scripts" / "uv.sh").read_text()
    assert "UV_PIN=" in uv and ".tools/" in uv
    assert "/.tools/" in (ROOT / ".gitignore").read_text().splitlines()
