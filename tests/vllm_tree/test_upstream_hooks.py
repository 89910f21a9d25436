# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.33.0's own pre-commit hooks pass on ``upstream/vllm/``.

The files we offer vLLM go through the hooks its CI and its contributors run
(``check-spdx-header``, ``ruff-check``, ``ruff-format``, ``typos``,
``check-test-tethering``), from its sdist, laid into a copy of its tree
(``tests/vllm_tree/precommit.py``). A failure names the hook and prints what
it said. A second run with one defect per hook shows that each of them is
really run on our files.

Marked ``once``: nothing here imports vLLM. Needs the package registry once
(the pinned tools, ``.tools/upstream-hooks-*``, and the sdist, cached).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_tree import precommit

pytestmark = pytest.mark.once

#: A test file where no Buildkite job of vLLM's runs it.
UNTETHERED = "tests/v1/test_capture_guard_untethered.py"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return precommit.lay_tree(tmp_path_factory.mktemp("vllm-sdist"))


@pytest.fixture(scope="module")
def tool_dir() -> Path:
    return precommit.tools()


def test_upstream_files_pass_vllms_hooks(tree, tool_dir):
    files = precommit.ours()
    assert len(files) >= 2, sorted(files)
    results = precommit.run(tree, files, tool_dir)
    assert [r.hook for r in results] == list(precommit.HOOKS)
    for r in results:
        assert r.files == sorted(files), (r.hook, r.files)
    failed = [r for r in results if not r.passed]
    assert not failed, (
        f"vLLM {precommit.RELEASE}'s pre-commit fails on upstream/vllm/: "
        + ", ".join(r.hook for r in failed)
        + "\n"
        + precommit.report(results)
    )


def test_each_hook_fails_on_a_defect_of_its_own(tree, tool_dir):
    files = precommit.ours()
    first, second = sorted(files)[:2]
    # the second of vLLM's two SPDX lines dropped (check-spdx-header adds it)
    lines = files[first].decode().splitlines(keepends=True)
    assert lines[0].startswith("# SPDX-") and lines[1].startswith("# SPDX-"), lines[:2]
    files[first] = "".join(lines[:1] + lines[2:]).encode()
    files[second] += (
        # B006, a rule vLLM's config selects and ruff's default does not
        b"\n\ndef _defect(seen=[]):\n    return seen\n"
        b"\n\n_SPACING = [1,2]\n"  # ruff format writes [1, 2]
        b"# capture is teh phase\n"  # typos: teh -> the
    )
    files[UNTETHERED] = precommit.ours()[first]
    results = {r.hook: r for r in precommit.run(tree, files, tool_dir)}
    said = precommit.report(results.values())
    assert not any(r.passed for r in results.values()), said
    spdx = results["check-spdx-header"]
    assert first in spdx.changed and first in spdx.output, said
    assert "B006" in results["ruff-check"].output, said
    assert second in results["ruff-format"].changed, said
    assert "`teh` should be `the`" in results["typos"].output, said
    assert f"error: {UNTETHERED} is not run" in results["check-test-tethering"].output
    # the tree is as it was: the next run sees only what it lays
    assert not (tree / UNTETHERED).exists()
