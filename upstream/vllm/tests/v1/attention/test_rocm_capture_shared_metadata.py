# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ROCm full CUDA-graph capture must not change what later builders read.

During full-graph capture the model runner gives the metadata builder of every
KV-cache group a shallow copy of one ``CommonAttentionMetadata``: a tensor that
one builder's ``build_for_cudagraph_capture`` writes in place is what every
later builder reads. ``RocmAttentionMetadataBuilder`` zeroes the device
``query_start_loc`` there (#25985). When it zeroed ``query_start_loc_cpu`` as
well, MiniMax-M3's indexer, which builds after the ROCm attention builders,
split the batch into decodes of length 0 and ``vllm serve`` died at startup
with ``assert decode_query_len > 0`` (#51585). ``ROCM_AITER_UNIFIED_ATTN`` has
its own builder, which leaves ``query_start_loc`` alone because unified
attention reads it at replay (#53821).

``test_capture_keeps_host_metadata.py`` checks the invariant for every
backend: no capture changes a host value of the shared metadata. This file
keeps the instance (MiniMax-M3's indexer after each ROCm backend) and the
device-offset check of #53821, a device write that a kernel reads at replay,
which the generic test allows.
"""

import copy
import dataclasses
import json

import pytest
import torch

from tests.v1.attention.utils import (
    BatchSpec,
    create_common_attn_metadata,
    create_standard_kv_cache_spec,
    create_vllm_config,
)
from vllm.config import set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec

pytestmark = [
    pytest.mark.skipif(not current_platform.is_rocm(), reason="ROCm-specific tests"),
    # one world for the module, torn down by its own fixture
    pytest.mark.skip_global_cleanup,
]

BLOCK_SIZE = 128
HEAD_DIM = 128
ATTN_LAYER = "model.layers.0.self_attn.attn"
INDEXER_LAYER = "model.layers.1.self_attn.indexer.index_cache"

ROCM_BACKENDS = ["ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"]

# Uniform decode batches, as the runner captures them.
BATCH_SPECS = {
    "decode_1": BatchSpec(seq_lens=[64], query_lens=[1]),
    "decode_4": BatchSpec(seq_lens=[64, 200, 17, 129], query_lens=[1, 1, 1, 1]),
    "decode_7": BatchSpec(seq_lens=[40] * 7, query_lens=[1] * 7),
    "decode_16": BatchSpec(seq_lens=[300] * 16, query_lens=[1] * 16),
}

# A two-layer MiniMax-M3 (layer 0 full attention, layer 1 sparse with the
# lightning indexer). Only its config is needed: no weights, no Hub access.
MINIMAX_M3_CONFIG = {
    "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
    "model_type": "minimax_m3_vl",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "minimax_m3_text",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 128,
        "dense_intermediate_size": 256,
        "shared_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_layer_freq": [0, 1],
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_index_dim": HEAD_DIM,
            "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 4,
            "sparse_block_size": BLOCK_SIZE,
            "sparse_disable_index_value": [0, 1],
            "sparse_score_type": "max",
            "sparse_init_block": 0,
            "sparse_local_block": 1,
            "sparse_attention_freq": [0, 1],
        },
    },
}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """The tiny MiniMax-M3's VllmConfig, set as current, with a world of one
    (the indexer builder reads the tensor-parallel size)."""
    path = tmp_path_factory.mktemp("minimax_m3")
    (path / "config.json").write_text(json.dumps(MINIMAX_M3_CONFIG))
    config = create_vllm_config(
        model_name=str(path), block_size=BLOCK_SIZE, max_model_len=4096
    )
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{path / 'dist_init'}",
            local_rank=0,
            backend=current_platform.dist_backend,
        )
        initialize_model_parallel(1, 1)
        yield config
        cleanup_dist_env_and_memory()


@pytest.fixture
def device() -> torch.device:
    return torch.device(current_platform.device_type)


def _shared_metadata(batch_spec: BatchSpec, device: torch.device):
    """The metadata the runner shares between the groups' builders. The runner
    keeps host copies in their own (pinned) buffers; on a CPU device
    ``create_common_attn_metadata`` returns host fields that share storage with
    the device ones, so give each host field its own."""
    common = create_common_attn_metadata(
        batch_spec, BLOCK_SIZE, device, arange_block_indices=True
    )
    host = {
        field.name: getattr(common, field.name).clone()
        for field in dataclasses.fields(common)
        if field.init
        and "_cpu" in field.name
        and isinstance(getattr(common, field.name), torch.Tensor)
    }
    return dataclasses.replace(common, **host)


def _attention_builder(backend: str, vllm_config, device: torch.device):
    # get_class() raises on a ROCm host where the backend cannot be imported:
    # that is a failure here, not a skip.
    builder_cls = AttentionBackendEnum[backend].get_class().get_builder_cls()
    spec = create_standard_kv_cache_spec(vllm_config)
    return builder_cls(spec, [ATTN_LAYER], vllm_config, device)


def _indexer_builder(vllm_config, device: torch.device):
    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=HEAD_DIM,
        dtype=vllm_config.model_config.dtype,
    )
    builder_cls = MiniMaxM3IndexerBackend.get_builder_cls()
    return builder_cls(spec, [INDEXER_LAYER], vllm_config, device)


@pytest.mark.parametrize("batch_spec_name", list(BATCH_SPECS))
def test_rocm_attn_capture_keeps_host_query_start_loc(
    vllm_config, device, batch_spec_name
):
    """#25985 zeroes the device offsets only; the host offsets stay."""
    batch_spec = BATCH_SPECS[batch_spec_name]
    builder = _attention_builder("ROCM_ATTN", vllm_config, device)
    common = _shared_metadata(batch_spec, device)
    expected_cpu = common.query_start_loc_cpu.clone()

    builder.build_for_cudagraph_capture(copy.copy(common))

    assert torch.equal(common.query_start_loc_cpu, expected_cpu)
    assert torch.count_nonzero(common.query_start_loc).item() == 0


@pytest.mark.parametrize("batch_spec_name", list(BATCH_SPECS))
@pytest.mark.parametrize("backend", ROCM_BACKENDS)
def test_minimax_m3_indexer_builds_after_rocm_capture(
    vllm_config, device, backend, batch_spec_name
):
    """The runner's capture order for MiniMax-M3: a ROCm attention builder,
    then the indexer builder, on the same shared metadata."""
    batch_spec = BATCH_SPECS[batch_spec_name]
    attention = _attention_builder(backend, vllm_config, device)
    indexer = _indexer_builder(vllm_config, device)
    common = _shared_metadata(batch_spec, device)
    expected_cpu = common.query_start_loc_cpu.clone()

    attention.build_for_cudagraph_capture(copy.copy(common))
    metadata = indexer.build_for_cudagraph_capture(copy.copy(common))

    assert torch.equal(common.query_start_loc_cpu, expected_cpu)
    assert metadata.decode is not None
    assert metadata.decode.decode_query_len == 1
    assert metadata.num_prefills == 0
    assert metadata.num_decode_tokens == batch_spec.compute_num_tokens()


@pytest.mark.parametrize("batch_spec_name", list(BATCH_SPECS))
def test_aiter_unified_capture_leaves_query_start_loc(
    vllm_config, device, batch_spec_name
):
    """Unified attention reads query_start_loc at replay: its capture sets
    seq_lens to 1 and leaves the offsets, device and host, as they are."""
    batch_spec = BATCH_SPECS[batch_spec_name]
    builder = _attention_builder("ROCM_AITER_UNIFIED_ATTN", vllm_config, device)
    common = _shared_metadata(batch_spec, device)
    expected = common.query_start_loc.clone()
    expected_cpu = common.query_start_loc_cpu.clone()

    metadata = builder.build_for_cudagraph_capture(copy.copy(common))

    assert torch.equal(common.query_start_loc, expected)
    assert torch.equal(common.query_start_loc_cpu, expected_cpu)
    assert torch.equal(metadata.query_start_loc, expected)
    assert torch.all(metadata.seq_lens == 1)
