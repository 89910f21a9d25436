# SPDX-License-Identifier: Apache-2.0
"""A real ``VllmConfig`` and real builders, with no Hub, network or GPU.

:func:`make_vllm_config` builds a ``VllmConfig`` for a tiny model whose
``config.json`` we write (:mod:`.models`: MiniMax-M3 by default; no weights
exist or are needed to build metadata) and initialises vLLM's distributed state for one
process (gloo), as a worker would.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Any

import torch

from vllm_capture_guard.tools.harness.models import (
    BLOCK_SIZE,
    HEAD_SIZE,
    MINIMAX_M3,
    write_model,
)

ATTN_LAYER = "model.layers.0.self_attn.attn"
INDEXER_LAYER = "model.layers.1.self_attn.indexer.index_cache"


def write_tiny_model(directory: str | os.PathLike | None = None) -> Path:
    """Write :data:`TINY_MINIMAX_M3` as ``config.json``; return the folder."""
    return write_model(MINIMAX_M3, directory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=8)
def model_config(family: str = MINIMAX_M3) -> Any:
    """vLLM's ``ModelConfig`` of ``family``'s tiny config (cached)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(write_model(family)),
        skip_tokenizer_init=True,
        max_model_len=4096,
        dtype="bfloat16",
    )


def ensure_distributed(vllm_config: Any) -> None:
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


def ensure_workspace(device: str) -> None:
    """vLLM's workspace manager on ``device``, set up once per process, as
    the GPU worker sets it up before it makes the model (sparse MLA layers
    reserve their scratch there); releases without one skip this."""
    try:
        from vllm.v1.worker import workspace
    except ImportError:
        return
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device(device))


#: ``max_num_seqs`` as ``vllm serve`` defaults it on an MI300X, MI325X or
#: MI355X (``EngineArgs``: 1024 on a device with 160 GiB or more; 256 on
#: smaller GPUs). Either way vLLM caps the capture sizes at 512.
SERVE_MAX_NUM_SEQS = 1024


def graph_config(config: Any, max_num_seqs: int = SERVE_MAX_NUM_SEQS) -> Any:
    """Give ``config`` what a GPU config has: full decode graphs and the
    capture sizes vLLM derives for them (vLLM's own ``_set_cudagraph_sizes``).
    On a CPU host vLLM's platform has no graph mode, so the harness switches
    it on as a GPU platform would. Returns ``config``."""
    from vllm.config import CUDAGraphMode

    cc = config.compilation_config
    config.scheduler_config.max_num_seqs = max_num_seqs
    cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    cc.cudagraph_capture_sizes = None
    cc.max_cudagraph_capture_size = None
    config._set_cudagraph_sizes()
    return config


@functools.lru_cache(maxsize=32)
def make_vllm_config(
    num_speculative_tokens: int = 0,
    device: str = "cpu",
    graphs: bool = False,
    family: str = MINIMAX_M3,
    kv_cache_dtype: str = "auto",
) -> Any:
    """A real ``VllmConfig`` for a tiny model (cached per process): the
    MiniMax-M3 by default, or another ``family`` of :mod:`.models`, with the
    KV cache in ``kv_cache_dtype``.

    Speculative decoding is enabled only when ``num_speculative_tokens`` is
    given (a speculative verify batch has a query length above 1). It uses
    the n-gram proposer: it needs no draft model and sets
    ``num_speculative_tokens``, which is all the builders read.

    With ``graphs``, the config has full decode graphs and the capture sizes
    vLLM derives for them, as on a GPU (:func:`graph_config`)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model = model_config(family)
    speculative = None
    if num_speculative_tokens:
        speculative = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=3,
            prompt_lookup_min=1,
            target_model_config=model,
            target_parallel_config=ParallelConfig(),
        )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=kv_cache_dtype),
        device_config=DeviceConfig(device=device),
        speculative_config=speculative,
    )
    if graphs:
        graph_config(config)
    ensure_distributed(config)
    ensure_workspace(device)
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


def indexer_builder(vllm_config: Any, device: str = "cpu", backend: Any = None) -> Any:
    """MiniMax-M3's lightning-indexer builder, as vLLM makes it for its
    backend (the second KV-cache group); ``backend``: another indexer backend
    of the same cache (the ROCm path's own, where a release has one)."""
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    backend = backend or MiniMaxM3IndexerBackend
    return group_builder(backend, spec, vllm_config, INDEXER_LAYER, device, 1)
