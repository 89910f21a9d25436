# SPDX-License-Identifier: Apache-2.0
"""Ask an installed builder what its capture does, instead of reading versions.

Vendor ROCm images carry versions such as ``0.27.2rc1.dev77+g...rocm723``, so
the plugin never compares version strings. It runs the installed builder's own
``build_for_cudagraph_capture`` once, on a tiny runner-shaped metadata of CPU
tensors, and looks at what changed (:mod:`vllm_capture_guard.runtime.contract`).

The probe needs no ``VllmConfig``: it makes the builder with ``object.__new__``
and sets only what the base ``AttentionMetadataBuilder.__init__`` sets. The ROCm
builders' ``build(0, ...)`` reads nothing else; a vendor builder that does makes
the probe raise, and the plugin then leaves that builder alone with a warning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_capture_guard.runtime.contract import FieldWrite, snapshot

#: The probe batch: two uniform decode requests of one token each.
PROBE_QUERY_LENS = (1, 1)
PROBE_SEQ_LEN = 5


def probe_metadata(
    query_lens: tuple[int, ...] = PROBE_QUERY_LENS, seq_len: int = PROBE_SEQ_LEN
) -> Any:
    """A ``CommonAttentionMetadata`` over fresh CPU tensors, built only from the
    fields that the installed vLLM's dataclass declares."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_reqs = len(query_lens)
    num_tokens = sum(query_lens)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    values = dict(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=seq_len,
        block_table_tensor=torch.zeros((num_reqs, 1), dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
    )
    declared = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in declared})


def bare_builder(builder_cls: type) -> Any:
    """A builder instance with only the base class's attributes set."""
    builder = object.__new__(builder_cls)
    builder.kv_cache_spec = None
    builder.layer_names = []
    builder.vllm_config = None
    builder.device = torch.device("cpu")
    return builder


def capture_writes(builder_cls: type, capture: Any = None) -> list[FieldWrite]:
    """The shared fields that ``builder_cls``'s capture writes in place.

    ``capture`` defaults to the class's ``build_for_cudagraph_capture``; the
    patches pass the original function they would wrap."""
    fn = capture if capture is not None else builder_cls.build_for_cudagraph_capture
    metadata = probe_metadata()
    before = snapshot(metadata)
    fn(bare_builder(builder_cls), metadata)
    return before.writes()
