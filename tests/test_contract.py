# SPDX-License-Identifier: Apache-2.0
"""The contract on a real CommonAttentionMetadata: in-place writes are seen,
rebinding a field on a shallow copy is not, and `preserved` restores values."""

from __future__ import annotations

from copy import copy

import torch

from vllm_capture_guard.runtime.contract import (
    CPU,
    DEVICE,
    cpu_writes,
    field_side,
    preserved,
    shares_memory,
    snapshot,
)
from vllm_capture_guard.runtime.probe import probe_metadata


def test_in_place_writes_are_found_with_old_and_new_values():
    cm = probe_metadata()
    before = snapshot(cm)
    shared = copy(cm)  # what the runner hands a builder
    shared.query_start_loc_cpu.zero_()
    shared.seq_lens.fill_(1)
    writes = {w.field: w for w in before.writes()}
    assert set(writes) == {"query_start_loc_cpu", "seq_lens"}
    assert writes["query_start_loc_cpu"].side == CPU
    assert writes["query_start_loc_cpu"].before == [0, 1, 2]
    assert writes["query_start_loc_cpu"].after == [0, 0, 0]
    assert writes["seq_lens"].side == DEVICE
    assert [w.field for w in cpu_writes(before.writes())] == ["query_start_loc_cpu"]


def test_rebinding_on_a_copy_is_not_a_shared_write():
    cm = probe_metadata()
    before = snapshot(cm)
    private = copy(cm)
    private.query_start_loc_cpu = torch.zeros(3, dtype=torch.int32)
    assert before.writes() == []


def test_preserved_restores_only_named_fields():
    cm = probe_metadata()
    with preserved(cm, "query_start_loc_cpu"):
        cm.query_start_loc_cpu.zero_()
        cm.query_start_loc.zero_()
    assert cm.query_start_loc_cpu.tolist() == [0, 1, 2]
    assert cm.query_start_loc.tolist() == [0, 0, 0]


def test_field_side_is_by_name():
    assert field_side("query_start_loc_cpu") == CPU
    assert field_side("_seq_lens_cpu") == CPU
    assert field_side("query_start_loc") == DEVICE


def test_shares_memory():
    a = torch.arange(4)
    assert shares_memory(a, a[:2])
    assert not shares_memory(a, a.clone())
