# SPDX-License-Identifier: Apache-2.0
"""An idle data-parallel rank's engine steps, for the GPU tier's serving
benchmark (``tests/gpu/test_serving_loop.py`` runs this module once per vLLM
tree, each in its own interpreter).

A rank with no requests, while another has some, calls
``execute_dummy_batch`` at every engine step: a FULL decode dummy run of size
1, which builds the attention metadata with every KV-cache group's
``build_for_cudagraph_capture``, behind the previous step's forward pass still
running. Each step here does what that costs the CPU and the GPU:

1. the runner's refill of the offsets and sequence lengths, host to device,
   ``non_blocking`` on the current stream (queued before the metadata, as
   ``_prepare_inputs`` queues it);
2. every group's capture on shallow copies of one shared metadata over the
   runner-like buffers: the ROCm builder's, then MiniMax-M3's indexer's (the
   real vLLM builders, as ``tools.harness`` builds them);
3. a CPU tail standing in for vLLM's own launch work after the metadata;
4. a forward pass of ``--forward-ms`` on the GPU (a busy kernel).

The CPU may run at most one step ahead: before a step it waits for the
forward of the step before the last. The figure is the mean wall time per
step, after a warm-up.

    python -m tests.gpu.serving_loop --guard on --out loop.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from typing import Any

import torch

BACKENDS = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
DEVICE = "cuda"


def _cycles_for(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that run for about ``ms`` milliseconds."""
    probe = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    torch.cuda._sleep(probe)  # clocks up
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Loop:
    """Steps of an idle rank (:meth:`step`, a subclass's), timed."""

    def context(self) -> contextlib.AbstractContextManager:
        """What the steps run under."""
        return contextlib.nullcontext()

    def step(self, tail: float) -> None:
        raise NotImplementedError

    def run(self, tail: float, steps: int, warmup: int) -> dict:
        with self.context():
            for _ in range(warmup):
                self.step(tail)
            starts = []
            for _ in range(steps):
                starts.append(time.perf_counter())
                self.step(tail)
            torch.cuda.synchronize()
        gaps = sorted(b - a for a, b in zip(starts, starts[1:], strict=False))
        mean = (starts[-1] - starts[0]) / (steps - 1)
        return {"mean_ms": mean * 1e3, "median_ms": gaps[len(gaps) // 2] * 1e3}


class Rank(Loop):
    """One idle rank's buffers and builders, for one backend."""

    def __init__(self, backend: str, config: Any, cycles: int) -> None:
        from vllm_capture_guard.tools import harness as sc

        self.builders = [
            sc.attention_builder(backend, config, DEVICE),
            sc.indexer_builder(config, DEVICE),
        ]
        self.batch = sc.Batch(1)
        self.buffers = sc.RunnerBuffers(max_reqs=8, device=DEVICE)
        assert self.buffers.query_start_loc_cpu.is_pinned()
        self.buffers.fill(self.batch)
        torch.cuda.synchronize()
        self.cycles, self.done = cycles, []

    def step(self, tail: float) -> None:
        from vllm.config import set_current_vllm_config

        if len(self.done) >= 2:  # at most one step ahead of the GPU
            self.done.pop(0).synchronize()
        b, n = self.buffers, self.batch.total_reqs
        b.query_start_loc[: n + 1].copy_(
            b.query_start_loc_cpu[: n + 1], non_blocking=True
        )
        b.seq_lens[:n].copy_(b.seq_lens_cpu[:n], non_blocking=True)
        shared = b.common_metadata(self.batch)
        for builder in self.builders:
            with set_current_vllm_config(builder.vllm_config):
                builder.build_for_cudagraph_capture(copy.copy(shared))
        _spin(tail)
        torch.cuda._sleep(self.cycles)  # the forward pass
        event = torch.cuda.Event()
        event.record()
        self.done.append(event)


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every serving-loop module takes."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--guard", choices=("on", "off"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tails", default="0,0.5,2", help="CPU tails, ms")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--forward-ms", type=float, default=10.0)
    ap.add_argument("--tree", required=True, help="what the vLLM under test is")
    ap.add_argument("--expect", help="the folder vLLM must be imported from")
    return ap


def loaded(args: argparse.Namespace) -> contextlib.ExitStack:
    """vLLM imported from where ``--expect`` says, and the guard loaded where
    ``--guard on``; the stack holds it until it is closed."""
    import vllm

    where = os.path.dirname(vllm.__file__)
    if args.expect and os.path.realpath(where) != os.path.realpath(args.expect):
        raise SystemExit(f"vLLM imported from {where}, not {args.expect}")
    stack = contextlib.ExitStack()  # held until the process ends
    if args.guard == "on":
        from tests.gpu.async_copies import guard_loaded

        stack.enter_context(guard_loaded())
    return stack


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    held = loaded(args)

    from vllm_capture_guard.runtime.patching import is_guarded
    from vllm_capture_guard.tools import harness as sc

    on = args.guard == "on"
    try:
        config = sc.make_vllm_config(0, device=DEVICE, graphs=True)
    except Exception as e:  # vLLM's inspection hides why: import the model
        import importlib

        importlib.import_module("vllm.models.minimax_m3")
        raise RuntimeError(f"no config, but the model imports: {e}") from e
    cycles = _cycles_for(args.forward_ms)
    from importlib.metadata import version

    out: dict = {
        "vllm": version("vllm"),
        "vllm_tree": args.tree,  # checked below; no machine path in the results
        "guard": args.guard,
        "forward_ms": args.forward_ms,
        "steps": args.steps,
        "runs": {},
    }
    for backend in BACKENDS:
        rank = Rank(backend, config, cycles)
        made = type(rank.builders[0])
        guarded = is_guarded(vars(made).get("build_for_cudagraph_capture"))
        assert guarded == on, (backend, made, "guarded" if guarded else "not guarded")
        runs = out["runs"].setdefault(backend, {"builder": made.__name__})
        measure(rank, runs, args)
    return finish(out, args, held)


def measure(rank: Loop, runs: dict, args: argparse.Namespace) -> None:
    """``rank``'s mean step at each tail, then the guard's phases over a few
    more steps, into ``runs``."""
    from vllm_capture_guard.lab.cost import account

    for tail in (float(t) for t in args.tails.split(",")):
        runs[f"{tail:g}"] = rank.run(tail / 1e3, args.steps, args.warmup)
    with account() as spent:  # the guard's phases over a few more steps
        rank.run(0.0, 10, 0)
    runs["guard_phases_ms"] = {k: v * 1e3 for k, v in spent.items() if k != "calls"}
    runs["guard_calls"] = spent["calls"]


def finish(out: dict, args: argparse.Namespace, held: contextlib.ExitStack) -> int:
    """The results written to ``--out`` and printed; the guard let go."""
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    held.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
