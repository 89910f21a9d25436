# SPDX-License-Identifier: Apache-2.0
"""One reader per fix site of the two ROCm builders: ``status`` hands each
fix's ``read_source()`` the source of the module this process imported,
``patch --check`` the file's bytes. They agree on the installed release (each
release of the matrix) and on every vendor variant of ``tests/variants.py``,
and both follow the reader when it changes.

The capture-stream sites have the same test in ``test_tree_capture_stream.py``.
"""

from __future__ import annotations

import json

import pytest

from tests import variants
from tests.tools.overlay import run_in
from vllm_capture_guard.tools import static
from vllm_capture_guard.tools.fixes import builder_capture_guard as guard_fix
from vllm_capture_guard.tools.fixes import rocm_aiter_unified_builder as aiter_fix
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.source import Source

#: What status's reading says, for each state of patch --check's finding.
AGREES = {
    model.NEEDED: True,
    model.APPLIED: False,
    model.UPSTREAM: False,
    model.ABSENT: False,
    model.UNRECOGNISED: None,
}

#: Run in a process with a variant in front of vLLM: both readings, as JSON.
BOTH = """
import json
from vllm_capture_guard.tools.fixes import builder_capture_guard as g
from vllm_capture_guard.tools.fixes import rocm_aiter_unified_builder as a
from vllm_capture_guard.tools.tree.locate import find_tree
from vllm_capture_guard.tools.tree.plan import make_plan

print(json.dumps({
    "status": {
        "guard": [r.needed for r in g.readings()],
        "aiter": [r.needed for r in a.readings()],
    },
    "patch": {f.fix: f.state.value for f in make_plan(find_tree()).findings},
}))
"""


def both_readings() -> dict:
    from vllm_capture_guard.tools.tree.locate import find_tree
    from vllm_capture_guard.tools.tree.plan import make_plan

    return {
        "status": {
            "guard": [r.needed for r in guard_fix.readings()],
            "aiter": [r.needed for r in aiter_fix.readings()],
        },
        "patch": {f.fix: f.state for f in make_plan(find_tree()).findings},
    }


def assert_agree(found: dict, where: str) -> None:
    """ROCM_ATTN's reading is ``rocm_attn.py``'s finding; the AITER fix's is
    its file's; the guard's AITER row is the ROCm builder's where the AITER
    backend returns that builder, and not needed where it has its own."""
    rocm = model.State(found["patch"][guard_fix.FIX])
    aiter = model.State(found["patch"][aiter_fix.FIX])
    rocm_row, aiter_row = found["status"]["guard"]
    assert rocm_row is AGREES[rocm], (where, found)
    assert found["status"]["aiter"] == [AGREES[aiter]], (where, found)
    expected = AGREES[rocm] if aiter == model.NEEDED else AGREES[aiter]
    assert aiter_row is expected, (where, found)


def test_status_and_patch_check_agree_on_this_release():
    found = both_readings()
    assert_agree(found, "the installed vLLM")
    assert found["status"]["guard"][0] is not None, "ROCM_ATTN not read here"


def test_rocm_attn_reads_as_needed_exactly_where_its_capture_zeroes_the_cpu_offsets(
    unpatched, zeroes_cpu_offsets
):
    """Decided against vLLM's own capture run unguarded (the fixture)."""
    reading = guard_fix.read_imported_rocm().reading
    assert reading.needed is zeroes_cpu_offsets, reading


#: A module of ours, imported from a file, then read back (no future import
#: here: the reading must not take the tools' own compile flags).
VENDOR = """
import functools


def traced(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return fn(*args)

    return wrapper


class B:
    def capture(self, cm):
        def inner(x: int) -> int:
            return x

        cm.x_cpu.zero_()

    @traced
    def decorated(self, cm):
        pass
"""


def _vendor(tmp_path, monkeypatch, text: str):  # noqa: ANN202
    import importlib

    (tmp_path / "vendor_changed.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("vendor_changed")


def _why(tmp_path, module, qualname: str) -> str | None:
    import inspect
    import linecache

    linecache.checkcache()
    text = inspect.getsource(module).encode()
    src = Source.parse(tmp_path / "vendor_changed.py", "vendor_changed.py", text)
    return static.not_as_read(src, module.B.__dict__[qualname.split(".")[1]], qualname)


def test_a_file_changed_after_import_is_not_what_runs(tmp_path, monkeypatch):
    """An in-tree patch applied under a running process: the file no longer
    says what runs, so status must not read it as the code it runs."""
    module = _vendor(tmp_path, monkeypatch, VENDOR)
    assert _why(tmp_path, module, "B.capture") is None
    for edit in (("zero_", "fill_"), ("    def capture", "\n    def capture")):
        (tmp_path / "vendor_changed.py").write_text(VENDOR.replace(*edit))
        why = _why(tmp_path, module, "B.capture")
        assert why is not None and "changed since import" in why, (edit, why)


def test_a_decorated_function_is_not_what_the_file_says(tmp_path, monkeypatch):
    module = _vendor(tmp_path, monkeypatch, VENDOR)
    assert _why(tmp_path, module, "B.decorated") == "B.decorated is decorated"


def test_a_backend_that_returns_another_builder_is_in_doubt(monkeypatch, unpatched):
    """A vendor's ROCM_ATTN that returns a builder of its own: reading
    rocm_attn.py's builder says nothing of it."""
    from vllm.v1.attention.backends import rocm_attn

    class VendorBuilder(rocm_attn.RocmAttentionMetadataBuilder):
        pass

    monkeypatch.setattr(
        rocm_attn.RocmAttentionBackend,
        "get_builder_cls",
        staticmethod(lambda: VendorBuilder),
    )
    reading = guard_fix.read_imported_rocm().reading
    assert reading.needed is None, reading
    assert "RocmAttentionBackend returns VendorBuilder" in reading.why, reading


def test_both_follow_the_one_reader(monkeypatch):
    """Make the reader refuse every ``rocm_attn.py``: status is in doubt
    about ROCM_ATTN, patch --check refuses the file, and the AITER rows and
    file follow from that as they must."""

    def refuses(src, rel):  # noqa: ANN001, ANN202
        return model.Finding(
            guard_fix.FIX, guard_fix.PR, rel, model.UNRECOGNISED, "x"
        ), None

    monkeypatch.setattr(guard_fix, "read_source", refuses)
    found = both_readings()
    assert found["status"]["guard"][0] is None, found
    assert found["patch"][guard_fix.FIX] == model.UNRECOGNISED
    assert_agree(found, "a reader that refuses")


APPLIES, WHY = variants.applicability()


@pytest.mark.slow
@pytest.mark.skipif(not APPLIES, reason=WHY)
@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_status_and_patch_check_agree_on_each_vendor_variant(name, tmp_path):
    """Each variant in front of the installed vLLM, in a process of its own:
    the imported modules are the variant's, and so are the files."""
    dest = variants.make_overlay(variants.derive(name), tmp_path)
    done = run_in(variants.overlay_env(dest), "-c", BOTH)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert_agree(found, name)


def test_a_vendors_derived_aiter_backend_is_in_doubt(unpatched):
    """A vendor's backend derived from the AITER unified one, with a builder of
    its own: the reader reads only the file's backend, so neither fix may read
    as "not needed" for it (status would say "not affected")."""
    import gc

    from vllm.v1.attention.backends import rocm_aiter_unified_attn as aiter

    class VendorAiterBackend(aiter.RocmAiterUnifiedAttentionBackend):
        @staticmethod
        def get_builder_cls():  # noqa: ANN205
            return object

    try:
        for rows in (guard_fix.readings(), aiter_fix.readings()):
            (row,) = [r for r in rows if r.where == "VendorAiterBackend"]
            assert row.needed is None, row
    finally:
        del VendorAiterBackend
        gc.collect()
