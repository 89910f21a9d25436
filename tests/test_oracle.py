# SPDX-License-Identifier: Apache-2.0
"""The differential oracle: patched 0.28.0 and 0.27.1 against upstream's own
fixed release, unpatched 0.29.0, each recorded in its own environment (a fresh
interpreter whose ``PYTHONPATH`` puts that release first) and exchanged as
JSON; and the proof that the oracle can fail: with the guard off, 0.28.0
differs, and the report names the fields.

Needs the release environments (``make envs``: ``.envs/vllm-0.27.1`` and
``.envs/vllm-0.29.0``; ``CAPTURE_GUARD_ENVS`` points elsewhere). Marked
``oracle``: the version matrix runs it once, with the base venv.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_capture_guard.lab import oracle
from vllm_capture_guard.tools import harness as sc

pytestmark = pytest.mark.oracle

CASES = {f"{b}/{x.label()}" for b in sc.seed_backends() for x in sc.DEFAULT_BATCHES}


@pytest.fixture(scope="module")
def records(oracle_record) -> dict[str, dict]:
    """(version, guard mode) -> record, each from its own environment."""
    wanted = [
        (oracle.REFERENCE, "off"),
        ("0.28.0", "on"),
        ("0.27.1", "on"),
        ("0.28.0", "off"),
    ]
    out = {}
    for version, mode in wanted:
        record, path = oracle_record(version, mode)
        out[f"{version}-{mode}"] = {**record, "_path": path}
    return out


def test_each_side_ran_in_its_own_release(records):
    ref = records[f"{oracle.REFERENCE}-off"]
    assert ref["vllm"] == "0.29.0"
    assert ref["guard_action"] == "disabled"  # upstream's own code
    for version in oracle.CANDIDATES:
        cand = records[f"{version}-on"]
        assert cand["vllm"] == version
        assert cand["guard_action"] == "patched", cand["guard"]
    for rec in (ref, *(records[f"{v}-on"] for v in oracle.CANDIDATES)):
        assert set(rec["cases"]) == CASES, rec["unavailable"]
        for case in rec["cases"].values():
            assert [g["group"] for g in case["groups"]] == ["attention", "indexer"]


@pytest.mark.parametrize("version", oracle.CANDIDATES)
def test_patched_release_matches_upstream_029(records, version):
    result = oracle.compare(
        records[f"{oracle.REFERENCE}-off"], records[f"{version}-on"]
    )
    assert result.ok, result.report()
    # every group of every case: before, after, returned metadata fields
    assert result.compared > 100 * len(CASES)


def test_fields_only_one_release_has_are_reported_not_compared(records):
    """0.27.1's CommonAttentionMetadata has no ``max_logits_per_req``."""
    result = oracle.compare(records[f"{oracle.REFERENCE}-off"], records["0.27.1-on"])
    assert result.one_sided["attention.before.max_logits_per_req"] == "0.29.0"
    assert "max_logits_per_req exists only in vLLM 0.29.0" in result.report()


def test_oracle_fails_with_guard_off(records):
    result = oracle.compare(records[f"{oracle.REFERENCE}-off"], records["0.28.0-off"])
    assert not result.ok
    text = "\n".join(result.differences)
    for batch in sc.DEFAULT_BATCHES:
        rocm = f"ROCM_ATTN/{batch.label()}"
        aiter = f"ROCM_AITER_UNIFIED_ATTN/{batch.label()}"
        # ROCM_ATTN: the CPU offsets, which 0.29.0 leaves alone
        assert f"{rocm} attention after.query_start_loc_cpu:" in text
        assert f"{rocm} attention after.query_start_loc:" not in text
        # AITER: no builder of its own, and the device offsets zeroed
        assert (
            f"{aiter} attention builder: 'RocmAttentionMetadataBuilder' != "
            "'RocmAiterUnifiedAttentionMetadataBuilder' (reference)"
        ) in text
        assert f"{aiter} attention after.query_start_loc:" in text
        assert f"{aiter} attention returned.query_start_loc:" in text
        # and the indexer then fails where 0.29.0 builds
        for case in (rocm, aiter):
            assert f"{case} indexer error: 'AssertionError' != None" in text


def test_compare_cli_exit_codes(records):
    ref = records[f"{oracle.REFERENCE}-off"]["_path"]
    ok = subprocess.run(
        [sys.executable, "-m", "vllm_capture_guard.lab.oracle", "compare", ref]
        + [records[f"{v}-on"]["_path"] for v in oracle.CANDIDATES],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count(": MATCH;") == 2
    bad = subprocess.run(
        [sys.executable, "-m", "vllm_capture_guard.lab.oracle", "compare", ref]
        + [records["0.28.0-off"]["_path"]],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert "DIFFER" in bad.stdout and "query_start_loc_cpu" in bad.stdout


# --- the comparison itself, on records we make (our own code: fakes allowed) --


def _record(version: str, qsl: list[int], extra: dict | None = None) -> dict:
    fields = {
        "query_start_loc": {
            "kind": "tensor",
            "dtype": "int32",
            "shape": [len(qsl)],
            "values": qsl,
        },
        "num_reqs": len(qsl) - 1,
        **(extra or {}),
    }
    group = {
        "group": "attention",
        "builder": "B",
        "error": None,
        "before": fields,
        "after": fields,
        "rebound": {},
        "returned": {"kind": "dataclass", "type": "M", "fields": fields},
    }
    return {"schema": oracle.SCHEMA, "vllm": version, "guard_action": "disabled",
            "unavailable": {}, "cases": {"X/b": {"groups": [group]}}}  # fmt: skip


def test_compare_finds_a_value_difference_in_a_returned_field():
    result = oracle.compare(_record("ref", [0, 1]), _record("cand", [0, 0]))
    assert not result.ok
    assert any("returned.query_start_loc" in d for d in result.differences)


def test_compare_lists_one_sided_fields_without_failing():
    result = oracle.compare(_record("ref", [0, 1], {"new": 1}), _record("c", [0, 1]))
    assert result.ok, result.report()
    assert result.one_sided["attention.after.new"] == "ref"


def test_compare_fails_on_a_missing_case_or_a_patched_reference():
    ref, cand = _record("ref", [0, 1]), _record("cand", [0, 1])
    cand["cases"] = {}
    assert "X/b: not recorded on cand" in oracle.compare(ref, cand).differences[0]
    patched = _record("ref", [0, 1]) | {"guard_action": "patched"}
    assert not oracle.compare(patched, _record("cand", [0, 1])).ok
