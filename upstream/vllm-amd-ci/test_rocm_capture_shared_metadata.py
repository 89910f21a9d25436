# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Full CUDA-graph capture must not change the metadata that later builders read.

During full-graph capture the model runner hands one ``CommonAttentionMetadata``
(views of its persistent input buffers; a shallow copy per KV-cache group) to
every metadata builder in turn. In vLLM 0.27.x and 0.28.0 the ROCm builder's
``build_for_cudagraph_capture`` zeroed ``query_start_loc_cpu`` as well as the
device ``query_start_loc``, so MiniMax-M3's lightning-indexer builder, which
runs after it, computed a decode query length of 0 and ``vllm serve`` died at
startup with ``assert decode_query_len > 0`` (``ROCM_ATTN``: fixed by PR #51585;
``ROCM_AITER_UNIFIED_ATTN``, which reused that builder: PR #53821).

This test builds a real ``VllmConfig`` for a two-layer MiniMax-M3 whose
``config.json`` it writes (no weights, no Hub), builds the ROCm backend's
metadata builder and the indexer's, and runs their capture in the runner's
order on shared buffers. It needs vLLM, torch and pytest; it runs on a GPU
host or on the CPU.
"""

import dataclasses
import json
import socket
import traceback
from copy import copy

import pytest
import torch

BLOCK_SIZE = 128  # the indexer's kernels want 128
HEAD_SIZE = 128
MAX_REQS = 16
TINY_MINIMAX_M3 = {
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
        "head_dim": HEAD_SIZE,
        "max_position_embeddings": 4096,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_layer_freq": [0, 1],
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_index_dim": HEAD_SIZE,
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

# (requests with a one-token query, requests after padding with empty queries)
BATCHES = [(1, 1), (4, 4), (7, 8)]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state

    model_dir = tmp_path_factory.mktemp("tiny-minimax-m3")
    (model_dir / "config.json").write_text(json.dumps(TINY_MINIMAX_M3))
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=4096,
            dtype="bfloat16",
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig(device=_device().type),
    )
    # The indexer builder asks for the tensor-parallel world size.
    with set_current_vllm_config(config):
        if not parallel_state.model_parallel_is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            parallel_state.init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0,
                backend="gloo",
            )
            parallel_state.initialize_model_parallel(1, 1)
    return config


def _builders(backend_name: str, config):
    from vllm.config import set_current_vllm_config
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    try:
        backend = AttentionBackendEnum[backend_name].get_class()
    except Exception as e:
        if torch.version.hip is not None:
            raise  # on a ROCm host the backend must import
        # Some releases' ROCm modules ask the GPU for its architecture at import.
        pytest.skip(
            f"{backend_name} cannot be imported on a host without ROCm "
            f"(torch {torch.__version__}): {type(e).__name__}: {e}"
        )
    device = _device()
    spec = dict(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    with set_current_vllm_config(config):
        attention = backend.get_builder_cls()(
            FullAttentionSpec(**spec), ["model.layers.0.self_attn.attn"], config, device
        )
        indexer = MiniMaxM3IndexerBackend.get_builder_cls()(
            MLAAttentionSpec(**spec),
            ["model.layers.1.self_attn.indexer.index_cache"],
            config,
            device,
        )
    return attention, indexer


def _shared_metadata(num_reqs: int, padded_reqs: int, seq_len: int = 64):
    """One uniform-decode batch in runner-like persistent buffers (CPU and
    device offsets), padded with empty requests, as the runner pads it."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    device, i32 = _device(), torch.int32
    offsets = torch.tensor(
        list(range(num_reqs + 1)) + [num_reqs] * (padded_reqs - num_reqs), dtype=i32
    )
    seq_lens = torch.tensor([seq_len] * num_reqs + [0] * (padded_reqs - num_reqs))
    seq_lens = seq_lens.to(i32)
    qsl_cpu = torch.zeros(MAX_REQS + 1, dtype=i32)
    qsl_cpu[: padded_reqs + 1] = offsets
    # Separate device buffers, as the runner's CpuGpuBuffer pairs (even when the
    # "device" is the CPU, so that a write to one is not a write to the other).
    qsl = qsl_cpu.clone().to(device)
    seq_cpu = torch.zeros(MAX_REQS, dtype=i32)
    seq_cpu[:padded_reqs] = seq_lens
    computed_cpu = seq_cpu - (qsl_cpu[1:] - qsl_cpu[:-1])
    block_table = torch.zeros((MAX_REQS, 4), dtype=i32, device=device)
    block_table[:padded_reqs, 0] = torch.arange(
        1, padded_reqs + 1, dtype=i32, device=device
    )
    slots = torch.full((padded_reqs,), -1, dtype=torch.int64, device=device)
    slots[:num_reqs] = torch.arange(num_reqs, device=device)
    values = dict(
        query_start_loc=qsl[: padded_reqs + 1],
        query_start_loc_cpu=qsl_cpu[: padded_reqs + 1],
        seq_lens=seq_cpu.clone().to(device)[:padded_reqs],
        _seq_lens_cpu=seq_cpu[:padded_reqs],
        _num_computed_tokens_cpu=computed_cpu[:padded_reqs],
        seq_lens_cpu_upper_bound=seq_cpu[:padded_reqs],
        num_reqs=padded_reqs,
        num_actual_tokens=padded_reqs,
        max_query_len=1,
        max_seq_len=seq_len,
        block_table_tensor=block_table[:padded_reqs],
        slot_mapping=slots,
        causal=True,
        is_prefilling=torch.zeros(padded_reqs, dtype=torch.bool),
        positions=torch.arange(padded_reqs, dtype=torch.int64, device=device),
    )
    # The set of fields differs between releases; pass the ones declared here.
    declared = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in declared})


@pytest.mark.parametrize("num_reqs, padded_reqs", BATCHES)
@pytest.mark.parametrize("backend", ["ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"])
def test_capture_keeps_metadata_for_minimax_m3_indexer(
    vllm_config, backend, num_reqs, padded_reqs
):
    from vllm.config import set_current_vllm_config

    attention, indexer = _builders(backend, vllm_config)
    shared = _shared_metadata(num_reqs, padded_reqs)
    offsets_before = shared.query_start_loc_cpu.tolist()

    with set_current_vllm_config(vllm_config):
        # The runner's order: the backend's group, then the indexer's group,
        # each on a shallow copy of the same metadata.
        attention.build_for_cudagraph_capture(copy(shared))
        offsets_after = shared.query_start_loc_cpu.tolist()
        try:
            indexed = indexer.build_for_cudagraph_capture(copy(shared))
        except AssertionError as e:
            line = traceback.extract_tb(e.__traceback__)[-1].line
            pytest.fail(
                f"MiniMax-M3's indexer failed after the {backend} capture "
                f"({type(attention).__name__}): `{line}` {e}; "
                f"query_start_loc_cpu was {offsets_before}, the capture left "
                f"{offsets_after}. `vllm serve` dies here at startup."
            )

    assert offsets_after == offsets_before, (
        f"{type(attention).__name__}.build_for_cudagraph_capture changed the "
        "shared query_start_loc_cpu that later builders read"
    )
    assert indexed.decode is not None
    assert indexed.decode.decode_query_len == 1
    assert indexed.num_decodes == padded_reqs  # padding rows are empty decodes
