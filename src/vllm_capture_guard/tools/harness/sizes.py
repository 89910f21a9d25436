# SPDX-License-Identifier: Apache-2.0
"""The capture sizes vLLM derives for a config, and the runner's capture
order over them, computed by vLLM's own code.

On a GPU, ``VllmConfig`` derives ``compilation_config.cudagraph_capture_sizes``
from ``max_num_seqs`` and the speculative tokens (``_set_cudagraph_sizes``:
1, 2, 4, then steps of 8 and 16 up to 512 by default), and the model
runner's ``CudagraphDispatcher`` turns them into the FULL batch descriptors it
captures, largest first (``get_capture_descs``). On this CPU host vLLM's
platform has no graph mode, so :func:`graph_config` switches the harness's
config to full decode graphs and asks vLLM to derive the sizes exactly as it
does on a GPU; :func:`capture_batches` asks vLLM's dispatcher for the FULL
descriptors. No size is typed here.

:func:`run_sizes` then runs what the runner runs: one builder instance per
KV-cache group, built once and reused for every size; at each size, every
group's ``build_for_cudagraph_capture`` in turn on the one shared metadata
(views of persistent runner buffers), the MiniMax-M3 indexer last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from vllm_capture_guard.tools.harness.capture import CaptureRun, capture
from vllm_capture_guard.tools.harness.model import (  # noqa: F401 (sizes' API)
    SERVE_MAX_NUM_SEQS,
    graph_config,
)
from vllm_capture_guard.tools.harness.runner import Batch, RunnerBuffers


def capture_batches(config: Any) -> list[Batch]:
    """The FULL graphs the model runner captures for ``config``, in its order
    (largest first), from vLLM's ``CudagraphDispatcher``."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    query_len = 1 + config.num_speculative_tokens
    dispatcher = CudagraphDispatcher(config)
    mode = config.compilation_config.cudagraph_mode
    dispatcher.initialize_cudagraph_keys(mode, query_len)
    batches = []
    for runtime_mode, descs in dispatcher.get_capture_descs():
        if runtime_mode != CUDAGraphMode.FULL:
            continue
        for d in descs:
            if getattr(d, "num_active_loras", 0) or getattr(d, "has_lora", False):
                continue
            reqs = d.num_reqs or d.num_tokens // query_len
            if d.uniform:
                batches.append(Batch(reqs, query_len=query_len))
            else:  # a mixed FULL graph: one request per token
                batches.append(Batch(reqs))
    return batches


@dataclasses.dataclass
class SizesRun:
    """Every capture size, in the runner's order, on one set of builders."""

    batches: list[Batch]
    runs: list[CaptureRun]


def run_sizes(
    builders: Sequence[tuple[str, Any]],
    batches: Sequence[Batch],
    device: str = "cpu",
    on_run: Callable[[Batch, CaptureRun], None] | None = None,
) -> SizesRun:
    """``builders`` (one per group, built once) captured at every size of
    ``batches`` in turn, on one set of persistent runner buffers, as the
    runner does. Goes on after a size that fails (``check`` counts them)."""
    max_reqs = max(b.total_reqs for b in batches)
    max_tokens = max(b.num_tokens for b in batches)
    buffers = RunnerBuffers(max_reqs=max_reqs, device=device)
    if buffers.slot_mapping.numel() < max_tokens:
        buffers = RunnerBuffers(
            max_reqs=max(max_reqs, -(-max_tokens // 8)), device=device
        )
    runs = []
    for batch in batches:
        run = capture(builders, batch, buffers=buffers, device=device)
        runs.append(run)
        if on_run is not None:
            on_run(batch, run)
    return SizesRun(list(batches), runs)
