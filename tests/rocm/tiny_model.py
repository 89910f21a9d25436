# SPDX-License-Identifier: Apache-2.0
"""A MiniMax-M3 small enough to start vLLM's engine in seconds, with random
weights (``load_format="dummy"``), no tokenizer and no Hub.

:data:`vllm_capture_guard.tools.harness.TINY_MINIMAX_M3` configures metadata
builders, nothing more; it cannot build the model (1 KV head but 4 index
heads). This one keeps every structural choice of the real checkpoint that
vLLM 0.28.0's AMD model path (``vllm/models/minimax_m3/amd/model.py`` and
``common/``) depends on, and shrinks only sizes that no kernel constrains:

* text-only architecture ``MiniMaxM3SparseForCausalLM``: the
  ``...ForConditionalGeneration`` wrapper builds a vision tower from
  ``vision_config`` and needs the Hub processor; the text model it wraps is
  the same class. ``model_type`` stays ``minimax_m3_vl`` because vLLM's config
  registry maps that name (not ``minimax_m3_text``) to ``MiniMaxM3Config``,
  whose ``text_config`` the model reads as ``hf_text_config``.
* every rank sees the attention shapes of one rank of the checkpoint served
  at ``--tensor-parallel-size 4`` (64 query, 4 KV, 4 index heads): 16 query
  heads, 1 KV head, 1 index head, head and index dim 128. So the model for
  TP size ``tp`` has ``16 * tp`` query heads and ``tp`` KV and index heads;
  at TP=4 that is the checkpoint's own head layout.
  ``MinimaxM3QKVParallelLinearWithIndexer`` asserts index heads == KV heads,
  the AMD index kernels assert it per rank, the sparse backends accept only
  head size 128, and the AITER sparse paged attention wants one KV head a
  rank.
* sparse block 128 and 16 top-k blocks: both sparse backends support only
  kernel block size 128, so the engine runs with ``block_size=128``.
* layer 0 dense attention (the platform backend under test, ROCM_ATTN or
  ROCM_AITER_UNIFIED_ATTN) and dense MLP, layer 1 sparse attention with the
  lightning indexer and MoE, as the checkpoint's first dense and later sparse
  layers. Layer 0's builder therefore captures before the indexer's, the
  order in which the bug shows. Every per-layer list has one entry a layer.
* 8 experts, 4 routed per token; MoE and MLP widths of 128 and more per rank
  at TP=4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

NUM_LAYERS = 2
HEAD_DIM = 128
SPARSE_BLOCK_SIZE = 128
VOCAB_SIZE = 1024
#: Per rank, as one rank of the checkpoint at TP=4.
Q_HEADS_PER_RANK = 16
KV_HEADS_PER_RANK = 1


def engine_config(tp: int = 4) -> dict[str, Any]:
    """``config.json`` of the tiny MiniMax-M3 for tensor-parallel size ``tp``."""
    kv_heads = KV_HEADS_PER_RANK * tp
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3_vl",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "minimax_m3_text",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 256,
            "intermediate_size": 512,
            "dense_intermediate_size": 1024,
            "shared_intermediate_size": 512,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": Q_HEADS_PER_RANK * tp,
            "num_key_value_heads": kv_heads,
            "head_dim": HEAD_DIM,
            "rotary_dim": 64,
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 4096,
            "hidden_act": "swigluoai",
            "use_gemma_norm": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_head",
            "num_local_experts": 8,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "moe_layer_freq": [0, 1],
            "tie_word_embeddings": False,
            "sparse_attention_config": {
                "use_sparse_attention": True,
                "sparse_index_dim": HEAD_DIM,
                "sparse_num_index_heads": kv_heads,
                "sparse_topk_blocks": 16,
                "sparse_block_size": SPARSE_BLOCK_SIZE,
                "sparse_disable_index_value": [0, 1],
                "sparse_score_type": "max",
                "sparse_init_block": 0,
                "sparse_local_block": 1,
                "sparse_attention_freq": [0, 1],
            },
        },
    }


def write_engine_model(directory: str | os.PathLike, tp: int) -> Path:
    """Write :func:`engine_config` for ``tp`` as ``config.json`` in
    ``directory``; return the folder."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(engine_config(tp), indent=2))
    return path
