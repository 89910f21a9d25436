# SPDX-License-Identifier: Apache-2.0
"""The guard's host rule on a real GPU: where the metadata's device fields
are on the accelerator, every CPU tensor of it is a host value, whatever its
name.

The runner's buffers are on the GPU, its host offsets in pinned memory (as
vLLM's runner keeps them). A vendor's runner hands the capture one more host
view of those offsets under a neutral name, and the vendor's capture (vLLM's
ROCm capture plus one write) zeroes it. Asserted:

* without the guard, the shared host offsets are zeroed through that view
  and MiniMax-M3's indexer fails (``assert decode_query_len > 0``);
* with it, the neutral view and the host offsets keep their values (put
  back after the capture), the capture saw the runner's own pinned host
  values, the device offsets are zeroed in the runner's own buffer (vLLM
  #25985), and a CUDA graph
  captured on that metadata replays equal to an eager run after the buffers
  are refilled: the device fields are the runner's, not copies.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import async_copies
from vllm_capture_guard.tools.revert import revert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="GPU tier: torch.cuda.is_available() is False (no CUDA/ROCm GPU)",
    ),
]

DEVICE = "cuda"
NEUTRAL = "vendor_request_offsets"


@pytest.fixture(scope="module")
def guarded():
    with async_copies.guard_loaded():
        import vllm.v1.attention.backends.rocm_attn  # noqa: F401 (its hooks apply)

        yield


def _vendor(seen: list) -> type:
    from vllm.v1.attention.backends.rocm_attn import (
        RocmAttentionBackend,
        RocmAttentionMetadataBuilder,
    )

    base = RocmAttentionMetadataBuilder

    class VendorBuilder(base):
        def build_for_cudagraph_capture(self, common_attn_metadata):
            out = base.build_for_cudagraph_capture(self, common_attn_metadata)
            view = getattr(common_attn_metadata, NEUTRAL)
            seen.append(
                (view.is_pinned(), common_attn_metadata.query_start_loc_cpu.is_pinned())
            )
            view.zero_()
            return out

    return type(
        "VendorBackend",
        (RocmAttentionBackend,),
        {"get_builder_cls": staticmethod(lambda: VendorBuilder)},
    )


def _run(seen: list):  # noqa: ANN202
    from vllm_capture_guard.tools import harness as sc

    config = sc.make_vllm_config(0, device=DEVICE)
    spec = _spec()
    builders = [
        ("attention", sc.group_builder(_vendor(seen), spec, config, device=DEVICE)),
        ("indexer", sc.indexer_builder(config, DEVICE)),
    ]
    buffers = sc.RunnerBuffers(max_reqs=8, device=DEVICE)
    batch = sc.Batch(8)
    buffers.fill(batch)
    shared = buffers.common_metadata(batch)
    shared.__dict__[NEUTRAL] = buffers.query_start_loc_cpu[: batch.total_reqs + 1]
    run = sc.capture(builders, metadata=shared)
    return run, buffers, batch, shared


def _spec():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_capture_guard.tools import harness as sc

    return FullAttentionSpec(
        block_size=sc.BLOCK_SIZE,
        num_kv_heads=1,
        head_size=sc.HEAD_SIZE,
        dtype=torch.bfloat16,
    )


def test_a_neutrally_named_host_view_is_kept_on_a_gpu(guarded, gpu_results):
    from vllm_capture_guard.runtime.patches import PATCHES

    # the runner's host buffers are pinned, as vLLM's are on a GPU
    from vllm_capture_guard.tools import harness as sc

    assert sc.RunnerBuffers(max_reqs=2, device=DEVICE).query_start_loc_cpu.is_pinned()
    for patch in reversed(PATCHES):
        revert(patch)
    try:
        run, _, batch, shared = _run([])
        assert run.failed is not None and run.failed.group == "indexer"
        assert run.failed.error_line == "assert decode_query_len > 0"
        unguarded = f"{run.failed.error} at {run.failed.error_site}"
    finally:
        for patch in PATCHES:
            patch.apply()
    seen = []
    run, buffers, batch, shared = _run(seen)
    assert run.failed is None, run.failed
    assert shared.query_start_loc.is_cuda
    assert getattr(shared, NEUTRAL).tolist() == batch.offsets()
    assert shared.query_start_loc_cpu.tolist() == batch.offsets()
    assert seen == [(True, True)]  # the runner's pinned host values, not copies
    assert buffers.query_start_loc[: batch.total_reqs + 1].eq(0).all()  # #25985

    # a graph on the capture's metadata reads the runner's device buffers
    md = run.groups[0].returned
    assert md.query_start_loc.data_ptr() == buffers.query_start_loc.data_ptr()
    out = torch.zeros(batch.total_reqs, dtype=torch.int32, device=DEVICE)

    def kernel() -> None:
        out.copy_(md.query_start_loc[1:] - md.query_start_loc[:-1] + md.seq_lens)

    kernel()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel()
    buffers.fill(batch)  # the runner refills its buffers for a real step
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    kernel()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    assert replayed.tolist() == [1 + batch.seq_len] * batch.total_reqs
    gpu_results["host_by_device"] = {
        "unguarded": unguarded,
        "neutral_view_kept": True,
        "capture_saw_pinned": seen[0],
        "device_offsets_at_capture": [0] * (batch.total_reqs + 1),
        "graph_equals_eager": True,
    }
