# SPDX-License-Identifier: Apache-2.0
"""The model runner's side of capture, simulated: batches as data and the
persistent buffers every ``CommonAttentionMetadata`` is a set of views of.

Batches are data (:class:`Batch`), after vLLM's own ``BatchSpec`` test helper.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_capture_guard.tools.harness.models import BLOCK_SIZE

PAD_SLOT_ID = -1  # what the runner writes into padded tokens' slots


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
    def speculative_tokens(self) -> int:
        """Draft tokens per request that the config must allow."""
        return max(self.query_len - 1, 0)

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


class RunnerBuffers:
    """Persistent input buffers, like ``GPUModelRunner``'s (``CpuGpuBuffer``
    pairs for the offsets, device-only tensors for the rest)."""

    def __init__(self, max_reqs: int = 64, max_blocks: int = 8, device="cpu"):
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32)
        dev = dict(device=self.device)
        # host buffers pinned where there is a real GPU, as the runner's are
        # (a device that only reports "cuda" has no driver to pin with)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        host = dict(dtype=torch.int32, pin_memory=pin)
        self.query_start_loc = torch.zeros(max_reqs + 1, **dev, **i32)
        self.query_start_loc_cpu = torch.zeros(max_reqs + 1, **host)
        self.seq_lens = torch.zeros(max_reqs, **dev, **i32)
        self.seq_lens_cpu = torch.zeros(max_reqs, **host)
        self.num_computed_tokens_cpu = torch.zeros(max_reqs, **host)
        self.block_table = torch.zeros((max_reqs, max_blocks), **dev, **i32)
        self.slot_mapping = torch.zeros(max_reqs * 8, **dev, dtype=torch.int64)
        self.positions = torch.zeros(max_reqs * 8, **dev, dtype=torch.int64)
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


def shared_metadata(batch: Batch, device: Any = "cpu") -> Any:
    """Fresh runner buffers holding ``batch``, as one shared metadata."""
    buffers = RunnerBuffers(device=device)
    buffers.fill(batch)
    return buffers.common_metadata(batch)
