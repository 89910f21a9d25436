# SPDX-License-Identifier: Apache-2.0
"""A real ``VllmConfig`` and real builders, with no Hub, network or GPU.

:func:`make_vllm_config` builds a ``VllmConfig`` for a tiny MiniMax-M3 whose
``config.json`` we write (:data:`TINY_MINIMAX_M3`; no weights exist or are
needed to build metadata) and initialises vLLM's distributed state for one
process (gloo), as a worker would.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

#: Block size shared by both groups; the indexer's kernels want 128.
BLOCK_SIZE = 128
HEAD_SIZE = 128
ATTN_LAYER = "model.layers.0.self_attn.attn"
INDEXER_LAYER = "model.layers.1.self_attn.indexer.index_cache"

TINY_MINIMAX_M3: dict[str, Any] = {
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


def write_tiny_model(directory: str | os.PathLike | None = None) -> Path:
    """Write :data:`TINY_MINIMAX_M3` as ``config.json``; return the folder."""
    path = Path(directory or tempfile.mkdtemp(prefix="capture-guard-model-"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_MINIMAX_M3, indent=2))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=1)
def _model_config() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(write_tiny_model()),
        skip_tokenizer_init=True,
        max_model_len=4096,
        dtype="bfloat16",
    )


def _ensure_distributed(vllm_config: Any) -> None:
    """World size 1 over gloo, done once per process, as a worker does."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(vllm_config):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                local_rank=0,
                backend="gloo",
            )
            ps.initialize_model_parallel(1, 1)


@functools.lru_cache(maxsize=8)
def make_vllm_config(
    num_speculative_tokens: int = 0, device: str = "cpu", graphs: bool = False
) -> Any:
    """A real ``VllmConfig`` for the tiny MiniMax-M3 (cached per process).

    Speculative decoding is enabled only when ``num_speculative_tokens`` is
    given (a speculative verify batch has a query length above 1). It uses
    the n-gram proposer: it needs no draft model and sets
    ``num_speculative_tokens``, which is all the builders read.

    With ``graphs``, the config has full decode graphs and the capture sizes
    vLLM derives for them, as on a GPU (:func:`.sizes.graph_config`)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model_config = _model_config()
    speculative = None
    if num_speculative_tokens:
        speculative = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=3,
            prompt_lookup_min=1,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig(device=device),
        speculative_config=speculative,
    )
    if graphs:
        from vllm_capture_guard.tools.harness.sizes import graph_config

        graph_config(config)
    _ensure_distributed(config)
    return config


def backend_class(name: str) -> type:
    """The backend class that vLLM's registry names ``name`` (importing its
    module, which is what lets the guard's post-import hooks patch it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def make_builder(
    builder_cls: type,
    spec: Any,
    vllm_config: Any,
    layer: str = ATTN_LAYER,
    device: str = "cpu",
) -> Any:
    """``builder_cls(spec, [layer], vllm_config, device)`` under the config."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        return builder_cls(spec, [layer], vllm_config, torch.device(device))


def group_builder(
    backend_cls: type,
    spec: Any,
    vllm_config: Any,
    layer: str = ATTN_LAYER,
    device: str = "cpu",
    group_id: int = 0,
) -> Any:
    """The builder vLLM's model runners make for ``backend_cls``: through
    vLLM's own ``AttentionGroup.create_metadata_builders`` (which asks the
    backend's ``get_builder_cls()``), as V1, Model Runner V2 and the
    speculative proposers do."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.utils import AttentionGroup

    group = AttentionGroup(backend_cls, [layer], spec, group_id)
    with set_current_vllm_config(vllm_config):
        group.create_metadata_builders(vllm_config, torch.device(device))
    return group.metadata_builders[0]


def attention_builder(backend: str, vllm_config: Any, device: str = "cpu") -> Any:
    """The builder vLLM makes for ``backend`` (a registry name), for a full
    attention layer of the tiny model."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    return group_builder(backend_class(backend), spec, vllm_config, ATTN_LAYER, device)


def indexer_builder(vllm_config: Any, device: str = "cpu") -> Any:
    """MiniMax-M3's lightning-indexer builder, as vLLM makes it for its
    backend (the second KV-cache group)."""
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    backend = MiniMaxM3IndexerBackend
    return group_builder(backend, spec, vllm_config, INDEXER_LAYER, device, 1)
