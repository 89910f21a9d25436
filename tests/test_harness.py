# SPDX-License-Identifier: Apache-2.0
"""The capture harness on vLLM's real builders: the runner's order, one
shared metadata, per-group shallow copies, and what it records."""

from __future__ import annotations

from vllm_capture_guard.runtime.patches import PATCHES
from vllm_capture_guard.tools import fixes, harness


class _Rebinder:
    """Our own failure handling: a builder that rebinds one field on its copy
    and raises on request (a fake: it tests the harness, not vLLM)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def build_for_cudagraph_capture(self, cm):
        cm.query_start_loc_cpu = cm.query_start_loc_cpu.clone().zero_()
        if self.fail:
            raise ValueError("no")
        return "built"


def test_seed_backends_are_the_patches_backends():
    wanted = [b for p in PATCHES for b in fixes.backends(p)]
    assert list(harness.seed_backends()) == list(dict.fromkeys(wanted))


def test_rebinding_is_recorded_and_an_error_stops_the_sequence():
    batch = harness.Batch(2)
    run = harness.capture(
        [("a", _Rebinder()), ("b", _Rebinder(fail=True)), ("c", _Rebinder())],
        batch,
        record=True,
    )
    assert [g.group for g in run.groups] == ["a", "b"]  # startup dies at b
    a, b = run.groups
    assert a.rebinds == ["query_start_loc_cpu"] and a.writes == []
    assert a.returned == "built" and a.record["returned"] == "built"
    assert a.record["rebound"]["query_start_loc_cpu"]["values"] == [0, 0, 0]
    assert run.values("query_start_loc_cpu") == batch.offsets()  # shared: kept
    assert (b.error, run.failed) == ("ValueError: no", b)
    assert b.error_site.startswith("test_harness.py:")
    assert b.error_line == 'raise ValueError("no")'


def test_real_seed_scenario_writes_and_decode_query_len():
    run = harness.run_capture("ROCM_ATTN", harness.Batch(4))
    attention = run.groups[0]
    assert attention.builder == "RocmAttentionMetadataBuilder"
    assert "seq_lens" in [w.field for w in attention.writes]  # fill_(1)
    if run.failed is None:  # a fixed release: the indexer built its metadata
        assert harness.decode_query_len(run) == 1
    else:  # 0.27/0.28: the seed bug
        assert run.failed.group == "indexer"
        assert run.failed.error_site.startswith("vllm/models/minimax_m3/")


def test_error_text_names_no_install_folder():
    e = ImportError("cannot import x (/opt/venv/lib/site-packages/vllm/v1/a.py)")
    assert harness.error_text(e) == "ImportError: cannot import x (vllm/v1/a.py)"
    assert harness.error_text(AssertionError()) == "AssertionError"
