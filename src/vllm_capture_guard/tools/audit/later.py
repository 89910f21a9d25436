# SPDX-License-Identifier: Apache-2.0
"""The later builders of the sequenced check: those that a family's models
really put beside the audited backend, each in its own KV-cache group,
built after the audited capture on the same shared metadata.

========================  ===================================================
family                    later builders
========================  ===================================================
MiniMax-M3                its lightning indexer (``MINIMAX_M3_INDEXER``), the
                          indexer a ROCm server builds where the release has
                          one of its own (``MINIMAX_M3_INDEXER_MSA``), and
                          ``TRITON_ATTN``, ``MAMBA2`` (the seed bug's class)
DeepSeek-V3               none (every layer is MLA: one group)
DeepSeek-V3.2             its lightning indexer's builder
                          (``DEEPSEEK_V32_INDEXER``: the indexer module's
                          K cache layer, its backend's builder)
DeepSeek-V4, V4.1         their indexers' (``DEEPSEEK_V4_INDEXER``,
                          ``DEEPSEEK_V41_INDEXER``)
========================  ===================================================

Each indexer is the model's own module, built standalone under its family's
config: it registers its K cache layer, whose spec and backend the runner
would collect. A registry name (``TRITON_ATTN``) is built as the audit
builds any backend.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Iterable
from typing import Any

from vllm_capture_guard.tools.audit import layers
from vllm_capture_guard.tools.audit.build import (
    Configs,
    Skip,
    build_subject,
    group_setup,
)
from vllm_capture_guard.tools.audit.registry import find
from vllm_capture_guard.tools.harness import describe, group_builder, indexer_builder
from vllm_capture_guard.tools.harness.models import (
    DEEPSEEK_V3,
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    DEEPSEEK_V41,
    MINIMAX_M3,
)

MINIMAX_M3_INDEXER = "MINIMAX_M3_INDEXER"
MINIMAX_M3_INDEXER_MSA = "MINIMAX_M3_INDEXER_MSA"
DEEPSEEK_V32_INDEXER = "DEEPSEEK_V32_INDEXER"
DEEPSEEK_V4_INDEXER = "DEEPSEEK_V4_INDEXER"
DEEPSEEK_V41_INDEXER = "DEEPSEEK_V41_INDEXER"

#: The module of the ROCm path's own MiniMax-M3 indexer, where a release has it.
MSA_MODULE = "vllm.models.minimax_m3.amd.indexer_msa"

#: Per family, the later builders its models put beside the audited backend.
BY_FAMILY: dict[str, tuple[str, ...]] = {
    MINIMAX_M3: (MINIMAX_M3_INDEXER, MINIMAX_M3_INDEXER_MSA, "TRITON_ATTN", "MAMBA2"),
    DEEPSEEK_V3: (),
    DEEPSEEK_V32: (DEEPSEEK_V32_INDEXER,),
    DEEPSEEK_V4: (DEEPSEEK_V4_INDEXER,),
    DEEPSEEK_V41: (DEEPSEEK_V41_INDEXER,),
}
INDEXER_FAMILY = {
    DEEPSEEK_V32_INDEXER: DEEPSEEK_V32,
    DEEPSEEK_V4_INDEXER: DEEPSEEK_V4,
    DEEPSEEK_V41_INDEXER: DEEPSEEK_V41,
}


@dataclasses.dataclass
class Later:
    """A builder run after each audited capture, in its own KV-cache group:
    one instance per number of speculative tokens, or why it cannot be built."""

    name: str
    builders: dict[int, Any]
    problem: str | None = None
    family: str = MINIMAX_M3
    backend: Any = None


def applies(name: str) -> bool:
    """Whether this release has the later builder at all (the ROCm path's
    MiniMax-M3 indexer exists only in some releases)."""
    if name == MINIMAX_M3_INDEXER_MSA:
        return importlib.util.find_spec(MSA_MODULE) is not None
    if name == DEEPSEEK_V41_INDEXER:
        return importlib.util.find_spec(layers.V4_PACKAGES[DEEPSEEK_V41]) is not None
    return True


def _indexer_module(family: str) -> Any:
    """The class of ``family``'s indexer module, as the release has it."""
    if family == DEEPSEEK_V32:
        try:
            from vllm.models.deepseek_v32.attention import DeepseekV32Indexer
        except ImportError:
            from vllm.model_executor.models.deepseek_v2 import (
                Indexer as DeepseekV32Indexer,
            )
        return DeepseekV32Indexer
    package = layers.V4_PACKAGES[family]
    return importlib.import_module(f"{package}.attention").DeepseekV4Indexer


def indexer_cache_layer(family: str, vllm_config: Any) -> Any:
    """``family``'s indexer K cache layer, made as its attention layer makes
    it: by the indexer module (DeepSeek-V3.2, V4), or directly by the layer
    (V4.1, whose indexers share one K cache per source layer)."""
    from vllm.config import set_current_vllm_config

    hf = vllm_config.model_config.hf_text_config
    with set_current_vllm_config(vllm_config):
        if family == DEEPSEEK_V41:
            return _v41_cache(vllm_config, hf)
        cls = _indexer_module(family)
        given: dict[str, Any] = dict(
            vllm_config=vllm_config,
            config=hf,
            hidden_size=hf.hidden_size,
            q_lora_rank=hf.q_lora_rank,
            quant_config=None,
            cache_config=vllm_config.cache_config,
            topk_indices_buffer=layers.topk_buffer(vllm_config),
            prefix=f"{layers.MLA_LAYER}.indexer",
        )
        if family != DEEPSEEK_V32:
            given.update(compress_ratio=4, prefix=f"{layers.V4_LAYER}.indexer")
        return cls(**layers._kwargs(cls.__init__, **given)).k_cache


def _v41_cache(vllm_config: Any, hf: Any) -> Any:
    import torch

    module = importlib.import_module(f"{layers.V4_PACKAGES[DEEPSEEK_V41]}.attention")
    head_dim = hf.index_head_dim + hf.index_head_dim // 128 * 4  # FP8 + scales
    size = getattr(module, "_indexer_k_cache_head_dim", None)
    if size is not None:
        from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4

        head_dim = size(hf.index_head_dim, dsa_indexer_uses_fp4(vllm_config))
    ratio = hf.compress_ratios[1]
    return module.DeepseekV4IndexerCache(
        head_dim=head_dim,
        dtype=torch.uint8,
        prefix=f"{layers.V4_LAYER}.indexer.k_cache",
        cache_config=vllm_config.cache_config,
        compress_ratio=ratio,
    )


def _indexer_builders(
    name: str, configs: Configs, spec_tokens: Iterable[int]
) -> tuple[dict[int, Any], Any]:
    family = INDEXER_FAMILY[name]
    backend = indexer_cache_layer(family, configs.get(0, family)).get_attn_backend()
    setup = group_setup(backend, family)
    setup["kv_cache_dtype"] = "auto"
    builders = {}
    for n in sorted(set(spec_tokens)):
        cfg = configs.get(n, **setup)
        cache = indexer_cache_layer(family, cfg)
        spec = cache.get_kv_cache_spec(cfg)
        builders[n] = group_builder(backend, spec, cfg, cache.prefix, group_id=1)
    return builders, backend


def _msa_builders(configs: Configs, spec_tokens: Iterable[int]) -> dict[int, Any]:
    backend = importlib.import_module(MSA_MODULE).MiniMaxM3IndexerMSABackend
    return {
        n: indexer_builder(configs.get(n), backend=backend)
        for n in sorted(set(spec_tokens))
    }


def build_later(name: str, configs: Configs, spec_tokens: Iterable[int]) -> Later:
    builders: dict[int, Any] = {}
    family, backend = INDEXER_FAMILY.get(name, MINIMAX_M3), None
    try:
        if name == MINIMAX_M3_INDEXER:
            for n in sorted(set(spec_tokens)):
                builders[n] = indexer_builder(configs.get(n))
        elif name == MINIMAX_M3_INDEXER_MSA:
            builders = _msa_builders(configs, spec_tokens)
        elif name in INDEXER_FAMILY:
            builders, backend = _indexer_builders(name, configs, spec_tokens)
        else:
            entry = find(name)
            if entry is None:
                return Later(name, {}, f"no backend named {name} is registered")
            subject = build_subject(entry, configs, spec_tokens)
            builders, family = subject.builders, subject.family
            backend = subject.backend
    except BaseException as e:
        problem = str(e) if isinstance(e, Skip) else describe(e)
        return Later(name, {}, problem, family)
    return Later(name, builders, None, family, backend)
