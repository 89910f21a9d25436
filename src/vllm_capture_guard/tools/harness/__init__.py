# SPDX-License-Identifier: Apache-2.0
"""The capture harness: vLLM's real builders driven the way the model runner
drives them during full CUDA-graph capture, with no Hub, network or GPU.

Which runner it drives, and how: ``runners`` asks vLLM which model runner it
uses for the config (the one place the harness chooses). The V1 runner is
driven here, in its order: its capture sizes from vLLM's dispatcher
(``sizes``), then for each size one set of shared metadata handed to every
group's builder (``capture``). Model Runner V2 is made by its own code and
runs its own ``capture_model()`` (``v2``).

``models``  tiny model configs, one per attention family (MiniMax-M3,
            DeepSeek-V3, -V3.2, -V4, -V4.1), written at run time;
``model``   a real ``VllmConfig`` for one of them, real builders;
``layers``  MiniMax-M3's attention and indexer cache layers, as vLLM's
            loader makes them;
``runner``  batches as data and the runner's persistent buffers;
``runners`` which model runner vLLM uses (V1 or Model Runner V2);
``sizes``   the V1 runner's capture sizes, from vLLM's dispatcher;
``capture`` the one V1 harness (shared metadata, per-group shallow copies);
``v2``      Model Runner V2, made by its own code (``make``), driven and
            read (``watch``);
``seed``    the seed scenario (a patched backend, then MiniMax-M3's indexer);
``streams`` the capture-stream sites, each ``torch.cuda.graph`` call recorded.
"""

from vllm_capture_guard.tools.harness.capture import (
    CaptureRun,
    GroupCapture,
    capture,
    describe,
    error_site,
    error_text,
)
from vllm_capture_guard.tools.harness.model import (
    ATTN_LAYER,
    BLOCK_SIZE,
    HEAD_SIZE,
    INDEXER_LAYER,
    attention_builder,
    backend_class,
    group_builder,
    indexer_builder,
    make_builder,
    make_vllm_config,
    model_config,
    write_tiny_model,
)
from vllm_capture_guard.tools.harness.models import TINY_MINIMAX_M3, write_model
from vllm_capture_guard.tools.harness.runner import (
    DEFAULT_BATCHES,
    Batch,
    RunnerBuffers,
    shared_metadata,
)
from vllm_capture_guard.tools.harness.seed import (
    decode_query_len,
    run_capture,
    seed_backends,
)

__all__ = [
    "ATTN_LAYER",
    "BLOCK_SIZE",
    "DEFAULT_BATCHES",
    "HEAD_SIZE",
    "INDEXER_LAYER",
    "TINY_MINIMAX_M3",
    "Batch",
    "CaptureRun",
    "GroupCapture",
    "RunnerBuffers",
    "attention_builder",
    "backend_class",
    "capture",
    "decode_query_len",
    "describe",
    "error_site",
    "error_text",
    "group_builder",
    "indexer_builder",
    "make_builder",
    "make_vllm_config",
    "model_config",
    "run_capture",
    "seed_backends",
    "shared_metadata",
    "write_model",
    "write_tiny_model",
]
