# SPDX-License-Identifier: Apache-2.0
"""The in-tree patcher on the vendor variants of ``tests/variants.py``
(modified copies of vLLM 0.28.0's ROCm files, derived at test time): for
each one it either fixes the tree, which then passes the seed scenario with
the guard OFF, or refuses with exit 2 and writes nothing. It never leaves a
file that fails to import or still crashes.
"""

from __future__ import annotations

import pytest

from tests.tools.overlay import (
    make_overlay,
    overlay_env,
    release_base,
    run_in,
    snapshot,
    target_files,
)
from tests.tools.test_tree import make_tree, state
from vllm_capture_guard.tools.cli import main
from vllm_capture_guard.tools.tree.plan import FILES

try:
    from tests import variants
except ImportError:  # pragma: no cover - the variants arrive with their branch
    pytest.skip(
        "tests/variants.py (vendor variants) is not here", allow_module_level=True
    )

NAMES = sorted(variants.VARIANTS)


def variant_files(name: str) -> dict[str, bytes]:
    """Installed 0.28.0 files with variant ``name``'s changes."""
    base = release_base("0.28.0")
    if base is None:
        pytest.skip("vLLM 0.28.0 is not installed here")
    installed = variants.Installed(base / "vllm")
    data = {inside: (base / "vllm" / inside).read_bytes() for inside in FILES}
    for rel, text in variants.derive(name, installed).items():
        data[rel] = text.encode()
    return data


@pytest.mark.parametrize("name", NAMES)
def test_fixed_or_refused_without_writing(name, tmp_path, capsys):
    root = make_tree(tmp_path, variant_files(name))
    before = state(root)
    code = main(["patch", "--check", "--tree", str(root)])
    out = capsys.readouterr().out
    assert code in (1, 2), out
    if code == 2:
        assert "not recognised:" in out  # names what was not found
        assert main(["patch", "--apply", "--tree", str(root)]) == 2
        assert state(root) == before
        return
    assert main(["patch", "--apply", "--tree", str(root)]) == 0
    for inside in FILES:
        compile((root / "vllm" / inside).read_bytes(), inside, "exec")


@pytest.mark.oracle
def test_every_fixed_variant_passes_with_guard_off(tmp_path, capsys):
    """Each variant the patcher accepts: affected before (the control), and
    the seed scenario passes with the guard off once patched in place."""
    accepted = []
    for name in NAMES:
        root = make_tree(tmp_path / name, variant_files(name))
        if main(["patch", "--check", "--tree", str(root)]) == 1:
            accepted.append(name)
    capsys.readouterr()
    if not accepted:
        pytest.skip("the patcher refuses every variant (each checked above)")
    base = release_base("0.28.0")
    check = ("-m", "vllm_capture_guard", "check")
    for name in accepted:
        root = make_overlay(base, tmp_path / f"overlay-{name}")
        data = variant_files(name)
        for inside, path in target_files(root).items():
            path.write_bytes(data[inside])
        assert snapshot(root) == data
        off = overlay_env(root, base, VLLM_CAPTURE_GUARD="off")
        before = run_in(off, *check)
        assert before.returncode == 1, (name, before.stdout)  # affected
        apply = run_in(off, "-m", "vllm_capture_guard", "patch", "--apply")
        assert apply.returncode == 0, (name, apply.stdout)
        after = run_in(off, *check)
        assert after.returncode == 0, (name, after.stdout + after.stderr[-2000:])
