# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard audit`` on the installed vLLM's real builders."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import rocm_capture_writes_cpu_offsets, run_fresh
from vllm_capture_guard.tools import harness as sc
from vllm_capture_guard.tools.audit import command, run, schema
from vllm_capture_guard.tools.audit import registry as audit_registry
from vllm_capture_guard.tools.audit.later import MINIMAX_M3_INDEXER
from vllm_capture_guard.tools.audit.schema import Severity, Verdict

ROCM = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")


@pytest.fixture(scope="module")
def rocm_affected() -> bool:
    """Does this vLLM's ROCm builder zero the CPU offsets (0.27/0.28)?"""
    return rocm_capture_writes_cpu_offsets()


# -- equality of built metadata ----------------------------------------------


@pytest.fixture(scope="module")
def indexer():
    # one builder: its persistent buffers start uninitialised (torch.empty)
    return sc.indexer_builder(sc.make_vllm_config(0))


def _built(builder, batch: sc.Batch):
    built, error = run.later_after(None, builder, batch)
    assert error is None
    return built


def test_same_batch_builds_equal_metadata(indexer):
    a = _built(indexer, sc.Batch(4))
    b = _built(indexer, sc.Batch(4))
    assert run.compare_built(a, b) == []


def test_compare_classes_differences_by_where_they_are(indexer):
    a = _built(indexer, sc.Batch(4))
    b = _built(indexer, sc.Batch(4, seq_len=80))
    diffs = {d.path: d for d in run.compare_built(a, b)}
    # device tensor values: the graph reads them by address
    assert diffs["metadata.decode.seq_lens"].severity is Severity.DEVICE
    # a Python int baked into the graph
    assert diffs["metadata.max_seq_len"].severity is Severity.HOST
    # the builder's own buffer, not referenced by decode metadata
    assert diffs["builder.context_len_buffer"].severity == "builder"
    assert run.classify(diffs.values()) == "host"


def test_host_tensor_values_count_as_host_device_ones_as_device():
    import torch

    from vllm_capture_guard.tools.contract import encode

    def built(k: int):
        lens = torch.arange(3) + k
        return encode({"metadata": {"lens_cpu": lens, "lens": lens}, "builder": {}})

    found = {d.path: d.severity for d in run.compare_built(built(0), built(1))}
    assert found == {
        "metadata.lens_cpu": Severity.HOST,
        "metadata.lens": Severity.DEVICE,
    }


# -- the audit in this process -------------------------------------------------


def test_every_registry_enum_is_enumerated():
    from vllm.v1.attention.backends import registry

    names = {e.__name__ for e in audit_registry.registries()}
    assert "AttentionBackendEnum" in names
    assert len(audit_registry.registered_backends()) == sum(
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
        result = run.run_audit(["CUSTOM", "TRITON_ATTN"])
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()
    by = {(b.registry, b.name): b for b in result.backends}
    leaky = by[("AttentionBackendEnum", "CUSTOM")]
    assert leaky.status is schema.Built.BUILT
    assert leaky.builder_class.endswith("LeakyTritonMetadataBuilder")
    assert leaky.cpu_writes == ["query_start_loc_cpu"]
    assert leaky.verdict is Verdict.HAZARD
    seq = {s.later: s.verdict for s in leaky.sequenced}
    assert seq[MINIMAX_M3_INDEXER] is Severity.FAILS  # the seed bug's assert
    assert result.cpu_writers == ["CUSTOM"]
    triton = by[("AttentionBackendEnum", "TRITON_ATTN")]
    assert triton.cpu_writes == []
    assert triton.device_writes == ["seq_lens"]
    assert triton.verdict is Verdict.CAPTURE_TIME
    # the Mamba registry's CUSTOM slot is empty: skipped, with vLLM's reason
    mamba = by[("MambaAttentionBackendEnum", "CUSTOM")]
    assert mamba.status is schema.Built.SKIPPED
    assert "must be registered" in mamba.reason
    # the JSON round-trips through the schema
    assert schema.from_json(json.dumps(schema.to_json(result))) == result


# -- the CLI, in fresh interpreters, as a user runs it ---------------------------


def _audit_json(
    guard: str, fresh: bool = False, backends: tuple[str, ...] = ()
) -> tuple[int, schema.AuditResult]:
    only = [arg for name in backends for arg in ("--backend", name)]
    proc = run_fresh(
        ["-m", "vllm_capture_guard", "audit", "--json", *only],
        fresh=fresh,
        VLLM_CAPTURE_GUARD=guard,
    )
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.returncode, schema.from_json(proc.stdout)


#: What every remaining skip must be told by.
CAUSES = {"placeholder", "hardware", "compiled extension", "package"}


@pytest.fixture(scope="module")
def unguarded_audit() -> tuple[int, schema.AuditResult]:
    """The whole audit, guard off, in a fresh interpreter as a user runs it."""
    return _audit_json("off", fresh=True)


@pytest.mark.slow
def test_cli_audit_flags_rocm_cpu_offsets_without_the_guard(
    rocm_affected, unguarded_audit
):
    """A fresh interpreter, as a user runs it (Triton's interpreter on, the
    device simulated); also the wider audit's coverage, on every release."""
    rc, out = unguarded_audit
    assert out.guard_mode == "off" and out.guard.startswith("VLLM_CAPTURE_GUARD=off")
    by = {b.name: b for b in out.backends}
    assert out.registered == len(out.backends) and out.built >= 10
    assert by["ROCM_ATTN"].status is schema.Built.BUILT
    for name in ROCM:  # 0.33's AITER unified module queries the GPU at import
        if by[name].status is schema.Built.BUILT:
            assert ("query_start_loc_cpu" in by[name].cpu_writes) == rocm_affected
    assert rc == (1 if out.cpu_writers else 0)
    if rocm_affected:
        assert set(ROCM) <= set(out.cpu_writers)
        assert by["ROCM_ATTN"].verdict is Verdict.HAZARD
    _assert_every_family_is_seen(out)


def _assert_every_family_is_seen(out: schema.AuditResult) -> None:
    """Both ROCm backends built and captured (0.33's module imports under the
    simulated MI300X); MLA, sparse MLA and DeepSeek-V4 built from their own
    models; every skip told by one of the four causes, and counted."""
    by = {b.name: b for b in out.backends}
    for name in ROCM:
        assert by[name].captured, (name, by[name].reason, by[name].captures)
    built = [b for b in out.backends if b.status is schema.Built.BUILT]
    assert {"minimax_m3", "deepseek_v32", "deepseek_v4"} <= {b.family for b in built}
    for b in built:
        if b.family == "deepseek_v32":  # the indexer's builder runs after it
            assert [s.later for s in b.sequenced] == ["DEEPSEEK_V32_INDEXER"], b.name
        # MLA from DeepSeek-V3 (0.27.1's MLA layer needs a compiled prefill)
        if b.name == "TRITON_MLA":
            assert b.family == "deepseek_v3" and b.captured, b
    skipped = [b for b in out.backends if b.status is schema.Built.SKIPPED]
    assert {b.cause for b in skipped} <= CAUSES, [(b.name, b.reason) for b in skipped]
    assert sum(out.skipped_by_cause.values()) == len(skipped)
    assert all(b.needs for b in skipped)
    # Triton kernels ran in Triton's interpreter: the sparse captures ran
    assert any(s.startswith("Triton kernels") for s in out.simulated), out.simulated
    # every sparse capture ran, or says which hardware or extension it needs
    sparse = [b for b in built if b.family in ("deepseek_v32", "deepseek_v4")]
    assert any(b.captured for b in sparse), [b.name for b in sparse]
    unrun = [b for b in sparse if not b.captured]
    assert all(
        b.cause in ("hardware", "compiled extension") and b.needs for b in unrun
    ), [(b.name, b.cause, b.needs, b.reason) for b in unrun]


@pytest.mark.slow
def test_cli_audit_with_the_guard_finds_no_cpu_writes(unguarded_audit):
    """With the guard on, no capture writes shared CPU metadata: every
    backend where the release has writers; where the whole audit found none
    without the guard (a fixed release), the ROCm backends only, the guard's
    own path, since no other capture had anything to keep."""
    _, off = unguarded_audit
    rc, out = _audit_json("on", backends=() if off.cpu_writers else ROCM)
    assert out.guard is not None and "vllm-capture-guard" not in out.guard
    by = {b.name: b for b in out.backends}
    assert by["ROCM_ATTN"].status is schema.Built.BUILT
    for name in ROCM:
        assert by[name].cpu_writes == []
        assert by[name].verdict is not Verdict.HAZARD
    assert rc == 0 and out.cpu_writers == []


def test_cli_audit_prints_guard_state_coverage_and_verdict():
    proc = run_fresh(
        ["-m", "vllm_capture_guard", "audit", "--backend", "TRITON_ATTN"],
        VLLM_CAPTURE_GUARD="off",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    assert "guard: loaded by vLLM's plugin loader; VLLM_CAPTURE_GUARD=off; " in out
    assert "does nothing (off)" in out and "SIMULATES" not in out
    assert "coverage: built 1 of 1 registered backends" in out
    assert "OK: no built backend's capture writes shared CPU metadata" in out
    # TRITON_ATTN sets the device seq_lens to 1 at capture: the findings list
    # it, and one line says that these are expected, and why
    lines = out.splitlines()
    start = lines.index("findings:")
    found = [ln for ln in lines[start + 1 :] if ln.startswith("  ")]
    assert found and all("(device)" in ln or "(builder)" in ln for ln in found)
    (said,) = [ln for ln in lines if ln.startswith("expected: ")]
    assert lines.index(said) == start + 1 + len(found), out
    assert said.startswith(f"expected: all {len(found)} findings above are ")
    assert "capture-time only" in said and "before every replay" in said


def test_version_cache_keeps_a_users_vllm_cache_root(monkeypatch, tmp_path):
    from importlib.metadata import version

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert command.use_version_cache() is None
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path)
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    chosen = command.use_version_cache()
    assert chosen == str(tmp_path / "vllm-capture-guard" / f"vllm-{version('vllm')}")
    assert os.environ["VLLM_CACHE_ROOT"] == chosen
