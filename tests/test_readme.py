# SPDX-License-Identifier: Apache-2.0
"""The README against the code, where the code can say: an operator's page,
short enough to read in five minutes, whose first screens answer "am I
affected", "how do I install", "how do I verify" and "how do I switch it
off"; the runtime's patch names and switch words and no others, the CLI's
real commands, ``status``'s verdicts with their exit codes, the in-tree
form's files on its page, and docs/ links that exist.

Cheap: no vLLM and no torch is imported (the patch list, the switch, the
CLI parser, ``status``'s verdict table and the in-tree file list import
neither). The tracebacks' line numbers are read from vLLM 0.27.0's files
where ``make envs`` put that release (``.envs/vllm-0.27.0``).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from pathlib import Path

import pytest

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.patches import FORMER_NAMES, NAMES
from vllm_capture_guard.tools.cli import _parser
from vllm_capture_guard.tools.status import EXIT
from vllm_capture_guard.tools.tree.plan import FILES

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
IN_TREE = ROOT / "docs" / "in-tree.md"
MAX_LINES, MAX_WORDS, MAX_WIDTH = 150, 1200, 120
#: What the operator must find without scrolling far.
FIRST = 80
#: The release whose line numbers the tracebacks carry.
RELEASE = "0.27.0"
#: Each traceback line that names a file, and what that line of the file holds.
TRACEBACK_LINES = {
    ("vllm/v1/engine/core.py", 1349): '"EngineCore failed to start."',
    ("vllm/models/minimax_m3/common/indexer.py", 317): "assert decode_query_len > 0",
    ("vllm/v1/worker/gpu/cudagraph_utils.py", 355): "forward_fn(CUDAGraphMode.NONE)",
}
#: The MiniMax-M3 failure, as vLLM 0.27.0 prints it.
INDEXER = (
    "ERROR ... [core.py:1349] EngineCore failed to start.",
    'File "vllm/models/minimax_m3/common/indexer.py", line 317, in build',
    "assert decode_query_len > 0",
)
#: Model Runner V2's capture, as vLLM 0.27.0 prints it.
CAPTURE = (
    'File "vllm/v1/worker/gpu/cudagraph_utils.py", line 355, in capture',
    "forward_fn(CUDAGraphMode.NONE)",
)
CAVEAT = "Nothing has run on AMD hardware yet"
AFFECTED = "You are affected if all of these hold:"
#: The operator's sections, in the order the operator asks.
HEADINGS = ("## What it fixes", "## Install", "## Verify", "## Switch off")
#: Backticked kebab-case words that are no patch name.
NOT_PATCHES = frozenset(
    {"vllm-capture-guard", "py3-none-any", "externally-managed-environment"}
)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.S | re.M)


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
    rest = FENCE.sub("", text)
    return FENCE.findall(text) + re.findall(r"`([^`\n]+)`", rest)


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a ``## `` line), up to the next one."""
    assert f"\n{heading}\n" in text, f"no {heading!r} section"
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def first(lines: int = FIRST) -> str:
    return "\n".join(README.splitlines()[:lines])


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


def pip_installs(text: str) -> list[str]:
    """Every ``pip install`` command in ``text``'s code blocks (a line's
    commands split at ``&&``, ``||`` and ``;``)."""
    return [
        command.strip()
        for block in FENCE.findall(text)
        for line in block.splitlines()
        for command in re.split(r"&&|\|\||;", line.split("#", 1)[0])
        if re.search(r"\bpip\b.*\binstall\b", command)
    ]


def test_readme_is_short():
    lines, words = README.count("\n"), len(README.split())
    assert lines <= MAX_LINES, f"README.md has {lines} lines, more than {MAX_LINES}"
    assert words <= MAX_WORDS, f"README.md has {words} words, more than {MAX_WORDS}"


def test_no_line_is_wider_than_the_limit():
    wide = [
        f"{n}: {len(line)} characters"
        for n, line in enumerate(README.splitlines(), 1)
        if len(line) > MAX_WIDTH
    ]
    assert not wide, f"README.md lines over {MAX_WIDTH} characters: {wide}"


def test_the_operators_sections_come_in_order():
    at = [README.find(f"\n{h}\n") for h in HEADINGS]
    missing = [h for h, i in zip(HEADINGS, at, strict=True) if i < 0]
    assert not missing, f"README.md has no {missing}"
    assert at == sorted(at), f"README.md's sections are not in this order: {HEADINGS}"


def test_no_generated_block():
    assert "<!--" not in README, "README.md holds a marker comment (a generated block)"


def test_first_lines_have_both_failures_their_release_and_the_caveat():
    top = first()
    assert CAVEAT in first(10), f"not in the README's first 10 lines: {CAVEAT}"
    for line in (*INDEXER, *CAPTURE, stream_crash()):
        assert line in top, f"not in the README's first {FIRST} lines: {line}"
    assert f"vLLM {RELEASE}'s" in top, f"the tracebacks' release ({RELEASE}) unsaid"
    assert "other releases' differ" in top
    assert top.count(AFFECTED) == 2, f"not twice in the first {FIRST} lines: {AFFECTED}"


def _release_tree() -> Path:
    envs = Path(os.environ.get("CAPTURE_GUARD_ENVS") or ROOT / ".envs")
    tree = envs / f"vllm-{RELEASE}"
    if not (tree / "vllm").is_dir():
        pytest.skip(f"vLLM {RELEASE} is not in {envs} (make envs puts it there)")
    return tree


def test_the_tracebacks_line_numbers_are_the_releases():
    """Each file and line the tracebacks name holds, in vLLM 0.27.0, what the
    traceback shows there."""
    tree = _release_tree()
    for (path, number), text in TRACEBACK_LINES.items():
        shown = f'"{path}", line {number}' in README or (
            f"[{Path(path).name}:{number}]" in README
        )
        assert shown, f"the README's tracebacks do not name {path}:{number}"
        line = (tree / path).read_text().splitlines()[number - 1]
        assert text in line, f"vLLM {RELEASE}'s {path}:{number} is {line.strip()!r}"


def test_first_lines_say_how_to_install_into_an_image():
    top = first()
    assert re.search(r"python3 -m venv (\S+) && \1/bin/pip install build\n", top)
    assert re.search(r"/bin/python -m build --wheel\b", top)
    copy = re.search(r"^COPY (\S+\.whl) (\S+)/$", top, flags=re.M)
    assert copy, f"no COPY of the wheel in the first {FIRST} lines"
    run = (
        f"RUN pip install --no-index --find-links {copy[2]} vllm-capture-guard "
        "&& vllm-capture-guard status"
    )
    assert f"\n{run}\n" in top, f"not in the first {FIRST} lines: {run}"
    assert "pip install --no-index --find-links dist vllm-capture-guard" in top
    assert "docs/in-tree.md" in section(README, "## Install")


def test_install_never_reaches_the_registry_for_vllm_or_torch():
    """Every ``pip install`` of the Install section installs from the wheel
    (``--no-index``), or runs in the throwaway venv that builds it; none
    names a requirements file or torch."""
    text = section(README, "## Install")
    venvs = set(re.findall(r"python3 -m venv (\S+)", text))
    found = pip_installs(text)
    assert found, "the Install section shows no pip install"
    for line in found:
        in_venv = any(line.startswith(f"{v}/bin/pip ") for v in venvs)
        assert "--no-index" in line or in_venv, f"reaches the registry: {line}"
        assert not re.search(r"(^|\s)(-r|--requirement|-c)\s", line), line
        assert "requirements" not in line and "torch" not in line, line


def test_first_lines_give_statuss_verdicts_with_their_exit_codes():
    """Each verdict ``status`` prints, on one line with the exit code that
    ``status`` gives it, and the switch that turns the guard off."""
    top = first()
    for verdict, code_ in EXIT.items():
        pattern = rf"`protected: {re.escape(verdict)}[^`]*`, exit {code_}\b"
        assert re.search(pattern, top), f"not in the first {FIRST} lines: {pattern}"
    assert "`vllm-capture-guard status`" in top
    assert "VLLM_CAPTURE_GUARD=off" in top


def test_switch_words_are_the_switchs():
    """The words the README gives for ``off`` and ``on`` mean that, and a
    word that is none of them means ``auto`` (with a problem to log), as
    the README says."""
    text = section(README, "## Switch off")
    off = re.search(r"`VLLM_CAPTURE_GUARD=off` \(or ((?:`\w+`(?:, )?)+)\)", text)
    on = re.search(r"`on` \(((?:`\w+`(?:, )?)+)\)", text)
    assert off and on, "the Switch off section lists no words for off and on"
    for mode, words in ((switch.Mode.OFF, "`off`, " + off[1]), (switch.Mode.ON, on[1])):
        for word in re.findall(r"`(\w+)`", words):
            assert switch.read_mode({switch.ENV: word}) == (mode, None), word
    assert "counts as `auto`, with one WARNING" in text
    mode, problem = switch.read_mode({switch.ENV: "of"})
    assert mode is switch.Mode.AUTO and problem, "an unknown value is not auto"
    assert "`capture_guard`" in text
    assert "pip uninstall vllm-capture-guard" in text


def test_every_patch_is_named_and_no_other():
    named = patch_names_named(README) - FORMER_NAMES.keys()  # "called ... up to"
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
    assert {"status", "check"} <= used, "the README shows no status or no check"
    assert used <= commands, f"no such command: {sorted(used - commands)}"


def test_in_tree_page_names_the_files_patch_apply_changes():
    text = IN_TREE.read_text()
    section_ = text.split("## What it changes", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(vllm/[\w/]+\.py)`", section_))
    assert named == {f"vllm/{f}" for f in FILES}
    count = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    assert f"{count[len(FILES)]} files" in section_.lower()


def test_docs_links_exist():
    links = set(re.findall(r"\]\((docs/[^)#\s]+)", README))
    links |= {s for s in code(README) if re.fullmatch(r"docs/[\w./-]+\.md", s)}
    assert links, "the README links no docs/ page"
    missing = sorted(link for link in links if not (ROOT / link).is_file())
    assert not missing, f"README links pages that do not exist: {missing}"


def test_how_it_works_has_a_row_per_patch():
    """The patches' table, moved out of the README, names each patch once."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| PR #\d+ \|", text, flags=re.M)
    assert sorted(rows) == sorted(NAMES), rows
    assert "docs/how-it-works.md" in README
