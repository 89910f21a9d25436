# SPDX-License-Identifier: Apache-2.0
"""The seed scenario: a backend's builder, then MiniMax-M3's indexer, on
shared runner buffers, in the runner's capture order.

The backends come from the patches (each patch's ``backends``): a new backport's
backends are covered by ``check``, the oracle and the version matrix without
editing them.
"""

from __future__ import annotations

from typing import Any

from vllm_capture_guard.tools.harness.capture import CaptureRun, capture
from vllm_capture_guard.tools.harness.model import (
    attention_builder,
    indexer_builder,
    make_vllm_config,
)
from vllm_capture_guard.tools.harness.runner import Batch

#: The seed scenario's groups, in capture order.
GROUPS = ("attention", "indexer")


def seed_backends() -> tuple[str, ...]:
    """Every backend some patch fixes, in the patches' order."""
    from vllm_capture_guard.runtime.patches import PATCHES
    from vllm_capture_guard.tools.fixes import backends

    found: list[str] = []
    for patch in PATCHES:
        found += [b for b in backends(patch) if b not in found]
    return tuple(found)


def seed_builders(backend: str, batch: Batch, device: str = "cpu") -> list[Any]:
    config = make_vllm_config(batch.speculative_tokens, device)
    return [
        ("attention", attention_builder(backend, config, device)),
        ("indexer", indexer_builder(config, device)),
    ]


def run_capture(
    backend: str, batch: Batch, device: str = "cpu", record: bool = False
) -> CaptureRun:
    """The seed scenario for one backend and batch."""
    builders = seed_builders(backend, batch, device)
    return capture(builders, batch, device=device, record=record)


def decode_query_len(run: CaptureRun) -> int | None:
    """What the indexer computed (0 is the seed bug), if it got that far."""
    for g in run.groups:
        decode = getattr(g.returned, "decode", None)
        if decode is not None:
            return decode.decode_query_len
    return None
