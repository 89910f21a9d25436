# SPDX-License-Identifier: Apache-2.0
"""The variant maker itself (:mod:`tests.variants`), in process and fast: each
transformation changes what it says on the installed file, fails loudly on a
file without that structure, skips on a fixed release, and the overlay is laid
out as promised. Whether vLLM runs the variants is
``tests/test_vendor_variants.py``'s business."""

from __future__ import annotations

import ast
import os

import pytest

from tests import variants as vv
from vllm_capture_guard.lab.oracle.releases import env_dir

APPLIES, WHY = vv.applicability()
needs_affected = pytest.mark.skipif(not APPLIES, reason=WHY)


@pytest.fixture(scope="module")
def installed() -> vv.Installed:
    return vv.Installed()


def _tree(files: dict[str, str], rel: str = vv.ROCM_ATTN) -> ast.Module:
    return ast.parse(files[rel])


def _methods(tree: ast.Module, cls: str) -> set[str]:
    return {
        n.name for n in vv.find_class(tree, cls).body if isinstance(n, ast.FunctionDef)
    }


def _returns(tree: ast.Module, backend: str) -> str:
    fn = vv.find_method(vv.find_class(tree, backend), "get_builder_cls")
    (ret,) = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    return ast.unparse(ret.value)


def _zeroed(fn: ast.FunctionDef) -> set[str]:
    return set(vv.zeroing_statements(fn))


@needs_affected
@pytest.mark.parametrize("name", list(vv.VARIANTS))
def test_every_variant_derives_and_is_marked(installed, name):
    files = vv.derive(name, installed)
    assert files and set(files) <= {vv.ROCM_ATTN, vv.AITER_UNIFIED}
    for rel, text in files.items():
        assert text != installed[rel]
        assert f"\n{vv.MARKER} = " in text
        compile(text, rel, "exec")


@needs_affected
def test_capture_in_mixin(installed):
    tree = _tree(vv.derive("capture-in-mixin", installed))
    builder = vv.find_class(tree, vv.BUILDER)
    assert vv.CAPTURE not in _methods(tree, vv.BUILDER)
    assert ast.unparse(builder.bases[0]) == vv.MIXIN
    mixin_capture = vv.find_method(vv.find_class(tree, vv.MIXIN), vv.CAPTURE)
    assert _zeroed(mixin_capture) == {vv.DEVICE_FIELD, vv.CPU_FIELD}
    # the rest of the builder is untouched
    assert {"__init__", "build"} <= _methods(tree, vv.BUILDER)


@needs_affected
def test_builder_subclass(installed):
    tree = _tree(vv.derive("builder-subclass", installed))
    sub = vv.find_class(tree, vv.VENDOR_BUILDER)
    assert [ast.unparse(b) for b in sub.bases] == [vv.BUILDER]
    assert _zeroed(vv.find_method(sub, vv.CAPTURE)) == {vv.DEVICE_FIELD, vv.CPU_FIELD}
    base_capture = vv.find_method(vv.find_class(tree, vv.BUILDER), vv.CAPTURE)
    assert _zeroed(base_capture) == {vv.DEVICE_FIELD, vv.CPU_FIELD}
    assert _returns(tree, vv.BACKEND) == vv.VENDOR_BUILDER


@needs_affected
def test_probe_needs_init(installed):
    tree = _tree(vv.derive("probe-needs-init", installed))
    cls = vv.find_class(tree, vv.BUILDER)

    def reads(fn: str) -> set[str]:
        return {
            n.attr
            for n in ast.walk(vv.find_method(cls, fn))
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
        }

    assert {"num_heads_kv", "block_size"} <= reads("build")
    assert "vllm_config" in reads(vv.CAPTURE)


@needs_affected
def test_zeroing_only_on_gpu(installed):
    tree = _tree(vv.derive("zeroing-only-on-gpu", installed))
    fn = vv.find_method(vv.find_class(tree, vv.BUILDER), vv.CAPTURE)
    arg = fn.args.args[1].arg
    guarded = {
        field: ast.unparse(node.test)
        for node in ast.walk(fn)
        if isinstance(node, ast.If)
        for field in vv.zeroing_in(node.body, arg)
    }
    assert guarded[vv.DEVICE_FIELD].endswith(".query_start_loc.is_cuda")
    assert guarded[vv.CPU_FIELD].endswith(".query_start_loc.device.type != 'cpu'")


@needs_affected
def test_helper_zeroing_and_aiter_vendor_builder(installed):
    files = vv.derive("helper-zeroing+aiter-vendor-builder", installed)
    rocm, aiter = _tree(files), _tree(files, vv.AITER_UNIFIED)
    capture = vv.find_method(vv.find_class(rocm, vv.BUILDER), vv.CAPTURE)
    assert _zeroed(capture) == set()
    assert vv.HELPER in {
        n.func.id
        for n in ast.walk(capture)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    (helper,) = [
        n for n in rocm.body if isinstance(n, ast.FunctionDef) and n.name == vv.HELPER
    ]
    body = ast.unparse(helper)
    assert ".query_start_loc.fill_(0)" in body
    assert ".query_start_loc_cpu[:] = 0" in body
    vendor = vv.find_class(aiter, vv.AITER_VENDOR_BUILDER, vv.AITER_UNIFIED)
    assert [ast.unparse(b) for b in vendor.bases] == [vv.BUILDER]
    assert _zeroed(vv.find_method(vendor, vv.CAPTURE)) == {
        vv.DEVICE_FIELD,
        vv.CPU_FIELD,
    }
    assert _returns(aiter, vv.AITER_BACKEND) == vv.AITER_VENDOR_BUILDER


# --- loud on the unexpected, quiet skip on a fixed release -------------------


def _without_line(text: str, needle: str) -> str:
    lines = text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if needle in line]
    assert len(hits) == 1, (needle, hits)
    del lines[hits[0]]
    return "".join(lines)


@pytest.mark.parametrize("name", list(vv.VARIANTS))
def test_unexpected_structure_fails_loudly(installed, name):
    """No device zeroing in the capture: not a file these variants know."""
    text = _without_line(installed[vv.ROCM_ATTN], ".query_start_loc.zero_()")
    broken = {vv.ROCM_ATTN: text, vv.AITER_UNIFIED: installed[vv.AITER_UNIFIED]}
    with pytest.raises(vv.VariantMismatch, match="not shaped"):
        vv.derive(name, broken)
    with pytest.raises(vv.VariantMismatch, match="0 classes named"):
        vv.derive(name, {vv.ROCM_ATTN: "x = 1\n", vv.AITER_UNIFIED: ""})


@needs_affected
def test_aiter_without_rocm_import_fails_loudly(installed):
    aiter = installed[vv.AITER_UNIFIED].replace(vv.ROCM_MODULE, "vllm.elsewhere")
    src = {vv.ROCM_ATTN: installed[vv.ROCM_ATTN], vv.AITER_UNIFIED: aiter}
    with pytest.raises(vv.VariantMismatch, match="does not import"):
        vv.derive("helper-zeroing+aiter-vendor-builder", src)


@needs_affected
def test_upstream_fix_makes_variants_not_applicable(installed):
    """The installed capture without its CPU zeroing line is what PR #51585
    made of it: every variant declines, with the reason."""
    fixed = _without_line(installed[vv.ROCM_ATTN], ".query_start_loc_cpu.zero_()")
    src = {vv.ROCM_ATTN: fixed, vv.AITER_UNIFIED: installed[vv.AITER_UNIFIED]}
    for name in vv.VARIANTS:
        with pytest.raises(vv.VariantNotApplicable, match="PR #51585"):
            vv.derive(name, src)


@pytest.mark.parametrize("release", ["0.29.0", "0.33.0"])
def test_fixed_releases_are_not_applicable(release):
    folder = env_dir(release)
    if folder is None:
        pytest.skip(f"no environment for vLLM {release} (make envs)")
    applies, why = vv.applicability(folder / "vllm")
    assert not applies and "PR #51585" in why


# --- the overlay --------------------------------------------------------------


@needs_affected
def test_overlay_layout(installed, tmp_path):
    files = vv.derive("helper-zeroing+aiter-vendor-builder", installed)
    dest = vv.make_overlay(files, tmp_path)
    root = dest / "vllm"
    source = vv.installed_vllm_dir()
    for folder in ("", "v1", "v1/attention", "v1/attention/backends"):
        path = root / folder
        assert path.is_dir() and not path.is_symlink(), folder
    for rel, text in files.items():
        assert not (root / rel).is_symlink()
        assert (root / rel).read_text() == text
    # everything else is the installed package itself
    assert (root / "config").is_symlink()
    assert (root / "config").resolve() == source / "config"
    assert (root / "__init__.py").resolve() == source / "__init__.py"
    backends = root / "v1/attention/backends"
    for entry in (source / "v1/attention/backends").iterdir():
        if entry.name in ("rocm_attn.py", "rocm_aiter_unified_attn.py"):
            continue
        mirrored = backends / entry.name
        if entry.name == "__pycache__":
            assert mirrored.is_dir() and not mirrored.is_symlink()
            names = {p.name.split(".")[0] for p in mirrored.iterdir()}
            assert not names & {"rocm_attn", "rocm_aiter_unified_attn"}
        else:
            assert mirrored.is_symlink() and os.readlink(mirrored) == str(entry)


def test_overlay_refuses_a_file_vllm_does_not_have(tmp_path):
    with pytest.raises(vv.VariantMismatch, match="not in the installed package"):
        vv.make_overlay({"v1/attention/backends/nope.py": "x = 1\n"}, tmp_path)


def test_overlay_env_puts_the_overlay_first(tmp_path):
    env = vv.overlay_env(tmp_path, {"PYTHONPATH": os.pathsep.join(["a", "b"])})
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(tmp_path),
        str(vv.ROOT),
        "a",
        "b",
    ]
