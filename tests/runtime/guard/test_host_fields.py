# SPDX-License-Identifier: Apache-2.0
"""The runtime's rule of what a host field is (:func:`is_host_field`), which
the guard saves by and the fixes' readers refuse by: by name, and on every
field this release's ``CommonAttentionMetadata`` declares."""

from __future__ import annotations

import pytest

from vllm_capture_guard.runtime.guard.metadata import is_host_field


@pytest.mark.parametrize(
    "name, host",
    [
        ("query_start_loc_cpu", True),
        ("seq_lens_cpu_upper_bound", True),
        ("_num_computed_tokens_cpu", True),
        ("is_prefilling", True),
        ("encoder_seq_lens_cpu", True),
        ("query_start_loc", False),
        ("seq_lens", False),
        ("block_table_tensor", False),
    ],
)
def test_host_fields_by_name(name, host):
    assert is_host_field(name) is host


def test_every_field_vllm_declares_is_sorted_by_the_rule():
    """No field of this release's CommonAttentionMetadata escapes the rule:
    every field the runner fills from a CPU buffer is called host."""
    import dataclasses

    from vllm.v1.attention.backend import CommonAttentionMetadata

    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    host = {n for n in names if is_host_field(n)}
    assert {"query_start_loc_cpu", "is_prefilling"} <= host
    assert "query_start_loc" in names - host and "seq_lens" in names - host
