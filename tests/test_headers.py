# SPDX-License-Identifier: Apache-2.0
"""Licence headers: ours carry the SPDX line, files for vLLM's tree vLLM's two.

Every Python and shell file of the project opens with
``# SPDX-License-Identifier: Apache-2.0`` (after a shebang) and carries no
copyright line. The files under ``upstream/vllm/`` are written for vLLM's
tree, whose ``check-spdx-header`` hook (``tools/pre_commit/``) asks every
Python, Rust and protobuf file for the licence line and vLLM's copyright line;
they open with both, in that order, as vLLM's own files do
(``tests/vllm_tree/test_upstream_hooks.py`` runs the hook itself).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = "upstream/vllm/"
LICENSE = "SPDX-License-Identifier: Apache-2.0"
COPYRIGHT = "SPDX-FileCopyrightText: Copyright contributors to the vLLM project"
#: What vLLM's check-spdx-header checks, and its comment prefix.
VLLM_CHECKED = {".py": "#", ".rs": "//", ".proto": "//"}


def _tracked() -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [p for p in out.stdout.splitlines() if (ROOT / p).is_file()]


def _header(path: str, lines: int) -> list[str]:
    text = (ROOT / path).read_text().splitlines()
    if text and text[0].startswith("#!"):
        text = text[1:]
    return text[:lines]


def test_our_files_carry_the_spdx_line_and_no_copyright_line():
    ours = [
        p
        for p in _tracked()
        if not p.startswith(UPSTREAM) and (p.endswith((".py", ".sh")) or p == ".ci/run")
    ]
    assert len(ours) > 100, len(ours)
    missing = [p for p in ours if _header(p, 1) != [f"# {LICENSE}"]]
    assert not missing, f"first line (after a shebang) is not '# {LICENSE}': {missing}"
    copyright_line = [
        p
        for p in ours
        if any(line.strip() == f"# {COPYRIGHT}" for line in _header(p, 10**6))
    ]
    assert not copyright_line, (
        f"vLLM's copyright line outside {UPSTREAM}: {copyright_line}"
    )


def test_files_for_vllms_tree_open_with_vllms_two_spdx_lines():
    checked = [
        p
        for p in _tracked()
        if p.startswith(UPSTREAM) and Path(p).suffix in VLLM_CHECKED
    ]
    assert len(checked) >= 2, checked
    wrong = {}
    for path in checked:
        prefix = VLLM_CHECKED[Path(path).suffix]
        want = [f"{prefix} {LICENSE}", f"{prefix} {COPYRIGHT}"]
        if (got := _header(path, 2)) != want:
            wrong[path] = got
    assert not wrong, f"want vLLM's two SPDX lines first: {wrong}"
