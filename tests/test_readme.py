# SPDX-License-Identifier: Apache-2.0
"""The README against the code, where the code can say: short enough to read
in five minutes, both start-up failures and the one caveat on the first
screen, the runtime's patch names and no others, the CLI's real commands,
the in-tree form's files on its page, and docs/ links that exist.

Cheap: no vLLM and no torch is imported (the patch list, the CLI parser and
the in-tree file list import neither).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from vllm_capture_guard.runtime.patches import NAMES
from vllm_capture_guard.tools.cli import _parser
from vllm_capture_guard.tools.tree.plan import FILES

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
IN_TREE = ROOT / "docs" / "in-tree.md"
MAX_LINES = 300
FIRST_SCREEN = 40
#: The MiniMax-M3 failure, as vLLM prints it.
INDEXER = (
    'File "vllm/models/minimax_m3/common/indexer.py", line 317, in build',
    "assert decode_query_len > 0",
    "EngineCore failed to start.",
)
CAVEAT = "Nothing has run on AMD hardware yet"
#: Backticked kebab-case words that are no patch name.
NOT_PATCHES = frozenset({"vllm-capture-guard"})


def stream_crash() -> str:
    """AITER's message, as the tools' harness spells it (read from its
    source: importing the harness would import torch)."""
    path = ROOT / "src/vllm_capture_guard/tools/harness/streams.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CRASH" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"no CRASH in {path}")


def code(text: str) -> list[str]:
    """The contents of every fenced code block and every inline code span."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def patch_names_named(text: str) -> set[str]:
    """Every name the text uses as a patch name: kebab-case words in code,
    names in the plugin's log lines and in ``VLLM_CAPTURE_GUARD_DISABLE``."""
    found = set()
    for snippet in code(text):
        if re.fullmatch(r"[a-z0-9]+(?:-[a-z0-9]+){2,}", snippet.strip()):
            found.add(snippet.strip())
        found.update(re.findall(r"vllm-capture-guard: ([a-z0-9-]+): ", snippet))
        for names in re.findall(r"VLLM_CAPTURE_GUARD_DISABLE=([\w,-]+)", snippet):
            found.update(n for n in names.split(",") if n)
    return found - NOT_PATCHES


def test_readme_is_short():
    lines = README.count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines, more than {MAX_LINES}"


def test_first_screen_has_both_failures_and_the_caveat():
    first = "\n".join(README.splitlines()[:FIRST_SCREEN])
    for line in (*INDEXER, stream_crash(), CAVEAT):
        assert line in first, f"not in the README's first {FIRST_SCREEN} lines: {line}"


def test_first_screen_says_how_to_install():
    first = "\n".join(README.splitlines()[:FIRST_SCREEN])
    assert "python3 -m build" in first
    assert "pip install --no-index --find-links dist vllm-capture-guard" in first


def test_every_patch_is_named_and_no_other():
    named = patch_names_named(README)
    assert named - NAMES == set(), f"no such patch: {sorted(named - NAMES)}"
    missing = [n for n in sorted(NAMES) if f"`{n}`" not in README]
    assert not missing, f"patches the README does not name: {missing}"


def test_commands_are_the_clis():
    parser = _parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = set(sub.choices)
    used = set()
    for snippet in code(README):
        used.update(re.findall(r"vllm-capture-guard\s+([a-z]\w*)", snippet))
    assert used, "the README shows no vllm-capture-guard command"
    assert used <= commands, f"no such command: {sorted(used - commands)}"


def test_in_tree_page_names_the_files_patch_apply_changes():
    text = IN_TREE.read_text()
    section = text.split("## What it changes", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(vllm/[\w/]+\.py)`", section))
    assert named == {f"vllm/{f}" for f in FILES}
    count = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    assert f"{count[len(FILES)]} files" in section.lower()


def test_docs_links_exist():
    links = set(re.findall(r"\]\((docs/[^)#\s]+)", README))
    links |= {s for s in code(README) if re.fullmatch(r"docs/[\w./-]+\.md", s)}
    assert links, "the README links no docs/ page"
    missing = sorted(link for link in links if not (ROOT / link).is_file())
    assert not missing, f"README links pages that do not exist: {missing}"
