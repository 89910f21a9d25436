# SPDX-License-Identifier: Apache-2.0
"""A new backport needs its runtime module, its tools module and its line in the
list of patches, and nothing else (docs/adding-a-backport.md). In a scratch copy
of the package, a fake backport gets exactly those three; then ``status``,
``check --json``, ``patch --check``, the version matrix's facts, identity and
revert must all pick it up, with no other edit.

The fake applies on ``rocm_attn`` and gives ``RocmAttentionImpl`` one new
attribute of ours; its in-tree form puts a marker line at the top of
``flash_attn.py``; its reading of the imported code always says "needed".
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import fresh_env

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vllm_capture_guard"
NAME = "fake-fix"

RUNTIME_MODULE = '''
# SPDX-License-Identifier: Apache-2.0
"""A fake backport, for a test: ``RocmAttentionImpl`` gets one attribute."""

from __future__ import annotations

from types import ModuleType

from vllm_capture_guard.runtime import patching

MODULE = "vllm.v1.attention.backends.rocm_attn"
CLASS, ATTRIBUTE = "RocmAttentionImpl", "capture_guard_fake_fix"


def fake_fix(self) -> bool:
    return True


class FakeFix(patching.Patch):
    name, pr = "fake-fix", "#1"
    modules, backends = (MODULE,), ()
    targets = ((MODULE, CLASS),)

    def plan(self, module: ModuleType) -> patching.Outcome:
        cls = getattr(module, CLASS)
        if ATTRIBUTE in vars(cls):
            return patching.Outcome(self.name, patching.Status.ALREADY, "there")
        needed = patching.Status.NEEDED
        return patching.Outcome(self.name, needed, "one attribute", None, cls)

    def install(self, plan: patching.Outcome) -> str:
        setattr(fake_fix, patching.MARKER, None)
        setattr(plan.data, ATTRIBUTE, fake_fix)
        return "one attribute set (fake backport)"
'''

TOOLS_MODULE = '''
# SPDX-License-Identifier: Apache-2.0
"""The tools' side of the fake backport."""

from __future__ import annotations

import sys

from vllm_capture_guard.runtime import patching
from vllm_capture_guard.runtime.patches import fake_fix as runtime
from vllm_capture_guard.tools import static
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.source import Edit, marker

CONSEQUENCE = "the fake's consequence"
FIX, PR = runtime.FakeFix.name, runtime.FakeFix.pr
FILE = "v1/attention/backends/flash_attn.py"
TREE_FILES = (FILE,)
MARK = marker(PR, "fake")


def readings():
    return [static.Reading("fake site", True, "the fake always reads as needed")]


def judgements(checked):
    from vllm_capture_guard.tools.verdict import Judgement

    return [Judgement("the fake's check", FIX, PR, True, 1, 1, "sites")]


def fails_as(judgement) -> str:
    return "the fake's failure"


def undo() -> bool:
    cls = getattr(sys.modules.get(runtime.MODULE), runtime.CLASS, None)
    if cls is None or not patching.is_guarded(vars(cls).get(runtime.ATTRIBUTE)):
        return False
    delattr(cls, runtime.ATTRIBUTE)
    return True


def tree_findings(sources, broken, tree, context):
    rel = tree.rel(FILE)
    src = sources.get(FILE)
    if FILE in broken or src is None:
        return [model.Finding(FIX, PR, rel, model.UNRECOGNISED, "not readable")]
    if src.lines and src.lines[0].rstrip(b"\\r\\n") == MARK:
        return [model.Finding(FIX, PR, rel, model.APPLIED, "marker present")]
    edit = Edit(0, 0, (MARK,))
    return [model.Finding(FIX, PR, rel, model.NEEDED, "no marker yet", (edit,))]
'''

PROBE = """
import json, sys
sys.path.insert(0, {scripts!r})
import vllm_capture_guard
from vllm_capture_guard.lab import identity
from vllm_capture_guard.tools import fixes, revert
from vllm_capture_guard.tools.tree.plan import FILES
import version_matrix

out = {{"package": vllm_capture_guard.__file__, "files": list(FILES)}}
read = version_matrix.read_facts()
out["read_only"] = read["read_only"]
out["affected_cell"] = version_matrix._read_only(read)
out["identity"] = identity.targets()
changes = identity.around_plugin_load()
out["changed"] = changes.get("RocmAttentionImpl")
patch = fixes.by_name("fake-fix")
import vllm.v1.attention.backends.rocm_attn as rocm_attn
out["set"] = hasattr(rocm_attn.RocmAttentionImpl, "capture_guard_fake_fix")
out["reverted"] = revert.revert(patch)
out["after_revert"] = hasattr(rocm_attn.RocmAttentionImpl, "capture_guard_fake_fix")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """The package copied, with the fake's runtime module, tools module and its
    line in the list of patches; nothing else changed."""
    src = tmp_path_factory.mktemp("scratch") / "src"
    shutil.copytree(
        PACKAGE, src / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__")
    )
    copy = src / PACKAGE.name
    (copy / "runtime/patches/fake_fix.py").write_text(RUNTIME_MODULE.lstrip())
    (copy / "tools/fixes/fake_fix.py").write_text(TOOLS_MODULE.lstrip())
    listing = copy / "runtime/patches/__init__.py"
    text = listing.read_text()
    line = "    stream.GraphCaptureStream(),\n"
    assert text.count(line) == 1, "the list of patches changed: update this test"
    text = text.replace(line, line + "    fake.FakeFix(),\n")
    text = text.replace(
        "from vllm_capture_guard.runtime.patches import graph_capture_stream",
        "from vllm_capture_guard.runtime.patches import fake_fix as fake\n"
        "from vllm_capture_guard.runtime.patches import graph_capture_stream",
    )
    listing.write_text(text)
    return src


def _run(scratch: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = fresh_env(PYTHONPATH=str(scratch), VLLM_CAPTURE_GUARD="on")
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
    )


def test_status_reads_it_and_sees_it_installed(scratch):
    proc = _run(scratch, "-m", "vllm_capture_guard", "status", "--json")
    found = json.loads(proc.stdout)
    fake = {p["name"]: p for p in found["patches"]}[NAME]
    assert fake["status"] == "needed", fake
    assert "the fake always reads as needed" in fake["detail"], fake
    assert "the fake's consequence" in fake["detail"], fake
    assert fake["guard"] == "patched", fake


def test_check_applies_it(scratch):
    proc = _run(scratch, "-m", "vllm_capture_guard", "check", "--json")
    found = json.loads(proc.stdout)
    assert f"{NAME}: patched (one attribute set (fake backport))" in found["guard"]
    checks = [c for c in found["checks"] if c["fix"] == NAME]
    assert [(c["name"], c["ok"]) for c in checks] == [("the fake's check", True)]


def test_patch_check_and_diff_carry_its_in_tree_form(scratch):
    proc = _run(scratch, "-m", "vllm_capture_guard", "patch", "--check", "--json")
    found = json.loads(proc.stdout)
    fake = [f for f in found["findings"] if f["fix"] == NAME]
    assert len(fake) == 1 and fake[0]["state"] == "needs the fix", found
    assert fake[0]["file"].endswith("vllm/v1/attention/backends/flash_attn.py")
    diff = _run(scratch, "-m", "vllm_capture_guard", "patch", "--diff")
    assert "+# vllm-capture-guard: backport of vllm PR #1 (fake)" in diff.stdout


def test_matrix_identity_and_revert_take_it(scratch):
    probe = PROBE.format(scripts=str(ROOT / "scripts"))
    proc = _run(scratch, "-c", textwrap.dedent(probe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(scratch)), out["package"]
    assert "v1/attention/backends/flash_attn.py" in out["files"]
    assert NAME in out["read_only"]
    assert f"{NAME}: **needed** (1/1 sites, read)" in out["affected_cell"]
    assert out["identity"]["RocmAttentionImpl"][1] == "RocmAttentionImpl"
    assert out["changed"]["changed"] == ["capture_guard_fake_fix"], out["changed"]
    assert out["set"] is True
    assert out["reverted"] is True and out["after_revert"] is False
