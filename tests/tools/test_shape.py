# SPDX-License-Identifier: Apache-2.0
"""Reading a capture, never running it: vLLM's own captures, and every shape
that must count as "in doubt" (our own small functions, since what is tested
here is our reader)."""

from __future__ import annotations

import functools
import textwrap

import pytest
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_capture_guard.runtime.patching import original_of
from vllm_capture_guard.tools.shape import fixed_shape, is_host_field

METHOD = "build_for_cudagraph_capture"


def test_vllms_rocm_capture_is_fixed_exactly_where_it_keeps_the_host_offsets(
    unpatched, zeroes_cpu_offsets
):
    """Decided against vLLM's own capture run unguarded (the fixture)."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    why = fixed_shape(original_of(RocmAttentionMetadataBuilder.__dict__[METHOD]))
    if zeroes_cpu_offsets:
        assert why == "it touches query_start_loc_cpu"
    else:
        assert why is None


def upstream_shape(self, common_attn_metadata: CommonAttentionMetadata):
    attn_metadata = self.build(0, common_attn_metadata)
    attn_metadata.seq_lens.fill_(1)
    common_attn_metadata.query_start_loc.zero_()
    return attn_metadata


def helper(self, cm):
    return upstream_shape(self, cm)


def conditional_host_write(self, cm):
    attn_metadata = self.build(0, cm)
    if cm.num_reqs > 256:
        attn_metadata.extra.query_start_loc_cpu.zero_()
    return attn_metadata


def host_write_elsewhere(self, cm):
    out = self.build(0, cm)
    out.seq_lens_cpu.fill_(1)
    return out


def metadata_method(self, cm):
    cm.compute_num_computed_tokens()
    return self.build(0, cm)


def metadata_rebound(self, cm):
    cm.query_start_loc = cm.query_start_loc.clone()
    return self.build(0, cm)


def metadata_aliased(self, cm):
    other = cm
    return self.build(0, other)


def more_arguments(self, cm, *args):
    return self.build(0, cm)


def nested(self, cm):
    def later():
        return self.build(0, cm)

    return later()


def dynamic(self, cm):
    field = "query_start_loc"
    setattr(cm, field, None)
    return self.build(0, cm)


def through_dunder(self, cm: CommonAttentionMetadata):
    cm.__dict__["query_start_loc_cpu"].zero_()
    return self.build(0, cm)


def other_first_parameter(this, cm: CommonAttentionMetadata):
    return self.build(0, cm)  # noqa: F821  (a global "self")


def self_rebound(self, cm: CommonAttentionMetadata):
    self = object()
    return self.build(0, cm)


def host_container(self, cm: CommonAttentionMetadata):
    cm.mm_req_doc_ranges.clear()
    return self.build(0, cm)


def unannotated_device_write(self, cm):
    cm.query_start_loc.zero_()
    return self.build(0, cm)


def _zeroing_decorator(fn):
    @functools.wraps(fn)
    def wrapper(self, cm):
        cm.query_start_loc_cpu.zero_()
        return fn(self, cm)

    return wrapper


wraps_a_fixed_capture = _zeroing_decorator(upstream_shape)


@functools.lru_cache
def decorated(self, cm):
    return self.build(0, cm)


scope: dict = {}
exec(  # no source file behind it
    textwrap.dedent("""
    def no_source(self, cm):
        return self.build(0, cm)
    """),
    scope,
)


@pytest.mark.parametrize(
    "fn, why",
    [
        (helper, "somewhere other than self.build"),
        (conditional_host_write, "touches query_start_loc_cpu"),
        (host_write_elsewhere, "touches seq_lens_cpu"),
        (metadata_method, "calls metadata.compute_num_computed_tokens"),
        (metadata_rebound, "somewhere other than self.build"),
        (metadata_aliased, "somewhere other than self.build"),
        (more_arguments, "not (self, metadata)"),
        (nested, "nested function"),
        (dynamic, "calls setattr"),
        (decorated, "not a plain function"),
        (functools.partialmethod(upstream_shape), "not a plain function"),
        (scope["no_source"], "cannot be read"),
        (staticmethod(upstream_shape), "not a plain function"),
        (through_dunder, "uses __dict__"),
        (other_first_parameter, "not (self, metadata)"),
        (self_rebound, "rebinds self"),
        (host_container, "somewhere other than self.build"),
        (unannotated_device_write, "somewhere other than self.build"),
        (wraps_a_fixed_capture, "decorated"),
    ],
)
def test_in_doubt(fn, why):
    found = fixed_shape(fn)
    assert found is not None and why in found, found


def test_upstream_shape_is_fixed_and_only_with_device_fields():
    assert fixed_shape(upstream_shape) is None
    offsets = lambda name: name.startswith("query_start_loc")  # noqa: E731
    found = fixed_shape(upstream_shape, device_fields=False, forbidden=offsets)
    assert found == "it touches query_start_loc"


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


def test_a_file_changed_after_import_is_in_doubt(tmp_path, monkeypatch):
    """The source on disk is no longer what runs (an in-tree patch applied
    under a running process): the names do not match, so it is in doubt."""
    import importlib
    import linecache

    running = "def capture(self, cm):\n    cm.query_start_loc_cpu.zero_()\n"
    running += "    return self.build(0, cm)\n"
    (tmp_path / "vendor_changed.py").write_text(running)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = importlib.import_module("vendor_changed").capture
    assert fixed_shape(fn) == "it touches query_start_loc_cpu"
    on_disk = "def capture(self, cm):\n    pass\n"
    (tmp_path / "vendor_changed.py").write_text(
        on_disk + "    return self.build(0, cm)\n"
    )
    linecache.checkcache()
    found = fixed_shape(fn)
    assert found is not None and "does not match" in found, found
