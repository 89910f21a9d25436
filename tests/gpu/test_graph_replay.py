# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph capture and replay of vLLM's Triton attention kernels, fed by
the guarded ROCm builders, on a real GPU.

The capture runs the way the model runner runs it: persistent buffers on the
device, one ``CommonAttentionMetadata`` of views of them, a shallow copy per
KV-cache group, the ROCm builder's ``build_for_cudagraph_capture`` and then the
MiniMax-M3 indexer's. A ``torch.cuda.CUDAGraph`` of one of vLLM's kernels is
captured on the ROCm builder's capture metadata (``ROCM_ATTN`` zeroes the
device offsets for it, vLLM #25985; both set ``seq_lens`` to 1). Then, for
several real batches, the shared buffers are refilled in place and the graph
is replayed, as the runner does for every decode step.

Asserted, per kernel x builder x dtype:

* replay equals an eager call on the same metadata, bit for bit;
* replay is within the stated tolerance of a float32 PyTorch attention over
  the same paged KV cache;
* a negative control, replayed with new inputs but without refilling the
  buffers, is not: so the graph reads the shared buffers;
* the path ``unified_attention`` took (2D or 3D) is the one intended.

And, with the guard taken out, capture on an affected vLLM hits the
indexer's ``assert decode_query_len > 0`` on the GPU as well.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import pytest
import torch

from tests.gpu import attention as at
from vllm_capture_guard.tools.revert import revert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="GPU tier: torch.cuda.is_available() is False (no CUDA/ROCm GPU)",
    ),
]

DEVICE = "cuda"  # HIP devices are "cuda" too under ROCm's PyTorch
BACKENDS = (at.ROCM_ATTN, at.ROCM_AITER_UNIFIED_ATTN)
#: Output dtype -> (atol, rtol) against the float32 reference.
TOLERANCE = {
    "bfloat16": (torch.bfloat16, 2e-2, 2e-2),
    "float16": (torch.float16, 4e-3, 4e-3),
}
NUM_REQS = 8  # the captured batch size (requests)
MAX_BLOCKS = 16  # per request: contexts up to MAX_BLOCKS * block size
REPLAYS = 2  # replays per real batch
INDEXER_FILE = "vllm/models/minimax_m3/common/indexer.py"
ASSERTION = "assert decode_query_len > 0"


# --- the guard ---------------------------------------------------------------


def _patches():
    from vllm_capture_guard.runtime.patches import PATCHES

    return PATCHES


@pytest.fixture(scope="module")
def guard(gpu_results):
    """The guard, loaded by vLLM's own plugin loader from its entry point
    (``VLLM_CAPTURE_GUARD=on``: the lent GPU is not ROCm), whatever another
    file of the session imported or undid before. Undone at the end, so that
    nothing leaks into other tests of the same session."""
    old = os.environ.get("VLLM_CAPTURE_GUARD")
    os.environ["VLLM_CAPTURE_GUARD"] = "on"
    from vllm.plugins import load_general_plugins

    from vllm_capture_guard.runtime.patching import Status
    from vllm_capture_guard.runtime.plugin import report, vllm_version

    load_general_plugins()  # the plugin registers once a process
    found = report()
    assert found is not None, "vLLM's plugin loader did not run capture_guard"
    import vllm.v1.attention.backends.rocm_aiter_unified_attn  # noqa: F401
    import vllm.v1.attention.backends.rocm_attn  # noqa: F401 (hooks run now)

    # Applied again: an earlier file may have reverted a patch after its hooks ran.
    assert found.mode == "on", f"the first plugin load was not on: {found.message}"
    applied = {patch.name: patch.apply() for patch in _patches()}
    took = (Status.PATCHED, Status.ALREADY, Status.NOT_NEEDED, Status.INCOMPLETE)
    took += (Status.UNAVAILABLE,)  # a patch whose module vLLM has not imported yet
    assert all(o.status in took for o in applied.values()), applied
    assert applied["builder-capture-guard"].status in (Status.PATCHED, Status.ALREADY)
    from vllm.platforms import current_platform

    props = torch.cuda.get_device_properties(0)
    gpu_results["env"] = {
        "gpu": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": _version("triton"),
        "vllm": vllm_version(),
        "platform": type(current_platform).__name__,
    }
    gpu_results["guard"] = "; ".join(str(o) for o in applied.values())
    yield found
    for patch in reversed(_patches()):
        with contextlib.suppress(Exception):
            revert(patch)
    if old is None:
        os.environ.pop("VLLM_CAPTURE_GUARD", None)
    else:
        os.environ["VLLM_CAPTURE_GUARD"] = old


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@contextlib.contextmanager
def guard_removed():
    """vLLM's own capture for the duration; the guard put back afterwards."""
    patches = _patches()
    for patch in reversed(patches):
        revert(patch)
    try:
        yield
    finally:
        for patch in patches:
            patch.apply()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unguarded_capture_hits_indexer_assertion(backend, guard, gpu_results):
    from vllm_capture_guard.runtime.patching import Status
    from vllm_capture_guard.tools import harness as sc

    took = (Status.PATCHED, Status.ALREADY)
    if not any(o.status in took for o in guard.outcomes.values()):
        pytest.skip(f"the guard found nothing to patch here: {guard.message}")
    with guard_removed():
        # vLLM's own capture is back: a removal that silently failed must
        # fail here, not skip or pass
        from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

        capture = vars(RocmAttentionMetadataBuilder)["build_for_cudagraph_capture"]
        assert not hasattr(capture, "__vllm_capture_guard_original__")
        run = sc.run_capture(backend, sc.Batch(4), device=DEVICE)
    failed = run.failed
    gpu_results["unguarded"].append(
        {
            "backend": backend,
            "failed_group": failed and failed.group,
            "error": failed and failed.error,
            "site": failed and failed.error_site,
            "line": failed and failed.error_line,
        }
    )
    assert failed is not None and failed.group == "indexer"
    assert failed.error.startswith("AssertionError")
    assert failed.error_site.startswith(INDEXER_FILE + ":")
    assert failed.error_line == ASSERTION
    assert run.values("query_start_loc_cpu") == [0] * 5


# --- capture and replay --------------------------------------------------------


def _steps(query_len: int, block_size: int, num_blocks: int, seed: int):
    """Three real batches of NUM_REQS requests: short contexts, long ones up
    to the maximum, and a padded batch whose contexts cross block edges."""
    g = torch.Generator().manual_seed(seed)
    top = MAX_BLOCKS * block_size

    def lens(lo: int, hi: int, n: int) -> list[int]:
        return torch.randint(lo, hi + 1, (n,), generator=g).tolist()

    mixes = [
        lens(query_len, 200, NUM_REQS),
        [top] + lens(top // 2, top, NUM_REQS - 1),
        [query_len, block_size, block_size + 1, 3 * block_size - 1]
        + lens(query_len, top, NUM_REQS - 7),
    ]
    return [
        at.make_step(query_len, m, NUM_REQS, block_size, num_blocks, g) for m in mixes
    ]


def _load(call: at.KernelCall, step: at.Step, g: torch.Generator) -> None:
    """New activations and KV contents for ``step``, written in place into the
    static tensors the graph reads (not the metadata buffers)."""
    kv = call.kv
    dtype = call.q.dtype

    def randn(shape):
        return torch.randn(shape, generator=g).to(dtype).to(DEVICE)

    # a query scale of 2 makes the softmax peaky, so outputs are O(1)
    call.q.copy_(randn(call.q.shape) * 2)
    kv.write(randn(kv.k.shape), randn(kv.v.shape))
    k_new, v_new = at.new_tokens(kv, step, call.q.shape[0])
    call.k_new.copy_(k_new)
    call.v_new.copy_(v_new)


def _errors(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float):
    """(max abs error, within tolerance?, NaN elements) over the real tokens'
    rows. A NaN in the output counts as an infinite error."""
    diff = (out.float() - ref).abs()
    nans = int(diff.isnan().sum())
    ok = nans == 0 and bool((diff <= atol + rtol * ref.abs()).all())
    return float(diff.nan_to_num(nan=math.inf).max()), ok, nans


def _capture(call: at.KernelCall, out: torch.Tensor) -> torch.cuda.CUDAGraph:
    """Warm up (Triton compiles here) on a side stream, then capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call(out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    torch.cuda.synchronize()
    return graph


CASES = [
    (kernel, backend, dtype)
    for kernel in at.KERNELS
    for backend in BACKENDS
    for dtype in TOLERANCE
]


@pytest.mark.parametrize(("kernel", "backend", "dtype_name"), CASES)
def test_graph_replay(kernel, backend, dtype_name, guard, gpu_results):
    from vllm_capture_guard.tools import harness as sc

    started = time.time()
    spec = at.KERNELS[kernel]
    op, query_len = spec["op"], spec["query_len"]
    dtype, atol, rtol = TOLERANCE[dtype_name]
    seed = CASES.index((kernel, backend, dtype_name))
    torch.manual_seed(seed)

    # -- capture, as the runner does: shared buffers, both groups in order --
    config = sc.make_vllm_config(query_len - 1, device=DEVICE)
    attn = sc.attention_builder(backend, config, DEVICE)
    builders = [("attention", attn), ("indexer", sc.indexer_builder(config, DEVICE))]
    buffers = sc.RunnerBuffers(max_reqs=NUM_REQS, max_blocks=MAX_BLOCKS, device=DEVICE)
    block_size = sc.BLOCK_SIZE
    batch = sc.Batch(NUM_REQS, query_len=query_len, seq_len=MAX_BLOCKS * block_size)
    run = sc.capture(builders, batch, buffers=buffers)
    assert run.failed is None, run.failed and run.failed.error
    captured = run.values("query_start_loc"), run.values("query_start_loc_cpu")
    assert sc.decode_query_len(run) == query_len
    assert run.values("query_start_loc_cpu") == batch.offsets()  # the guard's point
    md = run.groups[0].returned
    # ROCM_ATTN zeroes the device offsets for capture (#25985); the AITER
    # unified builder keeps them. Both capture with seq_lens of 1.
    zeroed = [0] * (NUM_REQS + 1)
    expected = zeroed if backend == at.ROCM_ATTN else batch.offsets()
    assert run.values("query_start_loc") == expected
    assert md.seq_lens.tolist() == [1] * NUM_REQS
    for name in ("query_start_loc", "seq_lens", "block_table"):
        # the builder's metadata reads the runner's buffers, not copies
        assert getattr(md, name).data_ptr() == getattr(buffers, name).data_ptr()

    heads, kv_heads, head = attn.num_heads_q, attn.num_heads_kv, attn.headdim
    tokens = batch.num_tokens
    num_blocks = 1 + NUM_REQS * MAX_BLOCKS + 8
    kv = at.PagedKV.allocate(op, num_blocks, block_size, kv_heads, head, dtype, DEVICE)
    zeros = dict(dtype=dtype, device=DEVICE)
    segments = (
        at.segment_buffers(tokens, heads, head, DEVICE) if op == "unified" else None
    )
    call = at.KernelCall(
        op=op,
        metadata=md,
        q=torch.zeros((tokens, heads, head), **zeros),
        k_new=torch.zeros((tokens, kv_heads, head), **zeros),
        v_new=torch.zeros((tokens, kv_heads, head), **zeros),
        kv=kv,
        scale=head**-0.5,
        segments=segments,
    )
    out_graph = torch.zeros_like(call.q)
    out_eager = torch.zeros_like(call.q)
    graph = _capture(call, out_graph)

    steps = _steps(query_len, block_size, num_blocks, seed)
    g = torch.Generator().manual_seed(1000 + seed)

    # -- negative control: new inputs, buffers left as capture left them --
    _load(call, steps[0], g)
    out_graph.zero_()
    graph.replay()
    torch.cuda.synchronize()
    real = steps[0].num_real_tokens
    ref = at.reference(call.q, kv.k, kv.v, steps[0], call.scale)
    control_err, control_ok, control_nans = _errors(
        out_graph[:real], ref[:real], atol, rtol
    )

    # -- real steps: refill in place, eager, replay, reference --
    records = []
    for step in steps:
        _load(call, step, g)
        at.refill(buffers, step)
        real = step.num_real_tokens
        if segments:
            segments["softmax_segm_max"].fill_(float("nan"))
        out_eager.zero_()
        call(out_eager)
        torch.cuda.synchronize()
        path = spec["path"]
        if segments:
            wrote = bool(torch.isfinite(segments["softmax_segm_max"]).any())
            path = "3d" if wrote else "2d"
        ref = at.reference(call.q, kv.k, kv.v, step, call.scale)
        equal = True
        for _ in range(REPLAYS):
            out_graph.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            equal &= torch.equal(out_graph[:real], out_eager[:real])
        err, ok, _ = _errors(out_graph[:real], ref[:real], atol, rtol)
        records.append(
            {
                "step": step.label(),
                "seq_lens": list(step.seq_lens),
                "query_lens": list(step.query_lens),
                "path": path,
                "replays": REPLAYS,
                "graph_equals_eager": equal,
                "max_abs_err": err,
                "within_tolerance": ok,
            }
        )

    case = {
        "kernel": kernel,
        "backend": backend,
        "builder": type(attn).__name__,
        "dtype": dtype_name,
        "atol": atol,
        "rtol": rtol,
        "query_len": query_len,
        "num_reqs": NUM_REQS,
        # as the capture left them, before the buffers were refilled
        "capture_query_start_loc": captured[0],
        "capture_query_start_loc_cpu": captured[1],
        "steps": records,
        "replays": REPLAYS * len(records) + 1,
        "max_abs_err": max(r["max_abs_err"] for r in records),
        "control_err": control_err,
        "control_within_tolerance": control_ok,
        "control_nan_elements": control_nans,
        "seconds": round(time.time() - started, 2),
    }
    gpu_results["cases"].append(case)

    for r in records:
        assert r["path"] == spec["path"], r
        assert r["graph_equals_eager"], r
        assert r["within_tolerance"], r
    assert not control_ok, f"control replay matched the reference: {control_err}"
