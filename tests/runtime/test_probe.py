# SPDX-License-Identifier: Apache-2.0
"""The probe, on vLLM's real ROCm builder and on classes derived from it at
test time: what it sees on the CPU path and on the path whose tensors report
a GPU, when it cannot conclude, and that it never initialises CUDA/HIP."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.conftest import run_snippet
from vllm_capture_guard.runtime.probe import (
    GpuLike,
    bare_builder,
    probe,
    probe_metadata,
)

FIELD = "query_start_loc_cpu"


@pytest.fixture(autouse=True)
def forget_derived_classes():
    """The classes a test derives leave ``__subclasses__()`` with it."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def rocm():
    from vllm.v1.attention.backends import rocm_attn

    return rocm_attn


@pytest.fixture(scope="module")
def vllm_capture(rocm):
    """vLLM's own capture function (this process never loads the guard)."""
    from vllm_capture_guard.runtime.patches import is_guarded

    fn = rocm.RocmAttentionMetadataBuilder.build_for_cudagraph_capture
    assert not is_guarded(fn)
    return fn


def derived(rocm, name: str, capture) -> type:
    return type(
        name,
        (rocm.RocmAttentionMetadataBuilder,),
        {"build_for_cudagraph_capture": capture},
    )


def test_gpu_like_reports_cuda_and_keeps_values_on_the_cpu():
    t = GpuLike(torch.arange(5, dtype=torch.int32))
    assert t.device.type == "cuda" and t.is_cuda and not t.is_cpu
    t[1:].zero_()
    t[0] = 7
    assert t.inner.tolist() == [7, 0, 0, 0, 0]
    assert isinstance(t + 1, GpuLike)
    assert type(t.cpu()) is torch.Tensor
    assert not torch.cuda.is_initialized()


def test_probe_sees_what_vllms_capture_does(rocm, zeroes_cpu_offsets):
    finding = probe(rocm.RocmAttentionMetadataBuilder)
    assert finding.complete, finding.reason
    assert (FIELD in finding.written) is zeroes_cpu_offsets
    assert "query_start_loc" in finding.written  # the #25985 guard, every release
    assert finding.proves_untouched(FIELD) is not zeroes_cpu_offsets


def test_probe_sees_a_write_made_only_on_the_gpu(
    rocm, vllm_capture, zeroes_cpu_offsets
):
    if not zeroes_cpu_offsets:
        pytest.skip("this vLLM's capture leaves the CPU offsets alone")

    def capture(self, common_attn_metadata):
        if common_attn_metadata.query_start_loc.is_cuda:
            return vllm_capture(self, common_attn_metadata)
        return self.build(0, common_attn_metadata)

    cls = derived(rocm, "GpuOnlyZeroing", capture)
    on_cpu = probe_metadata("cpu")
    before = on_cpu.query_start_loc_cpu.tolist()
    capture(bare_builder(cls, torch.device("cpu")), on_cpu)
    assert on_cpu.query_start_loc_cpu.tolist() == before  # a CPU probe sees nothing
    finding = probe(cls)
    assert finding.complete, finding.reason
    assert FIELD in finding.written
    assert not torch.cuda.is_initialized()


def test_probe_gives_cuda_factories_gpu_like_tensors(rocm, vllm_capture):
    made = []

    def capture(self, common_attn_metadata):
        made.append(torch.zeros(2, dtype=torch.int32, device=self.device))
        made.append(torch.tensor([1, 2], device="cuda"))
        made.append(common_attn_metadata.seq_lens.cpu().to("cuda:0"))
        return vllm_capture(self, common_attn_metadata)

    finding = probe(derived(rocm, "Factories", capture))
    assert finding.complete, finding.reason
    assert all(t.device.type == "cuda" for t in made[-3:])
    assert not torch.cuda.is_initialized()


def test_probe_is_inconclusive_when_capture_needs_init_state(rocm, vllm_capture):
    def capture(self, common_attn_metadata):
        assert self.block_size > 0  # set by __init__ only
        return vllm_capture(self, common_attn_metadata)

    finding = probe(derived(rocm, "NeedsInit", capture))
    assert not finding.complete
    assert "AttributeError" in finding.reason and "block_size" in finding.reason
    assert not finding.proves_untouched(FIELD)


def test_probe_is_inconclusive_on_an_extra_required_argument(rocm, vllm_capture):
    def capture(self, common_attn_metadata, num_tokens):
        return vllm_capture(self, common_attn_metadata)

    finding = probe(derived(rocm, "ExtraArgument", capture))
    assert not finding.complete and "TypeError" in finding.reason


def test_probe_refuses_to_initialise_cuda(rocm, vllm_capture):
    def capture(self, common_attn_metadata):
        torch.cuda.current_device()
        return vllm_capture(self, common_attn_metadata)

    finding = probe(derived(rocm, "TouchesCuda", capture))
    assert not finding.complete and "initialise CUDA/HIP" in finding.reason
    assert not torch.cuda.is_initialized()


#: Booby-traps both ways into CUDA/HIP initialisation before anything else.
TRAPPED = """
import json, sys, traceback
import torch, torch.cuda
calls = []
def trap(name, real):
    def f(*a, **k):
        # who asked: the innermost frame outside torch
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename]
        calls.append([name, frames[-1].filename, frames[-1].lineno])
        raise RuntimeError("trapped " + name)
    return f
torch.cuda._lazy_init = trap("torch.cuda._lazy_init", torch.cuda._lazy_init)
torch._C._cuda_init = trap("torch._C._cuda_init", torch._C._cuda_init)
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm_capture_guard.runtime import plugin
after_load = list(calls)
import vllm.v1.attention.backends.rocm_attn
try:
    import vllm.v1.attention.backends.rocm_aiter_unified_attn
except Exception:
    pass  # some releases ask the GPU at import: vLLM's own call, not ours
from vllm_capture_guard.tools.check import run_seed
result = run_seed()
ours = [c for c in calls if "vllm_capture_guard" in c[1]]
print(json.dumps({"after_load": after_load, "ours": ours, "ok": result.ok,
                  "action": plugin.report().action}))
"""


def test_no_cuda_initialisation_at_load_or_in_the_hook():
    out, logs = run_snippet(TRAPPED, VLLM_CAPTURE_GUARD="on")
    assert out["after_load"] == []
    assert out["ours"] == []
    assert out["action"] in ("patched", "not needed"), logs[-2000:]
    assert out["ok"]


@pytest.mark.parametrize(
    "condition",
    [
        "cm.query_start_loc.get_device() >= 0",  # only on a GPU
        "cm.query_start_loc_cpu.is_pinned()",  # the runner's host buffers
        "cm.max_query_len > 1",  # speculative decoding
        "cm.num_reqs >= 8",  # larger captured sizes
    ],
)
def test_probe_sees_writes_behind_conditions(
    rocm, vllm_capture, zeroes_cpu_offsets, condition
):
    """A vendor capture that zeroes only under some condition is still seen:
    the GPU path reports a device index and pinned host buffers, and the
    probe runs several batch shapes."""
    if not zeroes_cpu_offsets:
        pytest.skip("this vLLM's capture leaves the CPU offsets alone")
    test = eval(f"lambda cm: {condition}")  # noqa: S307 (our own literal)

    def capture(self, common_attn_metadata):
        if test(common_attn_metadata):
            return vllm_capture(self, common_attn_metadata)
        return self.build(0, common_attn_metadata)

    finding = probe(derived(rocm, "Conditional", capture))
    assert finding.complete, finding.reason
    assert FIELD in finding.written, condition


def test_probe_passes_through_when_the_gpu_is_already_up(
    rocm, vllm_capture, monkeypatch
):
    """In a worker the GPU is initialised before vLLM imports the backends;
    a capture that touches the current stream must not make the probe fail."""
    import torch.cuda as tc

    calls = []
    monkeypatch.setattr(tc, "is_initialized", lambda: True)
    monkeypatch.setattr(tc, "_lazy_init", lambda: calls.append(1))

    def capture(self, common_attn_metadata):
        tc._lazy_init()
        return vllm_capture(self, common_attn_metadata)

    finding = probe(derived(rocm, "StreamAware", capture))
    assert finding.complete, finding.reason
    assert calls
