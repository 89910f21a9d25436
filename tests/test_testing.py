# SPDX-License-Identifier: Apache-2.0
"""The pytest helpers on real vLLM builders: a misbehaving builder is caught,
a well-behaved one passes with its device writes reported."""

from __future__ import annotations

import importlib
import textwrap

import pytest
import torch

from vllm_capture_guard.tools import harness as sc
from vllm_capture_guard.tools.testing import (
    SharedMetadataWriteWarning,
    assert_capture_keeps_shared_cpu_metadata,
    capture_on_shared_metadata,
    runner_metadata,
)

pytest_plugins = ["pytester"]


def _builder(cls, config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=sc.BLOCK_SIZE,
        num_kv_heads=1,
        head_size=sc.HEAD_SIZE,
        dtype=torch.bfloat16,
    )
    with set_current_vllm_config(config):
        return cls(spec, [sc.ATTN_LAYER], config, torch.device("cpu"))


@pytest.fixture(scope="module")
def config():
    return sc.make_vllm_config(0)


def test_misbehaving_builder_is_caught(config):
    from tests.scratch_builders import LeakyTritonMetadataBuilder

    builder = _builder(LeakyTritonMetadataBuilder, config)
    with pytest.raises(AssertionError, match="query_start_loc_cpu") as info:
        assert_capture_keeps_shared_cpu_metadata(builder, warn=False)
    # old and new values, so the report says what the later builders saw
    assert "[0, 1, 2, 3, 4] -> [0, 0, 0, 0, 0]" in str(info.value)


def test_well_behaved_builder_passes_and_warns_of_device_writes(config):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    builder = _builder(TritonAttentionMetadataBuilder, config)
    with pytest.warns(SharedMetadataWriteWarning, match=r"seq_lens \(device\)"):
        result = assert_capture_keeps_shared_cpu_metadata(builder)
    assert result.cpu_writes == []
    assert [w.field for w in result.device_writes] == ["seq_lens"]


def test_own_metadata_is_checked_and_left_to_the_caller(config):
    from tests.scratch_builders import LeakyTritonMetadataBuilder

    cm = runner_metadata(num_reqs=2)
    result = capture_on_shared_metadata(
        _builder(LeakyTritonMetadataBuilder, config), cm
    )
    assert [w.field for w in result.cpu_writes] == ["query_start_loc_cpu"]
    assert cm.query_start_loc_cpu.tolist() == [0, 0, 0]  # the caller's own tensors


def test_rocm_builder_is_caught_exactly_when_it_writes_cpu_offsets(config, unpatched):
    """vLLM's own ROCm builder: caught on an affected install, and passes once
    the guard's patches are applied in this process."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    from tests.conftest import rocm_capture_writes_cpu_offsets
    from vllm_capture_guard.runtime.patches import PATCHES

    affected = rocm_capture_writes_cpu_offsets()
    builder = _builder(RocmAttentionMetadataBuilder, config)
    if affected:
        with pytest.raises(AssertionError, match="query_start_loc_cpu"):
            assert_capture_keeps_shared_cpu_metadata(builder, warn=False)
    for patch in PATCHES:  # as the plugin's hooks do: once vLLM imported it
        try:
            importlib.import_module(patch.modules[0])
        except Exception:  # 0.33's AITER module asks the GPU at import
            continue
        patch.apply()
    with pytest.warns(SharedMetadataWriteWarning) as record:
        assert_capture_keeps_shared_cpu_metadata(builder)
    warned = sorted(
        str(w.message).split(" wrote shared device field ")[1] for w in record
    )
    assert [w.split(" ")[0] for w in warned] == ["query_start_loc", "seq_lens"]


INNER_TESTS = """
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tests.scratch_builders import LeakyTritonMetadataBuilder
    from vllm_capture_guard.tools import harness as sc

    def make(cls):
        cfg = sc.make_vllm_config(0)
        spec = FullAttentionSpec(
            block_size=sc.BLOCK_SIZE, num_kv_heads=1, head_size=sc.HEAD_SIZE,
            dtype=torch.bfloat16,
        )
        with set_current_vllm_config(cfg):
            return cls(spec, [sc.ATTN_LAYER], cfg, torch.device("cpu"))

    def test_triton(capture_contract):
        capture_contract.check(make(TritonAttentionMetadataBuilder))

    def test_leaky(capture_contract):
        capture_contract.check(make(LeakyTritonMetadataBuilder))
"""


def test_pytest_plugin_fails_cpu_writes_and_reports_device_writes(pytester):
    pytester.makepyfile(test_inner=textwrap.dedent(INNER_TESTS))
    result = pytester.runpytest(
        "-p", "vllm_capture_guard.tools.pytest_plugin", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_leaky*",
            "*LeakyTritonMetadataBuilder.build_for_cudagraph_capture wrote shared "
            "CPU metadata*",
            "*query_start_loc_cpu (cpu): [[]0, 1, 2, 3, 4] -> [[]0, 0, 0, 0, 0]*",
            "*vllm-capture-guard: shared device metadata written during capture*",
            "*test_inner.py::test_triton: TritonAttentionMetadataBuilder: "
            "seq_lens (device)*",
        ]
    )
