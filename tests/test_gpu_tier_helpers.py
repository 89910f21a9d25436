# SPDX-License-Identifier: Apache-2.0
"""CPU checks of what the GPU tier (tests/gpu/) builds on: its float32
reference, its writers for the ROCm backends' KV-cache layouts, and the
in-place refill of the runner's buffers."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import attention as at
from vllm_capture_guard.tools import harness as sc


def _step() -> at.Step:
    g = torch.Generator().manual_seed(0)
    return at.make_step(3, [130, 3, 40], 4, 16, 40, g)


def test_reference_matches_sdpa_per_request():
    """Against PyTorch's own attention on each request's gathered K/V, with
    the causal mask placed at the end of the context."""
    step = _step()
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head = 4, 2, 32
    k = torch.randn((40, 16, kv_heads, head), generator=g)
    v = torch.randn((40, 16, kv_heads, head), generator=g)
    q = torch.randn((12, heads, head), generator=g)
    out = at.reference(q, k, v, step, head**-0.5)
    starts = step.offsets
    for i, (qlen, slen) in enumerate(zip(step.query_lens, step.seq_lens, strict=True)):
        rows = out[starts[i] : starts[i + 1]]
        if qlen == 0:
            assert rows.numel() == 0
            continue
        ids = torch.tensor(step.block_ids[i])
        ki = k[ids].reshape(-1, kv_heads, head)[:slen].repeat_interleave(2, dim=1)
        vi = v[ids].reshape(-1, kv_heads, head)[:slen].repeat_interleave(2, dim=1)
        allowed = torch.ones(qlen, slen, dtype=torch.bool).tril(slen - qlen)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[starts[i] : starts[i + 1]].transpose(0, 1),
            ki.transpose(0, 1),
            vi.transpose(0, 1),
            attn_mask=allowed,
        ).transpose(0, 1)
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)
    assert out[step.num_real_tokens :].abs().sum() == 0  # padded rows stay 0


def test_kv_layouts_round_trip_through_the_backends_views():
    """K/V written through each backend's cache views (shape from its own
    get_kv_cache_shape, split as its forward splits it) read back the same,
    and every element of the cache is written."""
    for name in at.LAYOUT_BACKEND.values():
        try:
            backend = sc.backend_class(name)
        except Exception as e:  # 0.33's AITER module asks the GPU at import
            pytest.skip(f"{name} cannot be imported on this host: {type(e).__name__}")
        if not hasattr(backend, "get_kv_cache_shape"):  # 0.29+: KV layouts
            pytest.skip(
                f"{name} has no get_kv_cache_shape on this vLLM; the GPU tier's "
                "cache writers follow the 0.27.x/0.28.0 layouts"
            )
    g = torch.Generator().manual_seed(2)
    for layout in ("unified", "chunked"):
        kv = at.PagedKV.allocate(layout, 5, 16, 2, 64, torch.bfloat16, "cpu")
        k = torch.randn(kv.k.shape, generator=g).to(torch.bfloat16)
        v = torch.randn(kv.v.shape, generator=g).to(torch.bfloat16)
        kv.write(k, v)
        back_k, back_v = kv.read()
        assert torch.equal(back_k, k) and torch.equal(back_v, v), layout
        assert kv.cache.data_ptr() == kv.key_cache.data_ptr()
        assert int((kv.cache == 0).sum()) == int((k == 0).sum() + (v == 0).sum())


def test_refill_reaches_the_builders_metadata():
    """What the GPU tier relies on at replay: writing the runner's buffers in
    place changes what the captured metadata's views read."""
    config = sc.make_vllm_config()
    builder = sc.attention_builder("ROCM_ATTN", config)
    buffers = sc.RunnerBuffers(max_reqs=4, max_blocks=16)
    run = sc.capture([("attention", builder)], sc.Batch(4), buffers=buffers)
    md = run.groups[0].returned
    step = _step()
    at.refill(buffers, step)
    assert md.query_start_loc.tolist() == step.offsets
    assert md.seq_lens.tolist() == list(step.seq_lens)
    assert md.block_table[0, :9].tolist() == list(step.block_ids[0])
