# SPDX-License-Identifier: Apache-2.0
"""Tiny model configs, one per attention family, written at run time.

No weights, no Hub: each is a ``config.json`` that vLLM's ``ModelConfig``
reads with ``HF_HUB_OFFLINE=1``. Only what the layers and metadata builders
read is real (head sizes, latent ranks, the indexer's sizes, the layer
schedule); the widths that only weights would use are small.

========================  ==========================================  ==========
family                    serves                                      config
========================  ==========================================  ==========
``minimax_m3``            full attention, MiniMax-M3's indexer,       MiniMax-M3
                          Mamba (the seed bug's model)
``deepseek_v3``           MLA (``kv_lora_rank`` 512, rope 64)         DeepSeek-V3
``deepseek_v32``          sparse MLA and its lightning indexer        DeepSeek-V3.2
``deepseek_v4``           DeepSeek-V4's compressed sparse MLA         DeepSeek-V4
``deepseek_v41``          DeepSeek-V4.1's                             DeepSeek-V4.1
========================  ==========================================  ==========

The DeepSeek-V4 config carries both spellings of its layer schedule
(V4.1's compresses by 1 or 2 instead, and names its source layers):
``compress_ratios`` (vLLM's own ``DeepseekV4Config`` of 0.27 to 0.29, and
V4.1's) and ``layer_types`` with ``compress_rates`` (transformers'
``DeepseekV4Config``, which vLLM 0.33 uses): layer 0 slides a window, layer
1 compresses by 4 (with the indexer), layer 2 by 128.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

#: Block size of the MiniMax-M3 family; the indexer's kernels want 128.
BLOCK_SIZE = 128
HEAD_SIZE = 128

MINIMAX_M3 = "minimax_m3"
DEEPSEEK_V3 = "deepseek_v3"
DEEPSEEK_V32 = "deepseek_v32"
DEEPSEEK_V4 = "deepseek_v4"
DEEPSEEK_V41 = "deepseek_v41"

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

#: DeepSeek-V3's attention as served: 576 = 512 latent + 64 rope per token.
TINY_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

#: DeepSeek-V3.2: V3's MLA plus the lightning indexer (DeepSeek Sparse
#: Attention), with the released indexer's sizes.
TINY_DEEPSEEK_V32: dict[str, Any] = {
    **TINY_DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}

_V4_LAYERS = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]

#: DeepSeek-V4: 512-wide heads (448 NoPE + 64 RoPE), one KV head, grouped
#: output projection, a compressor per compressed layer, an indexer on the
#: layers that compress by 4.
TINY_DEEPSEEK_V4: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 8,
    "o_lora_rank": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "layer_types": _V4_LAYERS,
    "compress_rates": {
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 128,
    },
    "compress_ratios": [0, 4, 128],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}

#: DeepSeek-V4.1: the text model nested under ``text_config``, as its
#: released config is; its compressed layers compress by 1 or 2, and name
#: the layers that hold the compressed KV and the indexer (layer 1 here).
TINY_DEEPSEEK_V41: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "torch_dtype": "bfloat16",
    "text_config": {
        **{
            k: v
            for k, v in TINY_DEEPSEEK_V4.items()
            if k not in ("architectures", "model_type", "torch_dtype", "layer_types")
            and k != "compress_rates"
        },
        "mlp_layer_types": ["sparse"] * 3,
        "compress_ratios": [0, 2, 2],
        "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1],
    },
}

CONFIGS: dict[str, dict[str, Any]] = {
    MINIMAX_M3: TINY_MINIMAX_M3,
    DEEPSEEK_V3: TINY_DEEPSEEK_V3,
    DEEPSEEK_V32: TINY_DEEPSEEK_V32,
    DEEPSEEK_V4: TINY_DEEPSEEK_V4,
    DEEPSEEK_V41: TINY_DEEPSEEK_V41,
}


def write_model(
    family: str = MINIMAX_M3, directory: str | os.PathLike | None = None
) -> Path:
    """Write ``family``'s config as ``config.json``; return the folder."""
    path = Path(directory or tempfile.mkdtemp(prefix=f"capture-guard-{family}-"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIGS[family], indent=2))
    return path
