# SPDX-License-Identifier: Apache-2.0
"""Capture on the current stream (PR #53818), on the GPU, through Model
Runner V2's own capture code: vLLM's ``CudaGraphManager.capture``
(``vllm/v1/worker/gpu/cudagraph_utils.py``) with vLLM's real
``graph_capture()`` (world size 1 over gloo), capturing one FULL graph of a
toy forward.

The toy op keeps per-stream state as AITER's split-K GEMM does: an eager call
on a stream (vLLM's warm-up) creates that stream's workspace; a call inside a
capture on a stream that has none raises, with AITER's words. The manager is
made with ``object.__new__`` and given the attributes ``capture`` reads (its
constructor asks for a model runner's whole configuration); everything
``capture`` then does is vLLM's.

Without the patch the capture must fail that way; with it, the graph is
captured and its replays equal the eager op. It applies and reverts the
patch itself, so it runs in any order with the other files of the tier.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from vllm_capture_guard.tools.revert import revert

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (CUDA or HIP)"
)

AITER_WORDS = "splitk workspace not initialized for the current CUDA stream"
TOKENS = 64
HIDDEN = 256


class SplitKToy:
    """``y = 3 * x + 1`` through a workspace kept per stream."""

    def __init__(self) -> None:
        self.workspaces: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        stream = torch.cuda.current_stream().cuda_stream
        ws = self.workspaces.get(stream)
        if ws is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{AITER_WORDS}. Call aiter.opus_gemm_workspace_init() on "
                    f"the capture stream (toy op, stream {stream:#x})"
                )
            ws = self.workspaces[stream] = torch.empty_like(x)
        torch.mul(x, 3.0, out=ws)
        return ws + 1.0


@pytest.fixture(scope="module")
def mrv2():
    from vllm_capture_guard.tools import harness

    harness.make_vllm_config(0, device="cuda")  # world size 1 over gloo
    import vllm.v1.worker.gpu.cudagraph_utils as m

    return m


def _manager(m):
    from vllm.config.compilation import CUDAGraphMode

    desc = m.BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=TOKENS, num_reqs=TOKENS
    )
    mgr = object.__new__(m.CudaGraphManager)
    mgr.__dict__.update(
        device=torch.device("cuda", 0),
        _capture_descs={CUDAGraphMode.FULL: [desc]},
        use_breakable_cg=False,
        graphs={},
        pool=torch.cuda.graph_pool_handle(),
        _graphs_captured=False,
    )
    return mgr, desc


def _capture(m):
    """vLLM's capture of one FULL graph; returns (graph, x, out, toy, streams)."""
    toy = SplitKToy()
    x = torch.randn(TOKENS, HIDDEN, device="cuda")
    out = torch.empty_like(x)
    streams = []

    def create_forward_fn(desc, warmup):
        def forward_fn(mode):
            streams.append(torch.cuda.current_stream().cuda_stream)
            out.copy_(toy(x))

        return forward_fn

    mgr, desc = _manager(m)
    mgr.capture(create_forward_fn)
    return mgr.graphs[desc], x, out, toy, streams


@contextlib.contextmanager
def _patch(on: bool):
    from vllm_capture_guard.runtime.patching import Status
    from vllm_capture_guard.tools.fixes import by_name

    patch = by_name("graph-capture-stream")
    revert(patch)
    try:
        if on:
            outcome = patch.apply()
            assert outcome.status is Status.PATCHED, outcome
        yield patch
    finally:
        revert(patch)


def test_unpatched_capture_fails_as_reported(mrv2, gpu_results):
    with _patch(on=False), pytest.raises(RuntimeError, match=AITER_WORDS) as e:
        _capture(mrv2)
    torch.cuda.synchronize()
    gpu_results.setdefault("capture_stream", {})["unpatched"] = str(e.value)


def test_patched_capture_replays_as_eager(mrv2, gpu_results):
    from vllm_capture_guard.tools.guard import inspect

    with _patch(on=True) as patch:
        outcome = str(inspect(patch))
        graph, x, out, toy, streams = _capture(mrv2)
    warm_up, captured = streams
    assert warm_up == captured  # the capture ran on graph_capture()'s stream
    assert len(toy.workspaces) == 1
    errors = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        errors.append((out - (3.0 * x + 1.0)).abs().max().item())
    x.copy_(torch.randn(x.shape, device="cuda", generator=gen))  # control:
    control = (out - (3.0 * x + 1.0)).abs().max().item()  # no replay
    gpu_results.setdefault("capture_stream", {}).update(
        {
            "patched": outcome,
            "replays": len(errors),
            "max_abs_error": max(errors),
            "control_error": control,
            "same_stream": warm_up == captured,
        }
    )
    assert max(errors) == 0.0, errors
    assert control > 0.1  # replays did the work, not a stale buffer
