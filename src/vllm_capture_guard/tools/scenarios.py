# SPDX-License-Identifier: Apache-2.0
"""vLLM's real metadata builders, driven the way the model runner drives them
during full CUDA-graph capture, with no Hub, no network and no GPU.

* :func:`make_vllm_config` builds a real ``VllmConfig`` for a tiny MiniMax-M3
  whose ``config.json`` we write (:data:`TINY_MINIMAX_M3`), and initialises
  vLLM's distributed state for one process (gloo), as a worker would.
* :class:`RunnerBuffers` are persistent buffers like the runner's: a device and
  a CPU ``query_start_loc``, ``seq_lens``, block table and slot mapping. Every
  ``CommonAttentionMetadata`` is a set of views of them.
* :func:`run_capture` builds one ``CommonAttentionMetadata`` for a
  :class:`Batch`, gives each KV-cache group a shallow copy of it (as
  ``gpu_model_runner._build_attention_metadata`` does), and calls every
  builder's ``build_for_cudagraph_capture`` in group order, recording what
  each capture wrote into the shared tensors and what the indexer built.

Batches are data (:class:`Batch`), after vLLM's own ``BatchSpec`` test helper.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import tempfile
import traceback
from copy import copy
from pathlib import Path
from typing import Any

import torch

from vllm_capture_guard.runtime.contract import FieldWrite, snapshot

ROCM_ATTN = "ROCM_ATTN"
ROCM_AITER_UNIFIED_ATTN = "ROCM_AITER_UNIFIED_ATTN"
ROCM_BACKENDS = (ROCM_ATTN, ROCM_AITER_UNIFIED_ATTN)

#: Block size shared by both groups; the indexer's kernels want 128.
BLOCK_SIZE = 128
HEAD_SIZE = 128
ATTN_LAYER = "model.layers.0.self_attn.attn"
INDEXER_LAYER = "model.layers.1.self_attn.indexer.index_cache"
PAD_SLOT_ID = -1  # what the runner writes into padded tokens' slots

#: A MiniMax-M3 small enough to configure in milliseconds. Only the config is
#: real; no weights exist or are needed to build metadata.
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


@dataclasses.dataclass(frozen=True)
class Batch:
    """A uniform-decode capture batch.

    ``num_reqs`` requests each have ``query_len`` tokens (1, or 1 + speculative
    tokens); the runner pads the batch to ``padded_reqs`` requests whose
    queries are empty, as it does for cudagraph sizes between captured ones.
    """

    num_reqs: int
    query_len: int = 1
    padded_reqs: int | None = None
    seq_len: int = 64

    @property
    def total_reqs(self) -> int:
        return self.padded_reqs or self.num_reqs

    @property
    def num_tokens(self) -> int:
        """Tokens the graph is run for: the runner pads tokens with requests
        (``num_actual_tokens`` is the padded count)."""
        return self.total_reqs * self.query_len

    @property
    def num_real_tokens(self) -> int:
        return self.num_reqs * self.query_len

    @property
    def query_lens(self) -> list[int]:
        pad = self.total_reqs - self.num_reqs
        return [self.query_len] * self.num_reqs + [0] * pad

    def offsets(self) -> list[int]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out

    def label(self) -> str:
        pad = f"/pad{self.padded_reqs}" if self.padded_reqs else ""
        return f"reqs{self.num_reqs}{pad}xq{self.query_len}"


#: The shapes the tests and ``check`` cover: request counts, speculative query
#: lengths, and padded batches whose tail requests have empty queries.
DEFAULT_BATCHES = (
    Batch(1),
    Batch(4),
    Batch(7, padded_reqs=8),
    Batch(3, query_len=2),
    Batch(2, query_len=4, padded_reqs=4),
    Batch(16, query_len=4),
)


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
def make_vllm_config(num_speculative_tokens: int = 0, device: str = "cpu") -> Any:
    """A real ``VllmConfig`` for the tiny MiniMax-M3 (cached per process).

    Speculative decoding uses the n-gram proposer: it needs no draft model and
    sets ``num_speculative_tokens``, which is all the builders read."""
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
    _ensure_distributed(config)
    return config


def backend_class(name: str) -> type:
    """The backend class that vLLM's registry names ``name``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def attention_builder(backend: str, vllm_config: Any, device: str = "cpu") -> Any:
    """The ROCm builder that ``backend``'s ``get_builder_cls()`` names."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    cls = backend_class(backend).get_builder_cls()
    with set_current_vllm_config(vllm_config):
        return cls(spec, [ATTN_LAYER], vllm_config, torch.device(device))


def indexer_builder(vllm_config: Any, device: str = "cpu") -> Any:
    """MiniMax-M3's lightning-indexer builder, through its backend."""
    from vllm.config import set_current_vllm_config
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    cls = MiniMaxM3IndexerBackend.get_builder_cls()
    with set_current_vllm_config(vllm_config):
        return cls(spec, [INDEXER_LAYER], vllm_config, torch.device(device))


class RunnerBuffers:
    """Persistent input buffers, like ``GPUModelRunner``'s (``CpuGpuBuffer``
    pairs for the offsets, device-only tensors for the rest)."""

    def __init__(self, max_reqs: int = 64, max_blocks: int = 8, device="cpu"):
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32)
        self.query_start_loc = torch.zeros(max_reqs + 1, device=self.device, **i32)
        self.query_start_loc_cpu = torch.zeros(max_reqs + 1, **i32)
        self.seq_lens = torch.zeros(max_reqs, device=self.device, **i32)
        self.seq_lens_cpu = torch.zeros(max_reqs, **i32)
        self.num_computed_tokens_cpu = torch.zeros(max_reqs, **i32)
        self.block_table = torch.zeros(
            (max_reqs, max_blocks), device=self.device, **i32
        )
        self.slot_mapping = torch.zeros(
            max_reqs * 8, device=self.device, dtype=torch.int64
        )
        self.positions = torch.zeros(
            max_reqs * 8, device=self.device, dtype=torch.int64
        )
        self.is_prefilling = torch.zeros(max_reqs, dtype=torch.bool)

    def fill(self, batch: Batch) -> None:
        """Write ``batch`` into the buffers in place, as ``_prepare_inputs``."""
        n = batch.total_reqs
        offsets = torch.tensor(batch.offsets(), dtype=torch.int32)
        self.query_start_loc_cpu[: n + 1] = offsets
        self.query_start_loc[: n + 1].copy_(offsets)
        seq = torch.full((n,), batch.seq_len, dtype=torch.int32)
        seq[batch.num_reqs :] = 0
        self.seq_lens_cpu[:n] = seq
        self.seq_lens[:n].copy_(seq)
        q = torch.tensor(batch.query_lens, dtype=torch.int32)
        self.num_computed_tokens_cpu[:n] = seq - q
        blocks = -(-batch.seq_len // BLOCK_SIZE)
        table = torch.arange(n * blocks, dtype=torch.int32).reshape(n, blocks) + 1
        self.block_table.zero_()
        self.block_table[:n, :blocks].copy_(table)
        t, real = batch.num_tokens, batch.num_real_tokens
        self.slot_mapping[:real].copy_(torch.arange(real, dtype=torch.int64))
        self.slot_mapping[real:t].fill_(PAD_SLOT_ID)
        self.positions[:t].copy_(torch.arange(t, dtype=torch.int64))

    def common_metadata(self, batch: Batch) -> Any:
        """One ``CommonAttentionMetadata`` of views, with the fields that the
        installed vLLM declares (the set changes between releases)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = batch.total_reqs
        values = dict(
            query_start_loc=self.query_start_loc[: n + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: n + 1],
            seq_lens=self.seq_lens[:n],
            _seq_lens_cpu=self.seq_lens_cpu[:n],
            _num_computed_tokens_cpu=self.num_computed_tokens_cpu[:n],
            seq_lens_cpu_upper_bound=self.seq_lens_cpu[:n],
            num_reqs=n,
            num_actual_tokens=batch.num_tokens,
            max_query_len=batch.query_len,
            max_seq_len=batch.seq_len,
            block_table_tensor=self.block_table[:n],
            slot_mapping=self.slot_mapping[: batch.num_tokens],
            causal=True,
            is_prefilling=self.is_prefilling[:n],
            positions=self.positions[: batch.num_tokens],
        )
        declared = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
        return CommonAttentionMetadata(
            **{k: v for k, v in values.items() if k in declared}
        )


@dataclasses.dataclass
class GroupCapture:
    """What one builder's capture did."""

    group: str
    builder: str
    writes: list[FieldWrite]
    metadata: Any = None
    error: str | None = None
    error_site: str | None = None  # "vllm/...py:line" where it was raised
    error_line: str | None = None  # that line's source text


@dataclasses.dataclass
class CaptureRun:
    backend: str
    batch: Batch
    groups: list[GroupCapture]
    query_start_loc_cpu_before: list[int]
    query_start_loc_cpu_after: list[int]
    query_start_loc_after: list[int]

    @property
    def failed(self) -> GroupCapture | None:
        return next((g for g in self.groups if g.error), None)

    @property
    def decode_query_len(self) -> int | None:
        for g in self.groups:
            decode = getattr(g.metadata, "decode", None)
            if decode is not None:
                return decode.decode_query_len
        return None


def _error_site(exc: BaseException) -> tuple[str, str]:
    """Where inside vLLM ``exc`` was raised: ``("vllm/...py:LINE", source)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if f"{os.sep}vllm{os.sep}" in f.filename]
    frame = (inside or frames)[-1]
    parts = Path(frame.filename).parts
    rel = "/".join(parts[parts.index("vllm") :]) if "vllm" in parts else frame.filename
    return f"{rel}:{frame.lineno}", (frame.line or "").strip()


def capture_groups(
    builders: list[tuple[str, Any]], buffers: RunnerBuffers, batch: Batch
) -> CaptureRun:
    """Fill ``buffers`` with ``batch`` and run each ``(group, builder)``'s
    capture in order on a shallow copy of one shared metadata."""
    from vllm.config import set_current_vllm_config

    buffers.fill(batch)
    base = buffers.common_metadata(batch)
    before = buffers.query_start_loc_cpu[: batch.total_reqs + 1].tolist()
    groups: list[GroupCapture] = []
    for group, builder in builders:
        cm = copy(base)  # the runner's per-group shallow copy
        seen = snapshot(base)
        result = GroupCapture(group, type(builder).__name__, [])
        try:
            with set_current_vllm_config(builder.vllm_config):
                result.metadata = builder.build_for_cudagraph_capture(cm)
        except Exception as e:
            result.error = f"{type(e).__name__}: {e}".rstrip(": ")
            result.error_site, result.error_line = _error_site(e)
        result.writes = seen.writes()
        groups.append(result)
        if result.error:
            break
    n = batch.total_reqs + 1
    return CaptureRun(
        backend="",
        batch=batch,
        groups=groups,
        query_start_loc_cpu_before=before,
        query_start_loc_cpu_after=buffers.query_start_loc_cpu[:n].tolist(),
        query_start_loc_after=buffers.query_start_loc[:n].cpu().tolist(),
    )


def run_capture(backend: str, batch: Batch, device: str = "cpu") -> CaptureRun:
    """The seed scenario: ``backend``'s ROCm builder, then MiniMax-M3's indexer,
    on shared runner buffers, in the runner's capture order."""
    spec = max(batch.query_len - 1, 0)
    config = make_vllm_config(spec, device)
    builders = [
        ("attention", attention_builder(backend, config, device)),
        ("indexer", indexer_builder(config, device)),
    ]
    run = capture_groups(builders, RunnerBuffers(device=device), batch)
    run.backend = backend
    return run
