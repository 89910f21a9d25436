# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard audit`` on the installed vLLM's real builders."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import run_fresh
from vllm_capture_guard.tools import audit
from vllm_capture_guard.tools import scenarios as sc

ROCM = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")


@pytest.fixture(scope="module")
def rocm_affected() -> bool:
    """Does this vLLM's ROCm builder zero the CPU offsets (0.27/0.28)?"""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    from vllm_capture_guard.runtime.contract import cpu_writes
    from vllm_capture_guard.runtime.patches import original_of
    from vllm_capture_guard.runtime.probe import capture_writes

    fn = original_of(
        RocmAttentionMetadataBuilder.__dict__["build_for_cudagraph_capture"]
    )
    return bool(cpu_writes(capture_writes(RocmAttentionMetadataBuilder, fn)))


# -- equality of built metadata ----------------------------------------------


@pytest.fixture(scope="module")
def indexer():
    # one builder: its persistent buffers start uninitialised (torch.empty)
    return sc.indexer_builder(sc.make_vllm_config(0))


def _built(builder, batch: sc.Batch):
    built, error = audit.second_after(None, builder, batch)
    assert error is None
    return built


def test_same_batch_builds_equal_metadata(indexer):
    a = _built(indexer, sc.Batch(4))
    b = _built(indexer, sc.Batch(4))
    assert audit.compare_built(a, b) == []


def test_compare_classes_differences_by_where_they_are(indexer):
    a = _built(indexer, sc.Batch(4))
    b = _built(indexer, sc.Batch(4, seq_len=80))
    diffs = {d.path: d for d in audit.compare_built(a, b)}
    # device tensor values: the graph reads them by address
    assert diffs["metadata.decode.seq_lens"].severity == "device"
    # a Python int baked into the graph
    assert diffs["metadata.max_seq_len"].severity == "host"
    # the builder's own buffer, not referenced by decode metadata
    assert diffs["builder.context_len_buffer"].severity == "builder"
    assert audit.classify(diffs.values()) == "host"


def test_freeze_compares_bits_so_uninitialised_nans_are_equal():
    t = torch.full((3,), float("nan"))
    assert audit.compare(audit.freeze(t), audit.freeze(t.clone())) == []
    grown = audit.compare(audit.freeze(t), audit.freeze(torch.zeros(4)))
    assert [d.severity for d in grown] == ["host"]  # a shape is a host value
    named = audit.freeze({"lens_cpu": np.arange(3), "lens": torch.arange(3)})
    other = audit.freeze({"lens_cpu": np.arange(3) + 1, "lens": torch.arange(3) + 1})
    assert {d.path: d.severity for d in audit.compare(named, other)} == {
        "lens_cpu": "host",
        "lens": "device",
    }


# -- the audit in this process -------------------------------------------------


def test_every_registry_enum_is_enumerated():
    from vllm.v1.attention.backends import registry

    names = {e.__name__ for e in audit.registries()}
    assert "AttentionBackendEnum" in names
    assert len(audit.registered_backends()) == sum(
        len(getattr(registry, n)) for n in names
    )


def test_a_backend_registered_through_vllm_that_writes_cpu_metadata_is_flagged():
    """A scratch backend, put into vLLM's registry with vLLM's own
    ``register_backend``, whose builder zeroes ``query_start_loc_cpu``."""
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from tests.scratch_builders import LEAKY_BACKEND_PATH

    register_backend(AttentionBackendEnum.CUSTOM, LEAKY_BACKEND_PATH)
    try:
        result = audit.run_audit(["CUSTOM", "TRITON_ATTN"])
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()
    by = {(b.registry, b.name): b for b in result.backends}
    leaky = by[("AttentionBackendEnum", "CUSTOM")]
    assert leaky.status == "built"
    assert leaky.builder_class.endswith("LeakyTritonMetadataBuilder")
    assert leaky.written_fields("cpu") == ["query_start_loc_cpu"]
    assert leaky.verdict == audit.HAZARD
    seq = {s.second: s.verdict for s in leaky.sequenced}
    assert seq[audit.MINIMAX_M3_INDEXER] == "fails"  # the seed bug's assert
    assert [b.name for b in result.cpu_writers] == ["CUSTOM"]
    triton = by[("AttentionBackendEnum", "TRITON_ATTN")]
    assert triton.written_fields("cpu") == []
    assert triton.written_fields("device") == ["seq_lens"]
    assert triton.verdict == audit.CAPTURE_TIME
    # the Mamba registry's CUSTOM slot is empty: skipped, with vLLM's reason
    mamba = by[("MambaAttentionBackendEnum", "CUSTOM")]
    assert mamba.status == "skipped" and "must be registered" in mamba.reason


# -- the CLI, in fresh interpreters, as a user runs it ---------------------------


def _audit_json(guard: str) -> tuple[int, dict]:
    proc = run_fresh(
        ["-m", "vllm_capture_guard", "audit", "--json"], VLLM_CAPTURE_GUARD=guard
    )
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_cli_audit_flags_rocm_cpu_offsets_without_the_guard(rocm_affected):
    rc, out = _audit_json("off")
    assert out["guard_mode"] == "off" and out["guard"].startswith(
        "VLLM_CAPTURE_GUARD=off"
    )
    by = {b["name"]: b for b in out["backends"]}
    assert out["registered"] == len(out["backends"]) and out["built"] >= 10
    assert by["ROCM_ATTN"]["status"] == "built"
    for name in ROCM:  # 0.33's AITER unified module queries the GPU at import
        if by[name]["status"] == "built":
            assert ("query_start_loc_cpu" in by[name]["cpu_writes"]) == rocm_affected
    assert rc == (1 if out["cpu_writers"] else 0)
    if rocm_affected:
        assert set(ROCM) <= set(out["cpu_writers"])
        assert by["ROCM_ATTN"]["verdict"] == audit.HAZARD


@pytest.mark.slow
def test_cli_audit_with_the_guard_finds_no_cpu_writes():
    rc, out = _audit_json("on")
    assert out["guard"] is not None and "vllm-capture-guard" not in out["guard"]
    by = {b["name"]: b for b in out["backends"]}
    assert by["ROCM_ATTN"]["status"] == "built"
    for name in ROCM:
        assert by[name]["cpu_writes"] == []
        assert by[name]["verdict"] != audit.HAZARD
    assert rc == 0 and out["cpu_writers"] == []


def test_cli_audit_prints_guard_state_coverage_and_verdict():
    proc = run_fresh(
        ["-m", "vllm_capture_guard", "audit", "--backend", "TRITON_ATTN"],
        VLLM_CAPTURE_GUARD="off",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    assert "VLLM_CAPTURE_GUARD=off; guard: VLLM_CAPTURE_GUARD=off" in out
    assert "coverage: built 1 of 1 registered backends" in out
    assert "OK: no built backend's capture writes shared CPU metadata" in out


def test_version_cache_keeps_a_users_vllm_cache_root(monkeypatch, tmp_path):
    from importlib.metadata import version

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert audit.use_version_cache() is None
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path)
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    chosen = audit.use_version_cache()
    assert chosen == str(tmp_path / "vllm-capture-guard" / f"vllm-{version('vllm')}")
    assert os.environ["VLLM_CACHE_ROOT"] == chosen
