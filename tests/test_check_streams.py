# SPDX-License-Identifier: Apache-2.0
"""``check``'s judgement of the capture stream (PR #53818) on vLLM's own three
capture sites, and the size of ``check --json``."""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.test_cli import _streams_fail_unguarded
from vllm_capture_guard.tools import check
from vllm_capture_guard.tools.harness import streams


def test_each_site_is_judged_and_one_that_cannot_be_driven_is_named(monkeypatch):
    """In this process the guard never loads: vLLM's sites as shipped. A site
    whose drive raises is "not checked", never a PASS; a site the release no
    longer has is said as such, and not counted."""
    fails = _streams_fail_unguarded()
    present = streams.present()
    broken_site = present[-1]

    def broken(recorder):
        raise RuntimeError("stand-in: this release's site takes other attributes")

    monkeypatch.setitem(streams.DRIVERS, broken_site, broken)
    sites = streams.check_sites()
    assert [s.site for s in sites] == [
        "CudaGraphManager.capture",
        "EncoderCudaGraphManager._capture_budget_graph",
        "Gemma4Proposer._setup_centroids_cuda_graphs",
    ]
    by_key = dict(zip(streams.SITES, sites, strict=True))
    for key, site in by_key.items():
        if key not in present:
            assert site.absent and site.ok is None, site
        elif key == broken_site:
            assert site.ok is None and "RuntimeError: stand-in" in site.error
        else:
            assert site.streams and site.ok is (not fails), site
    result = check.SeedResult("?", None, True, [], {}, streams=sites)
    # no capture ran here: the backends' rows say so; this test reads the
    # stream row
    (judged,) = [j for j in check.judge(result) if j.fix == "graph-capture-stream"]
    line = judged.line()
    n = len(present) - 1
    assert f"{'FAIL' if fails else 'PASS'}, {n}/{n} sites" in line, line
    assert f"not checked here: {by_key[broken_site].site} (RuntimeError" in line
    for key in set(streams.SITES) - set(present):
        assert f"not in this vLLM: {by_key[key].site}" in line, line
    # a site that did not run is never a pass: check cannot judge (exit 2),
    # unless another site fails (exit 1); an absent site is no site at all
    assert check.passed([judged]) is False
    assert check.exit_code([judged]) == (1 if fails else 2)
    assert not judged.judged and by_key[broken_site].site in judged.unjudged()


def test_check_json_is_a_summary_per_check_and_backend():
    proc = run_cli("check", "--json", VLLM_CAPTURE_GUARD="on")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(proc.stdout) < 16_000, len(proc.stdout)  # --trace has every size
    found = json.loads(proc.stdout)
    assert found["ok"] is True and "runs" not in found
    assert found["former_names"] == {"rocm-attn-cpu-offsets": "builder-capture-guard"}
    assert found["checks"][0]["fix"] == "builder-capture-guard"
    sizes = found["capture_sizes"]
    assert (sizes["largest"], sizes["smallest"]) == (512, 1) and sizes["count"] >= 50
    names = [c["name"] for c in found["checks"]]
    assert names[0] == "MiniMax-M3 indexer after ROCM_ATTN"
    assert names[-1] == "capture on the current stream (PR #53818)"
    # none fails; one that cannot run here (0.33's AITER module asks for a GPU
    # at import) is None, with the reason
    assert [c for c in found["checks"] if c["ok"] is False] == []
    assert found["checks"][0]["ok"] is found["checks"][-1]["ok"] is True
    for c in found["checks"]:
        assert c["ok"] or c["note"], c
    for name, backend in found["backends"].items():
        assert backend["runs"] == backend["passed"] == sizes["count"], name
    present = [s for s in found["sites"] if not s["absent"]]
    assert [s["ok"] for s in present] == [True] * len(streams.present())
    assert "AITER's kernels" in found["does_not_show"]
