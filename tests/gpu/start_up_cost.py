# SPDX-License-Identifier: Apache-2.0
"""The guard's start-up cost as wall time, in one interpreter: the captures
of a start-up, timed with the guard loaded by vLLM's plugin loader
(``--guard on``) or not loaded (``--guard off``), the least of ``--repeat``
start-ups per ROCm backend. The cost is the guarded least minus the
unguarded least, each from its own interpreter; ``compare_start_up.py`` runs
them in turn, against this checkout's runtime and a baseline's.

It reaches the runtime through vLLM's plugin loader and the marker that
every function the guard installs carries, nothing else, so an older
runtime runs under today's tools and tests.

* ``--path v1``: vLLM's FULL capture sizes (51 by default), each ROCm
  builder then MiniMax-M3's indexer on one shared metadata per size, a
  shallow copy per KV-cache group, as the V1 runner captures them;
* ``--path v2``: Model Runner V2's own ``capture_model()``, real graphs.

    python -m tests.gpu.start_up_cost --path v1 --guard on --out f.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from importlib.metadata import version
from typing import Any

import torch

MARKER = "__vllm_capture_guard_original__"  # on each function the guard installs
METHOD = "build_for_cudagraph_capture"
BACKENDS = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
DEVICE = "cuda"


def capture_size(builders: list, buffers: Any, batch: Any, fill: bool = True) -> float:
    """One capture size, as the V1 runner captures it: the seconds spent in
    the builders' captures (the guard's work included)."""
    from vllm.config import set_current_vllm_config

    if fill:  # the harness's refill copies synchronously; the runner's does not
        buffers.fill(batch)
    base = buffers.common_metadata(batch)
    if getattr(base, "seq_lens_cpu_upper_bound", None) is not None:
        # as vLLM's runner hands them: the upper bound is seq_lens_cpu itself
        base.seq_lens_cpu_upper_bound = base._seq_lens_cpu
    spent = 0.0
    for _, builder in builders:
        metadata = copy.copy(base)  # the runner's per-group shallow copy
        with set_current_vllm_config(builder.vllm_config):
            start = time.perf_counter()
            builder.build_for_cudagraph_capture(metadata)
            spent += time.perf_counter() - start
    # the host offsets are what the runner put there, through every capture
    assert base.query_start_loc_cpu.tolist() == batch.offsets(), batch
    return spent


def _guarded(builder: Any) -> bool:
    """Whether the capture vLLM calls on ``builder`` is the guard's."""
    own = vars(builder).get(METHOD) or getattr(type(builder), METHOD)
    return hasattr(getattr(own, "__func__", own), MARKER)


def _v1(backend: str, repeat: int) -> tuple[list[float], bool]:
    from vllm_capture_guard.tools import harness
    from vllm_capture_guard.tools.harness.sizes import capture_batches

    config = harness.make_vllm_config(0, device=DEVICE, graphs=True)
    batches = capture_batches(config)
    builders = [
        ("attention", harness.attention_builder(backend, config, DEVICE)),
        ("indexer", harness.indexer_builder(config, DEVICE)),
    ]
    most = max(b.total_reqs for b in batches)
    buffers = harness.RunnerBuffers(max_reqs=most, device=DEVICE)
    walls = []
    for _ in range(repeat + 1):  # the first is a warm-up (Triton, the allocator)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in batches:
            capture_size(builders, buffers, batch)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    return walls[1:], _guarded(builders[0][1])


def _v2(backend: str, repeat: int) -> tuple[list[float], bool]:
    from vllm_capture_guard.tools.harness import v2

    walls, guarded = [], []
    for _ in range(repeat):  # a config per runner: its layers register
        config = v2.make_config(backend, device=DEVICE)
        runner = v2.make_runner(config, device=DEVICE)
        torch.cuda.synchronize()
        with v2.driving(runner):
            start = time.perf_counter()
            runner.capture_model()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        groups = [g for per_kind in runner.attn_groups for g in per_kind]
        guarded += [_guarded(b) for g in groups for b in g.metadata_builders]
        del runner
        torch.cuda.empty_cache()
    return walls, all(guarded) if guarded else False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=("v1", "v2"), required=True)
    ap.add_argument("--guard", choices=("on", "off"), required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the guard loads here only where it is allowed to
    if args.path == "v2":
        from tests.gpu import mrv2

        mrv2.setup()
    measure = _v1 if args.path == "v1" else _v2
    out: dict = {"vllm": version("vllm"), "path": args.path, "guard": args.guard}
    for backend in BACKENDS:
        walls, guarded = measure(backend, args.repeat)
        if guarded != (args.guard == "on"):
            why = f"{backend}: guarded is {guarded} with --guard {args.guard}"
            raise SystemExit(why)
        out[backend] = {"least_s": min(walls), "walls_s": walls}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
