# SPDX-License-Identifier: Apache-2.0
"""CONTRIBUTING.md, the contributor's start page, stays true: every path,
module function, make target and link it names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "CONTRIBUTING.md"
PACKAGE = ROOT / "src" / "vllm_capture_guard"
#: Where a path the page names may be relative to (the page names the
#: runtime's files from inside the runtime, as its own text says).
BASES = (ROOT, PACKAGE, PACKAGE / "runtime", PACKAGE / "runtime" / "guard")
MAX_LINES = 150


def _text() -> str:
    return PAGE.read_text()


def _quoted() -> list[str]:
    return re.findall(r"`([^`\n]+)`", _text())


def _exists(name: str) -> bool:
    name = name.rstrip("/").split("#")[0]
    if any((base / name).exists() for base in BASES):
        return True
    if "/" in name:
        return False
    # a bare file name: somewhere in the repository's own folders
    return any(ROOT.glob(f"{top}/**/{name}") for top in ("src", "upstream"))


def test_the_page_is_short():
    lines = _text().splitlines()
    assert len(lines) <= MAX_LINES, len(lines)


def test_every_path_it_names_exists():
    names = [
        q.split()[0]
        for q in _quoted()
        if re.fullmatch(r"[\w./-]+", q.split()[0])
        and (q.endswith((".py", ".md", ".sh", "/")) or "/" in q)
    ]
    assert len(names) > 20, names
    missing = [n for n in names if not _exists(n)]
    assert not missing, missing


def test_every_function_it_names_exists():
    calls = re.findall(r"`(?:[\w/]+/)?(\w+)\.(\w+)(?:\(\))?`", _text())
    calls = [(m, n) for m, n in calls if n not in ("py", "md", "sh")]
    found = []
    for module, name in calls:
        if any(PACKAGE.joinpath("runtime").rglob(f"{module}.py")):
            path = next(
                p
                for p in PACKAGE.joinpath("runtime").rglob(f"{module}.py")
                if "__pycache__" not in p.parts
            )
            dotted = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
            found.append((dotted, name))
    assert len(found) >= 5, calls
    for dotted, name in found:
        assert hasattr(importlib.import_module(dotted), name), (dotted, name)


def test_every_make_target_and_command_it_runs_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    blocks = re.findall(r"```bash\n(.*?)```", _text(), re.S)
    used = [t for block in blocks for t in re.findall(r"\bmake ([\w-]+)", block)]
    used += re.findall(r"`make ([\w-]+)`", _text())  # named in the prose
    assert {"check", "test", "lint", "bench"} <= set(used), used
    assert set(used) <= targets, set(used) - targets
    scripts = [s for block in blocks for s in re.findall(r"python (\S+)", block)]
    assert scripts and all((ROOT / s).is_file() for s in scripts), scripts


def test_every_link_and_anchor_exists():
    links = re.findall(r"\]\(([^)#]+)(?:#([\w-]+))?\)", _text())
    assert links
    for target, anchor in links:
        page = ROOT / target
        assert page.is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
            slugs = {
                re.sub(r"[^\w -]", "", h).strip().lower().replace(" ", "-")
                for h in headings
            }
            assert anchor in slugs, (target, anchor)


def test_the_ceiling_it_gives_is_the_one_the_layout_test_holds():
    from tests.test_layout import RUNTIME_CEILING

    assert f"at most {RUNTIME_CEILING:,} lines" in _text()
