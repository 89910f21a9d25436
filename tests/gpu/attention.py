# SPDX-License-Identifier: Apache-2.0
"""Paged KV caches in the ROCm backends' layouts, calls of vLLM's own Triton
attention kernels on a builder's metadata, and a float32 reference.

Nothing here copies a kernel: :func:`run_kernel` calls vLLM's
``unified_attention`` (``vllm/v1/attention/ops/triton_unified_attention.py``)
and ``chunked_prefill_paged_decode``
(``vllm/v1/attention/ops/chunked_prefill_paged_decode.py``) the way
``RocmAiterUnifiedAttentionImpl`` and ``RocmAttentionImpl`` call them, on the
tensors of the metadata that a builder returned. The caches are allocated in
the shapes that the backends' own ``get_kv_cache_shape`` gives and split the
way their ``forward`` splits them; :func:`reference` reads the same logical
K/V through the same block table, in float32, with plain PyTorch.

vLLM is imported lazily, so the CPU tier can import :func:`reference` and the
layout helpers without a GPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

ROCM_ATTN = "ROCM_ATTN"
ROCM_AITER_UNIFIED_ATTN = "ROCM_AITER_UNIFIED_ATTN"

#: The kernels the tier captures, and the vLLM function each one goes through.
#: ``query_len`` is the uniform decode query length (1, or 1 + speculative
#: tokens) that makes the wrapper pick that path:
#:
#: * ``unified_attention`` launches the 3D kernel (segmented softmax, then
#:   ``reduce_segments``) only when the segment buffers are given, every query
#:   has length 1 (``max_seqlen_q == 1``) and ``num_seqs <= seq_threshold_3D``;
#:   otherwise the 2D kernel.
#: * ``chunked_prefill_paged_decode`` runs ``context_attention_fwd`` (prefix
#:   prefill, the kernel of vLLM issue #25985) when ``max_query_len > 1``, then
#:   ``kernel_paged_attention_2d`` for the length-1 queries (on NVIDIA the ROCm
#:   custom paged attention is off, so that is its Triton path).
KERNELS: dict[str, dict[str, Any]] = {
    "unified_2d": {"op": "unified", "query_len": 2, "path": "2d"},
    "unified_3d": {"op": "unified", "query_len": 1, "path": "3d"},
    "paged_decode": {"op": "chunked", "query_len": 1, "path": "paged_decode"},
    "prefix_prefill": {"op": "chunked", "query_len": 2, "path": "prefix_prefill"},
}

#: Which backend's KV-cache layout each op reads.
LAYOUT_BACKEND = {"unified": ROCM_AITER_UNIFIED_ATTN, "chunked": ROCM_ATTN}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Step:
    """One real batch: per-request query and sequence (context + query)
    lengths, and the physical KV blocks each request owns."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens)

    def label(self) -> str:
        real = [s for q, s in zip(self.query_lens, self.seq_lens, strict=True) if q]
        pad = self.num_reqs - len(real)
        return f"ctx{min(real)}-{max(real)}" + (f"/pad{pad}" if pad else "")


def make_step(
    query_len: int,
    seq_lens: list[int],
    num_reqs: int,
    block_size: int,
    num_blocks: int,
    generator: torch.Generator,
) -> Step:
    """``seq_lens`` real requests of ``query_len`` new tokens each, padded to
    ``num_reqs`` with empty requests, on randomly chosen physical blocks
    (block 0 is left unused, as vLLM reserves it)."""
    assert all(s >= query_len for s in seq_lens) and len(seq_lens) <= num_reqs
    needed = [cdiv(s, block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks - 1, generator=generator) + 1
    assert sum(needed) <= num_blocks - 1
    ids, at = [], 0
    for n in needed:
        ids.append(tuple(perm[at : at + n].tolist()))
        at += n
    pad = num_reqs - len(seq_lens)
    return Step(
        query_lens=tuple([query_len] * len(seq_lens) + [0] * pad),
        seq_lens=tuple(list(seq_lens) + [0] * pad),
        block_ids=tuple(ids + [()] * pad),
    )


def refill(buffers: Any, step: Step) -> None:
    """Write ``step`` into the runner's persistent buffers in place, as the
    model runner's input preparation does before a graph replay. Every
    ``CommonAttentionMetadata`` (and every builder's metadata) is a set of views
    of these tensors, so the captured graph reads the new values."""
    n = step.num_reqs
    i32 = dict(dtype=torch.int32)
    offsets = torch.tensor(step.offsets, **i32)
    seq = torch.tensor(step.seq_lens, **i32)
    q = torch.tensor(step.query_lens, **i32)
    buffers.query_start_loc_cpu[: n + 1] = offsets
    buffers.query_start_loc[: n + 1].copy_(offsets)
    buffers.seq_lens_cpu[:n] = seq
    buffers.seq_lens[:n].copy_(seq)
    buffers.num_computed_tokens_cpu[:n] = seq - q
    table = torch.zeros(buffers.block_table.shape, **i32)
    for i, ids in enumerate(step.block_ids):
        table[i, : len(ids)] = torch.tensor(ids, **i32)
    buffers.block_table.copy_(table)


# --- KV caches --------------------------------------------------------------


@dataclasses.dataclass
class PagedKV:
    """Logical K/V ``[num_blocks, block_size, num_kv_heads, head_size]`` and
    the cache tensors a kernel reads, in its backend's layout."""

    layout: str  # "unified" | "chunked"
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor  # what the model runner allocates
    key_cache: torch.Tensor  # the views the backend's forward() hands over
    value_cache: torch.Tensor

    @classmethod
    def allocate(
        cls,
        layout: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> PagedKV:
        from vllm_capture_guard.tools.harness import backend_class

        backend = backend_class(LAYOUT_BACKEND[layout])
        shape = backend.get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size
        )
        cache = torch.zeros(shape, dtype=dtype, device=device)
        if layout == "unified":
            # (blocks, kv_heads, block_size, 2*head) -> two
            # (blocks, block_size, kv_heads, head) views, as the impl splits it
            key_cache, value_cache = cache.transpose(1, 2).split(head_size, dim=-1)
        else:
            from vllm.v1.attention.ops.paged_attn import PagedAttention

            key_cache, value_cache = PagedAttention.split_kv_cache(
                cache, num_kv_heads, head_size
            )
        logical = (num_blocks, block_size, num_kv_heads, head_size)
        return cls(
            layout,
            torch.zeros(logical, dtype=dtype, device=device),
            torch.zeros(logical, dtype=dtype, device=device),
            cache,
            key_cache,
            value_cache,
        )

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set the logical K/V and write them into the cache in place."""
        self.k.copy_(k)
        self.v.copy_(v)
        write_cache(self.layout, self.key_cache, self.value_cache, k, v)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical K/V, read back out of the cache (for the layout test)."""
        return read_cache(self.layout, self.key_cache, self.value_cache)


def write_cache(layout, key_cache, value_cache, k, v) -> None:
    """``k``, ``v``: ``[blocks, block_size, kv_heads, head]``."""
    if layout == "unified":
        key_cache.copy_(k)
        value_cache.copy_(v)
        return
    # key: [blocks, kv_heads, head // x, block_size, x]
    # value: [blocks, kv_heads, head, block_size]
    nb, bs, h, d = k.shape
    x = key_cache.shape[-1]
    key_cache.copy_(k.reshape(nb, bs, h, d // x, x).permute(0, 2, 3, 1, 4))
    value_cache.copy_(v.permute(0, 2, 3, 1))


def read_cache(layout, key_cache, value_cache) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "unified":
        return key_cache.clone(), value_cache.clone()
    nb, h, dx, bs, x = key_cache.shape
    k = key_cache.permute(0, 3, 1, 2, 4).reshape(nb, bs, h, dx * x)
    v = value_cache.permute(0, 3, 1, 2)
    return k.contiguous(), v.contiguous()


# --- the reference ----------------------------------------------------------


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """Causal attention in float32 over the paged K/V.

    ``q``: ``[tokens, heads, head]``; ``k``, ``v``: logical
    ``[blocks, block_size, kv_heads, head]``. Request ``i``'s token ``j`` sits
    at position ``seq_len - query_len + j`` and sees positions up to its own.
    Rows of padded (empty) requests stay zero."""
    tokens, heads, _ = q.shape
    kv_heads = k.shape[2]
    block_size = k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = step.offsets
    for i, (qlen, slen) in enumerate(zip(step.query_lens, step.seq_lens, strict=True)):
        if qlen == 0:
            continue
        ids = torch.tensor(step.block_ids[i], device=k.device, dtype=torch.long)
        ki = k[ids].reshape(-1, kv_heads, k.shape[-1])[:slen].float()
        vi = v[ids].reshape(-1, kv_heads, v.shape[-1])[:slen].float()
        assert ki.shape[0] == slen <= len(step.block_ids[i]) * block_size
        group = heads // kv_heads
        ki = ki.repeat_interleave(group, dim=1)  # [slen, heads, head]
        vi = vi.repeat_interleave(group, dim=1)
        qi = q[starts[i] : starts[i + 1]].float()  # [qlen, heads, head]
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        pos = torch.arange(slen, device=q.device)
        last = slen - qlen + torch.arange(qlen, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > last[None, :, None], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, vi)
    return out


def new_tokens(kv: PagedKV, step: Step, tokens: int) -> tuple[torch.Tensor, ...]:
    """The K/V of each request's new tokens (what the layer passes as
    ``key``/``value`` beside the cache, already written into it)."""
    kv_heads, head = kv.k.shape[2], kv.k.shape[3]
    block_size = kv.k.shape[1]
    kn = torch.zeros((tokens, kv_heads, head), dtype=kv.k.dtype, device=kv.k.device)
    vn = torch.zeros_like(kn)
    starts = step.offsets
    for i, (qlen, slen) in enumerate(zip(step.query_lens, step.seq_lens, strict=True)):
        for j in range(qlen):
            pos = slen - qlen + j
            block = step.block_ids[i][pos // block_size]
            kn[starts[i] + j] = kv.k[block, pos % block_size]
            vn[starts[i] + j] = kv.v[block, pos % block_size]
    return kn, vn


# --- vLLM's kernels ---------------------------------------------------------


@dataclasses.dataclass
class KernelCall:
    """Everything one attention call reads. The metadata is the builder's
    (views of the runner's buffers); the rest are static tensors that a step
    rewrites in place, as the model's activations and KV cache are."""

    op: str  # "unified" | "chunked"
    metadata: Any  # the ROCm builder's RocmAttentionMetadata
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    kv: PagedKV
    scale: float
    segments: dict[str, Any] | None = None  # unified 3D buffers

    def __call__(self, out: torch.Tensor) -> None:
        run_kernel(self, out)


def segment_buffers(tokens: int, heads: int, head_size: int, device) -> dict[str, Any]:
    """The 3D kernel's softmax-segment buffers, sized as vLLM's Triton backend
    sizes them (its threshold and segment count)."""
    from vllm.v1.attention.backends import triton_attn

    segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    threshold = max(triton_attn.MIN_LAUNCH_GRID_SIZE_2D, tokens)
    padded = 1 << (head_size - 1).bit_length()
    f32 = dict(dtype=torch.float32, device=device)
    return {
        "seq_threshold_3D": threshold,
        "num_par_softmax_segments": segments,
        "softmax_segm_output": torch.empty((threshold, heads, segments, padded), **f32),
        "softmax_segm_max": torch.empty((threshold, heads, segments), **f32),
        "softmax_segm_expsum": torch.empty((threshold, heads, segments), **f32),
    }


def run_kernel(call: KernelCall, out: torch.Tensor) -> None:
    md = call.metadata
    t = md.num_actual_tokens
    one = torch.ones((), dtype=torch.float32, device=call.q.device)
    if call.op == "unified":
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention

        descale = (md.query_start_loc.shape[0] - 1, call.kv.key_cache.shape[2])
        unified_attention(
            q=call.q[:t],
            k=call.kv.key_cache,
            v=call.kv.value_cache,
            out=out[:t],
            cu_seqlens_q=md.query_start_loc,
            max_seqlen_q=md.max_query_len,
            seqused_k=md.seq_lens,
            max_seqlen_k=md.max_seq_len,
            softmax_scale=call.scale,
            causal=True,
            window_size=(-1, -1),
            block_table=md.block_table,
            softcap=0,
            q_descale=None,
            k_descale=one.expand(descale),
            v_descale=one.expand(descale),
            **(call.segments or {}),
        )
        return
    from vllm.v1.attention.ops.chunked_prefill_paged_decode import (
        chunked_prefill_paged_decode,
    )

    chunked_prefill_paged_decode(
        query=call.q[:t],
        key=call.k_new[:t],
        value=call.v_new[:t],
        output=out[:t],
        kv_cache_dtype="auto",
        key_cache=call.kv.key_cache,
        value_cache=call.kv.value_cache,
        block_table=md.block_table,
        query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        max_seq_len=md.max_seq_len,
        max_query_len=md.max_query_len,
        k_scale=one,
        v_scale=one,
        alibi_slopes=None,
        sliding_window=-1,
        sm_scale=call.scale,
        causal=md.causal,
    )
