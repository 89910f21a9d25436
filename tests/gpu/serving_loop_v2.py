# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2 on the GPU, for the GPU tier (``tests/gpu/mrv2.py`` makes
it; each configuration in its own interpreter):

* ``--what serving``: an idle data-parallel rank's engine steps through
  Model Runner V2's own dummy-batch path. A rank with no requests, while
  another has some, calls vLLM's GPU worker's ``execute_dummy_batch`` at
  every step: the runner's ``_dummy_run``, a uniform decode batch whose FULL
  graph is replayed with its metadata built for capture (every attention
  group's ``build_for_cudagraph_capture``: the ROCm builder's, then
  MiniMax-M3's indexer's). Each step here is that call, a CPU tail standing
  in for the rest of the step's launch work, and a forward pass of
  ``--forward-ms`` on the GPU (a busy kernel), the CPU at most one step
  ahead. The figure is the mean wall time per step, after a warm-up.
* ``--what start-up``: the guard's time by phase (``lab.cost.account``)
  over the runner's own ``capture_model()`` (every FULL size of its
  ``CudaGraphManager``, warm-up and capture; real CUDA graphs), a new runner
  for each of ``--repeat`` start-ups; the least of them, phase by phase, and
  the captures' wall time.

    python -m tests.gpu.serving_loop_v2 --what serving --guard on --out f.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

import torch

from tests.gpu.serving_loop import (
    BACKENDS,
    Loop,
    _cycles_for,
    _spin,
    arguments,
    finish,
    loaded,
    measure,
)


def _runner(backend: str) -> Any:
    """Model Runner V2 for ``backend`` on the GPU, captured."""
    from vllm_capture_guard.tools.harness import v2

    config = v2.make_config(backend, device="cuda")
    runner = v2.make_runner(config, device="cuda")
    with v2.driving(runner):
        runner.capture_model()
    torch.cuda.synchronize()
    return runner


class Rank(Loop):
    """One idle rank: its runner's dummy batch, a tail, a forward in flight."""

    def __init__(self, runner: Any, cycles: int) -> None:
        from vllm_capture_guard.tools.harness import v2

        self.runner, self.cycles, self.done = runner, cycles, []
        self.worker = v2.worker(runner.vllm_config, runner)

    def context(self) -> contextlib.AbstractContextManager:
        from vllm_capture_guard.tools.harness import v2

        return v2.driving(self.runner)

    def step(self, tail: float) -> None:
        if len(self.done) >= 2:  # at most one step ahead of the GPU
            self.done.pop(0).synchronize()
        self.worker.execute_dummy_batch()
        _spin(tail)
        torch.cuda._sleep(self.cycles)  # the forward pass
        event = torch.cuda.Event()
        event.record()
        self.done.append(event)


def _serving(args: argparse.Namespace, out: dict) -> None:
    from vllm_capture_guard.runtime.patching import is_guarded

    cycles = _cycles_for(args.forward_ms)
    for backend in BACKENDS:
        runner = _runner(backend)
        builders = [
            b
            for groups in runner.attn_groups
            for g in groups
            for b in g.metadata_builders
        ]
        guarded = [
            is_guarded(vars(b).get("build_for_cudagraph_capture")) for b in builders
        ]
        assert all(guarded) if out["guard"] == "on" else not any(guarded), guarded
        rank = Rank(runner, cycles)
        runs = out["runs"].setdefault(backend, {"builder": type(builders[0]).__name__})
        measure(rank, runs, args)
        del rank, runner
        torch.cuda.empty_cache()


def _start_up(args: argparse.Namespace, out: dict) -> None:
    from vllm_capture_guard.lab import cost
    from vllm_capture_guard.lab.cost import account
    from vllm_capture_guard.tools.harness import v2

    for backend in BACKENDS:
        runs = []
        for _ in range(args.repeat):  # a config per runner: its layers register
            config = v2.make_config(backend, device="cuda")
            runner = v2.make_runner(config, device="cuda")
            torch.cuda.synchronize()
            with v2.driving(runner), account() as spent:
                t0 = time.perf_counter()
                runner.capture_model()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            phases = {k: v * 1e3 for k, v in spent.items() if k != "calls"}
            runs.append({"calls": int(spent["calls"]), "capture_s": wall, **phases})
            del runner
            torch.cuda.empty_cache()
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        best["ms"] = sum(v for k, v in best.items() if k not in ("calls", "capture_s"))
        out["runs"][backend] = {"least": best, "runs": runs}
    out["follows"] = hasattr(cost, "unfollowed")


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--what", choices=("serving", "start-up"), required=True)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    held = loaded(args)

    from importlib.metadata import version

    from tests.gpu import mrv2
    from vllm_capture_guard.tools.harness import runners

    out: dict = {
        "vllm": version("vllm"),
        "vllm_tree": args.tree,  # checked above; no machine path in the results
        "runner": runners.NAMES[runners.V2],
        "guard": args.guard,
        "set_up": mrv2.setup(),
        "runs": {},
    }
    if args.what == "serving":
        out.update(forward_ms=args.forward_ms, steps=args.steps)
        _serving(args, out)
    else:
        out.update(repeat=args.repeat)
        _start_up(args, out)
    return finish(out, args, held)


if __name__ == "__main__":
    sys.exit(main())
