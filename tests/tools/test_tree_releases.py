# SPDX-License-Identifier: Apache-2.0
"""The in-tree form on copies of the installed 0.27.1 and 0.28.0: patched in
place, the tree itself passes the seed scenario with the guard OFF, and its
capture matches upstream's unpatched 0.29.0 field by field (the differential
oracle); the runtime guard, probing the patched capture, has nothing to do.

Each release is an overlay (``tests/tools/overlay.py``) whose two target
files are real copies, compiled to unchecked-hash bytecode first as an image
built with ``compileall --invalidation-mode unchecked-hash`` would be: a
patcher that left that bytecode in place would leave the old capture running,
and the guard-off check would fail.

Every vLLM import happens in a fresh interpreter, with the overlay first on
``PYTHONPATH``. Marked ``oracle`` (it needs ``make envs``): the version matrix
runs it once.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import variations as var
from tests.tools.overlay import (
    make_overlay,
    overlay_env,
    release_base,
    run_in,
    snapshot,
    target_files,
)
from vllm_capture_guard.lab import oracle
from vllm_capture_guard.tools.tree.files import SIDECAR
from vllm_capture_guard.tools.tree.plan import FILES

pytestmark = pytest.mark.oracle

CHECK = ("-m", "vllm_capture_guard", "check")


@dataclasses.dataclass
class Patched:
    version: str
    root: Path
    base: Path
    original: dict[str, bytes]
    before: subprocess.CompletedProcess
    apply: subprocess.CompletedProcess
    after: subprocess.CompletedProcess
    record: dict
    status: subprocess.CompletedProcess

    def env(self, **extra: str | None) -> dict[str, str]:
        return overlay_env(self.root, self.base, **extra)


@pytest.fixture(scope="module")
def reference(oracle_record) -> dict:
    """Unpatched upstream 0.29.0, guard off (the oracle's own record)."""
    if release_base(oracle.REFERENCE) is None:
        pytest.skip(f"vLLM {oracle.REFERENCE} is not installed here (make envs)")
    return oracle_record(oracle.REFERENCE, "off")[0]


@pytest.fixture(scope="module", params=["0.27.1", "0.28.0"])
def patched(request, tmp_path_factory) -> Patched:
    version = request.param
    base = release_base(version)
    if base is None:
        pytest.skip(f"vLLM {version} is not installed here (make envs)")
    root = make_overlay(base, tmp_path_factory.mktemp(f"overlay-{version}"))
    sources = [str(p) for p in target_files(root).values()]
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q"]
        + ["--invalidation-mode", "unchecked-hash", *sources],
        check=True,
    )
    original = snapshot(root)
    off = overlay_env(root, base, VLLM_CAPTURE_GUARD="off")
    before = run_in(off, *CHECK)
    # the default tree: the vLLM this Python imports, i.e. the overlay's
    apply = run_in(off, "-m", "vllm_capture_guard", "patch", "--apply")
    after = run_in(off, *CHECK)
    out = root.parent / f"{version}-patched-off.json"
    oracle_cli = ("-m", "vllm_capture_guard.lab.oracle", "record")
    rec = run_in(off, *oracle_cli, "--out", str(out))
    assert rec.returncode == 0, rec.stderr[-3000:]
    status = run_in(
        overlay_env(root, base, VLLM_CAPTURE_GUARD="on"),
        "-m",
        "vllm_capture_guard",
        "status",
    )
    return Patched(
        version, root, base, original, before, apply, after,
        json.loads(out.read_text()), status,
    )  # fmt: skip


def test_unpatched_copy_fails_with_guard_off(patched):
    """The control: the copy is affected before the patch."""
    out = patched.before.stdout
    assert patched.before.returncode == 1, out + patched.before.stderr[-2000:]
    assert f"vLLM {patched.version}: " in out and "VLLM_CAPTURE_GUARD=off;" in out
    assert "ROCM_ATTN: FAIL" in out and "ROCM_AITER_UNIFIED_ATTN: FAIL" in out


def test_patched_tree_passes_with_guard_off(patched):
    assert patched.apply.returncode == 0, patched.apply.stdout
    assert patched.apply.stdout.count("patched vllm/") == len(FILES)
    assert "compiled again" in patched.apply.stdout  # the hash-based bytecode
    out = patched.after.stdout
    assert patched.after.returncode == 0, out + patched.after.stderr[-2000:]
    assert f"vLLM {patched.version}: " in out and "VLLM_CAPTURE_GUARD=off;" in out
    # every capture size vLLM derives (512 down to 1) passes
    assert "ROCM_ATTN: PASS, 51/51 capture sizes" in out
    assert "ROCM_AITER_UNIFIED_ATTN: PASS, 51/51 capture sizes" in out


def test_patched_tree_matches_upstream_029(patched, reference):
    assert patched.record["vllm"] == patched.version
    assert patched.record["guard_action"] == "disabled"
    result = oracle.compare(reference, patched.record)
    assert result.ok, result.report()
    assert result.compared > 1000
    builders = {
        g["builder"]
        for case in patched.record["cases"].values()
        for g in case["groups"]
    }
    assert "RocmAiterUnifiedAttentionMetadataBuilder" in builders


def test_runtime_guard_has_nothing_to_do_and_status_sees_the_tree(patched):
    out = patched.status.stdout
    assert patched.status.returncode == 0, out + patched.status.stderr[-2000:]
    # the guard's own probe ran the patched capture: nothing written
    assert "builder-capture-guard: not needed" in out
    assert "rocm-aiter-unified-builder: not needed" in out
    assert "affected:    no" in out
    assert "in-tree fix: yes: this vLLM's files carry the backports" in out
    assert "PR #51585, PR #53821" in out


def test_second_apply_and_revert_on_the_patched_copy(patched, tmp_path):
    """On a copy of the patched files (the overlay stays patched for the
    other tests): a second --apply changes nothing; --revert restores every
    file byte for byte."""
    from tests.tools.test_tree import make_tree

    data = {k: p.read_bytes() for k, p in target_files(patched.root).items()}
    tree = make_tree(tmp_path, data)
    for inside, path in target_files(patched.root).items():
        saved = path.with_name(path.name + SIDECAR)
        (tree / "vllm" / inside).with_name(saved.name).write_bytes(saved.read_bytes())
    env = patched.env()
    again = run_in(env, "-m", "vllm_capture_guard", "patch", "--apply", "--tree", tree)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert snapshot(tree) == data
    back = run_in(env, "-m", "vllm_capture_guard", "patch", "--revert", "--tree", tree)
    assert back.returncode == 0, back.stdout
    assert snapshot(tree) == patched.original


@pytest.mark.parametrize("name", sorted(var.ACCEPTED))
def test_accepted_variation_passes_with_guard_off(name, tmp_path):
    """A vendor-style variation of 0.28.0 that the patcher accepts: once
    patched, the seed scenario passes with the guard off."""
    base = release_base("0.28.0")
    if base is None:
        pytest.skip("vLLM 0.28.0 is not installed here")
    root = make_overlay(base, tmp_path / "overlay")
    data = var.ACCEPTED[name](snapshot(root))
    for inside, path in target_files(root).items():
        path.write_bytes(data[inside])
    off = overlay_env(root, base, VLLM_CAPTURE_GUARD="off")
    before = run_in(off, *CHECK)
    assert before.returncode == 1, before.stdout  # the variation is affected
    apply = run_in(off, "-m", "vllm_capture_guard", "patch", "--apply")
    assert apply.returncode == 0, apply.stdout
    after = run_in(off, *CHECK)
    assert after.returncode == 0, after.stdout + after.stderr[-2000:]


#: The patched file's own AITER builder on mocks: every call on the offsets
#: would be recorded (a zero-then-restore included, which no value compare sees).
NO_OFFSET_WRITES = """
import json, torch
from unittest.mock import MagicMock
from vllm.v1.attention.backends import rocm_aiter_unified_attn as m
cls = m.RocmAiterUnifiedAttentionBackend.get_builder_cls()
builder = object.__new__(cls)
metadata = MagicMock()
metadata.seq_lens = torch.tensor([9, 9], dtype=torch.int32)
builder.build = MagicMock(return_value=metadata)
common = MagicMock()
got = builder.build_for_cudagraph_capture(common)
print(json.dumps({
    "builder": cls.__name__, "module": cls.__module__, "file": m.__file__,
    "returns": got is metadata, "build_calls": len(builder.build.call_args_list),
    "seq_lens": metadata.seq_lens.tolist(),
    "offset_calls": [str(c) for c in common.query_start_loc.method_calls
                     + common.query_start_loc_cpu.method_calls],
}))
"""


def test_patched_aiter_builder_writes_no_offsets(patched):
    proc = run_in(patched.env(VLLM_CAPTURE_GUARD="off"), "-c", NO_OFFSET_WRITES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["builder"] == "RocmAiterUnifiedAttentionMetadataBuilder"
    assert out["module"] == "vllm.v1.attention.backends.rocm_aiter_unified_attn"
    assert out["file"].startswith(str(patched.root))
    assert out["returns"] and out["build_calls"] == 1
    assert out["seq_lens"] == [1, 1]
    assert out["offset_calls"] == []
