# SPDX-License-Identifier: Apache-2.0
"""The rooms: what runs inside ``vllm serve`` (runtime/) imports nothing of
the package outside it (the tools, the lab), the operator's tools import
nothing of the maintainers' lab, and no source file grows past what one
reader holds."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

import vllm_capture_guard
from tests.conftest import run_snippet

PACKAGE = Path(vllm_capture_guard.__file__).parent
MAX_LINES = 400

# Fresh interpreter: no package of ours but the runtime can be imported at
# all; the plugin is loaded by vLLM's own loader and its hooks fire when vLLM
# imports a backend.
BLOCKED = """
import importlib.abc, json, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        ours = name.startswith("vllm_capture_guard.")
        runtime = name == "vllm_capture_guard.runtime" or name.startswith(
            "vllm_capture_guard.runtime."
        )
        if ours and not runtime:
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Blocker())
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.v1.attention.backends.registry import AttentionBackendEnum
AttentionBackendEnum["ROCM_ATTN"].get_class()  # what vLLM does before capture
from vllm_capture_guard.runtime import plugin
r = plugin.report()
print(json.dumps({
    "action": r.action,
    "failures": r.failures,
    "outcomes": {k: o.status.value for k, o in r.outcomes.items()},
    "outside": sorted(
        m for m in sys.modules
        if m.startswith("vllm_capture_guard.")
        and not m.startswith("vllm_capture_guard.runtime")
    ),
}))
"""


def test_runtime_runs_with_everything_outside_it_unimportable():
    out, logs = run_snippet(BLOCKED, VLLM_CAPTURE_GUARD="on")
    assert out["outside"] == []
    assert out["failures"] == [], logs[-3000:]
    assert out["action"] in ("patched", "not needed"), out
    assert "builder-capture-guard" in out["outcomes"]
    assert "blocked:" not in logs


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, by absolute name (``from a import b``
    counts as ``a`` and ``a.b``, since ``b`` may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_runtime_sources_name_no_module_outside_the_runtime():
    runtime = sorted((PACKAGE / "runtime").rglob("*.py"))
    assert len(runtime) >= 5
    for path in runtime:
        bad = [
            m
            for m in _imports(path)
            if m.startswith("vllm_capture_guard.")
            and not m.startswith("vllm_capture_guard.runtime")
        ]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_the_operators_tools_name_nothing_of_the_lab():
    tools = sorted((PACKAGE / "tools").rglob("*.py"))
    assert len(tools) >= 10
    for path in tools:
        bad = [m for m in _imports(path) if m.startswith("vllm_capture_guard.lab")]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_no_source_file_is_longer_than_one_reader_holds():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


#: What loads inside ``vllm serve``, as ruff formats it (``make lint`` checks
#: the format): at most this many lines, none kept from ruff by ``fmt: skip``.
RUNTIME_CEILING = 1500


def test_the_runtime_is_small_and_formatted_as_ruff_formats_it():
    runtime = sorted((PACKAGE / "runtime").rglob("*.py"))
    skipped = [
        str(p.relative_to(PACKAGE)) for p in runtime if "fmt: skip" in p.read_text()
    ]
    assert not skipped, f"fmt: skip in the runtime: {skipped}"
    lines = sum(len(p.read_text().splitlines()) for p in runtime)
    assert lines <= RUNTIME_CEILING, f"the runtime has {lines} lines"


def test_every_python_file_carries_the_licence_line():
    """Ours, and Apache-2.0: the first or second line of every file we keep."""
    root = PACKAGE.parents[1]
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True
    )
    if tracked.returncode:
        pytest.skip("not a git checkout")
    names = tracked.stdout.split()
    assert len(names) > 50
    bare = [
        n
        for n in names
        if "SPDX-License-Identifier" not in "".join((root / n).open().readlines()[:2])
    ]
    assert not bare, bare
