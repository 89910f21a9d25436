# SPDX-License-Identifier: Apache-2.0
"""The contract on a real CommonAttentionMetadata: in-place writes are seen,
rebinding a field on a shallow copy is not, the
one CPU/device rule holds for every field vLLM declares, and the encoder and
differ find what differs."""

from __future__ import annotations

import ast
import importlib.metadata
from copy import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_capture_guard.lab.oracle.releases import env_dir
from vllm_capture_guard.tools.contract import (
    CPU,
    DEVICE,
    Change,
    cpu_writes,
    diff,
    encode,
    field_side,
    snapshot,
)

RELEASES = ("0.27.1", "0.28.0", "0.29.0", "0.33.0")

#: Every field the supported releases declare on CommonAttentionMetadata, and
#: where vLLM's runner keeps it (from each field's docstring and the runner's
#: code). A field not listed here fails the test: decide its side first.
SIDES = {
    "query_start_loc": DEVICE,
    "query_start_loc_cpu": CPU,
    "seq_lens": DEVICE,
    "num_reqs": DEVICE,  # ints: never a tensor, never written in place
    "num_actual_tokens": DEVICE,
    "max_query_len": DEVICE,
    "max_seq_len": DEVICE,
    "block_table_tensor": DEVICE,
    "slot_mapping": DEVICE,
    "causal": DEVICE,
    "logits_indices_padded": DEVICE,
    "num_logits_indices": DEVICE,
    "max_logits_per_req": DEVICE,
    "encoder_seq_lens": DEVICE,
    "encoder_seq_lens_cpu": CPU,
    "dcp_local_seq_lens": DEVICE,
    "dcp_local_seq_lens_cpu": CPU,
    "dcp_local_seq_lens_cpu_upper_bound": CPU,
    "positions": DEVICE,
    "is_prefilling": CPU,  # computed from num_computed_tokens_cpu
    "seq_lens_cpu_upper_bound": CPU,
    "req_idx": CPU,  # a numpy array
    "mm_req_doc_ranges": DEVICE,  # a dict of Python ints: no tensor
    "rswa_prefix_lens": CPU,  # num_prompt_tokens_cpu in the runner
    "replayssm_decode_base_cpu": CPU,
    "_seq_lens_cpu": CPU,
    "_num_computed_tokens_cpu": CPU,
    "_num_computed_tokens_cache": DEVICE,  # seq_lens - query_lens
    "_token_to_req_indices_cache": DEVICE,
}


def _backend_source(release: str) -> Path | None:
    """vLLM ``release``'s ``v1/attention/backend.py``: from an installed
    distribution on ``sys.path`` (the venv's own, or one put first), else
    from ``.envs/vllm-<release>``."""
    relative = Path("vllm") / "v1" / "attention" / "backend.py"
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"] == "vllm" and dist.version == release:
            path = Path(dist.locate_file(relative))
            if path.is_file():
                return path
    folder = env_dir(release)
    return None if folder is None else folder / relative


def _declared_fields(release: str) -> list[str] | None:
    """The field names a release's CommonAttentionMetadata declares, read
    from its source (no import: each release lives in its own folder)."""
    source = _backend_source(release)
    if source is None:
        return None
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "CommonAttentionMetadata":
            return [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    raise AssertionError(f"no CommonAttentionMetadata in {source}")


@pytest.mark.parametrize("release", RELEASES)
def test_field_side_for_every_field_a_release_declares(release):
    fields = _declared_fields(release)
    if fields is None:
        pytest.skip(f"vLLM {release} is not here (make envs)")
    assert len(fields) > 20
    unknown = [f for f in fields if f not in SIDES]
    assert not unknown, f"decide the side of {unknown} (vLLM {release})"
    wrong = {f: field_side(f) for f in fields if field_side(f) != SIDES[f]}
    assert not wrong, wrong


def test_field_side_reads_the_last_part_of_a_path():
    assert field_side("metadata.decode.seq_lens_cpu") == CPU
    assert field_side("builder.context_len_buffer") == DEVICE
    assert field_side("metadata.prefill.cpu_slot_mapping") == CPU


def _metadata():
    """A real CommonAttentionMetadata over runner buffers (two requests)."""
    from vllm_capture_guard.tools import harness

    return harness.shared_metadata(harness.Batch(2))


def test_in_place_writes_are_found_with_old_and_new_values():
    cm = _metadata()
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
    cm = _metadata()
    before = snapshot(cm)
    private = copy(cm)
    private.query_start_loc_cpu = torch.zeros(3, dtype=torch.int32)
    assert before.writes() == []


def test_encode_and_diff_a_real_metadata():
    a, b = _metadata(), _metadata()
    assert diff(encode(a), encode(b)) == []
    b.query_start_loc_cpu[1] = 7
    b.max_seq_len += 1
    found = {d.path: d for d in diff(encode(a), encode(b))}
    assert set(found) == {"query_start_loc_cpu", "max_seq_len"}
    assert found["query_start_loc_cpu"].change is Change.VALUES
    assert found["query_start_loc_cpu"].side == CPU
    assert (found["query_start_loc_cpu"].a, found["query_start_loc_cpu"].b) == (
        "[0, 1, 2]",
        "[0, 7, 2]",
    )
    assert found["max_seq_len"].change is Change.SCALAR


def test_diff_nan_is_equal_shape_is_layout_arrays_are_host():
    t = torch.full((3,), float("nan"))
    assert diff(encode(t), encode(t.clone())) == []
    grown = diff(encode(t), encode(torch.zeros(4)))
    assert [d.change for d in grown] == [Change.LAYOUT]
    named = encode({"lens_np": np.arange(3), "lens": torch.arange(3)})
    other = encode({"lens_np": np.arange(3) + 1, "lens": torch.arange(3) + 1})
    assert {d.path: d.side for d in diff(named, other)} == {
        "lens_np": CPU,
        "lens": DEVICE,
    }
    one_sided = diff(encode({"x": 1}), encode({"x": 1, "y": 2}))
    assert [(d.path, d.change) for d in one_sided] == [("y", Change.MISSING)]
