# SPDX-License-Identifier: Apache-2.0
"""A tree patched in place by release 0.1.0 (``patch --apply`` at 7a4b9f7)
is still recognised by today's code, and reverts byte for byte.

``data/tree-0.1.0.json`` (made by ``scripts/tree_fixture_010.py``) says what
0.1.0 wrote into each release's files, as an edit script that holds only our
own text: no vLLM line is stored. Here the originals come from the vLLM that
this Python would import (found, not imported), matched to the fixture by
their sha256; 0.1.0's patched files are rebuilt from them and checked by
sha256 too, and its saved originals are put beside them. Then today's
``--check`` must see the fix, ``--apply`` must do nothing, and ``--revert``
must give back every original byte. Today's ``--apply`` on a fresh copy must
write exactly what 0.1.0 wrote.

The version matrix runs this file on each release; a release the fixture
lacks is skipped, but the venv's own release (0.28.0) must be found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.tools.overlay import make_overlay
from vllm_capture_guard.tools.cli import main
from vllm_capture_guard.tools.tree.files import LOCK, SIDECAR

FIXTURE = json.loads((Path(__file__).parent / "data" / "tree-0.1.0.json").read_text())
FILES: list[str] = FIXTURE["files"]  # 0.1.0's target files, inside vllm/
#: The venv's own release: the fixture must cover it, so that this file
#: cannot skip everywhere.
VENV_RELEASE = "0.28.0"
#: What 0.1.0 called a file that carries its backport.
APPLIED = "carries the in-tree fix"
MARKER = "# vllm-capture-guard: backport of vllm PR #"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _rebuild() -> Any:
    """The maintainer's tool's own reader of the edit script (stdlib only)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "tree_fixture_010.py"
    spec = importlib.util.spec_from_file_location("tree_fixture_010", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rebuild


rebuild = _rebuild()


@dataclasses.dataclass(frozen=True)
class Release:
    version: str  # the fixture's name for it
    base: Path  # the folder that holds the installed vllm/
    original: dict[str, bytes]  # inside vllm/ -> vLLM's bytes (present files)
    entry: dict  # the fixture's record of it

    def files(self) -> dict[str, dict]:
        return {k: f for k, f in self.entry["files"].items() if f["present"]}

    def patched(self) -> dict[str, bytes]:
        """0.1.0's bytes, rebuilt from the originals."""
        out = {}
        for inside, f in self.files().items():
            out[inside] = rebuild(self.original[inside], f["hunks"], f["newline"])
        return out


def _matches(entry: dict, original: dict[str, bytes | None]) -> bool:
    for inside, f in entry["files"].items():
        data = original.get(inside)
        if (data is not None) != f["present"]:
            return False
        if data is not None and sha256(data) != f["original_sha256"]:
            return False
    return True


@pytest.fixture(scope="module")
def release() -> Release:
    """The importable vLLM's files, as the fixture knows them."""
    spec = importlib.util.find_spec("vllm")  # executes nothing of vLLM
    assert spec is not None and spec.submodule_search_locations, "no vllm here"
    package = Path(list(spec.submodule_search_locations)[0])
    version = importlib.metadata.version("vllm")
    original = {}
    for inside in FILES:
        path = package / inside
        original[inside] = path.read_bytes() if path.is_file() else None
    found = [v for v, e in FIXTURE["releases"].items() if _matches(e, original)]
    listed = version in FIXTURE["releases"]
    assert VENV_RELEASE in FIXTURE["releases"]
    if not found:
        assert not listed and version != VENV_RELEASE, (
            f"vLLM {version} at {package}: its files are not the ones the fixture "
            f"recorded from its wheel (scripts/tree_fixture_010.py)"
        )
        pytest.skip(f"the fixture has no record of vLLM {version}'s files")
    assert found == [version] or not listed, (version, found)
    present = {k: v for k, v in original.items() if v is not None}
    return Release(found[0], package.parent, present, FIXTURE["releases"][found[0]])


def patch(capsys, *args: str) -> tuple[int, str]:
    code = main(["patch", *args])
    return code, capsys.readouterr().out


def targets(root: Path) -> dict[str, bytes]:
    """The target files and any saved originals, by path inside vllm/."""
    out = {}
    for inside in FILES:
        for name in (inside, inside + SIDECAR):
            path = root / "vllm" / name
            if path.exists():
                out[name] = path.read_bytes()
    return out


@pytest.fixture
def tree_010(release, tmp_path) -> Path:
    """A copy of the installed vLLM as 0.1.0's ``--apply`` left it."""
    root = make_overlay(release.base, tmp_path / "tree")
    for inside, new in release.patched().items():
        f = release.files()[inside]
        assert sha256(new) == f["patched_sha256"], f"{inside}: not 0.1.0's bytes"
        path = root / "vllm" / inside
        path.write_bytes(new)
        if f["sidecar"]:
            saved = path.with_name(path.name + FIXTURE["sidecar_suffix"])
            saved.write_bytes(release.original[inside])
            shutil.copymode(path, saved)
    return root


def test_the_fixture_holds_only_our_marked_text(release):
    """No stored line is one of vLLM's, each line hunk carries our marker,
    and each insert is on a line that our marker stands above."""
    assert FIXTURE["version"] == "0.1.0" and FIXTURE["commit"].startswith("7a4b9f7")
    assert FIXTURE["sidecar_suffix"] == SIDECAR
    for inside, f in release.files().items():
        theirs = {t.strip() for t in release.original[inside].decode().splitlines()}
        marked = set()
        for h in f["hunks"]:
            if "insert" in h:
                assert h["line"] in marked, (inside, h)
                assert len(h["insert"]) < 40, (inside, h)
                continue
            assert any(t.lstrip().startswith(MARKER) for t in h["added"]), h
            copied = [t for t in h["added"] if t.strip() and t.strip() in theirs]
            assert not copied, (inside, copied)
            marked.add(h["line"])


def test_010_tree_is_recognised_as_carrying_the_fix(tree_010, release, capsys):
    code, out = patch(capsys, "--check", "--json", "--tree", str(tree_010))
    report = json.loads(out)
    assert code == 0 and report["exit"] == 0, out
    states = {f["file"].removeprefix("vllm/"): f["state"] for f in report["findings"]}
    assert set(states) == set(FILES), "today's patcher targets other files"
    for inside, f in release.entry["files"].items():
        assert states[inside] == f["state_after"], (inside, states[inside])
        if f.get("sidecar"):
            assert states[inside] == APPLIED
    code, out = patch(capsys, "--check", "--tree", str(tree_010))
    assert code == 0 and "verdict: nothing to do" in out, out


def test_apply_on_the_010_tree_changes_nothing(tree_010, capsys):
    before = targets(tree_010)
    code, out = patch(capsys, "--apply", "--tree", str(tree_010))
    assert code == 0 and "nothing to do" in out, out
    assert targets(tree_010) == before
    assert not (tree_010 / "vllm" / LOCK).exists()


def test_revert_gives_back_every_original_byte(tree_010, release, capsys):
    code, out = patch(capsys, "--revert", "--tree", str(tree_010))
    assert code == 0, out
    assert targets(tree_010) == release.original  # no saved original is left
    for inside, data in release.original.items():
        assert sha256(data) == release.files()[inside]["original_sha256"]
    saved = [k for k, f in release.files().items() if f["sidecar"]]
    assert out.count(" byte for byte") == len(saved), out
    if not saved:
        assert "nothing to revert" in out, out


def test_todays_apply_writes_what_010_wrote(release, tmp_path, capsys):
    root = make_overlay(release.base, tmp_path / "fresh")
    code, out = patch(capsys, "--apply", "--tree", str(root))
    assert code == 0, out
    for inside, f in release.files().items():
        path = root / "vllm" / inside
        assert sha256(path.read_bytes()) == f["patched_sha256"], inside
        saved = path.with_name(path.name + SIDECAR)
        assert saved.exists() == f["sidecar"], inside
        if f["sidecar"]:
            assert saved.read_bytes() == release.original[inside]
