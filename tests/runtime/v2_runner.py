# SPDX-License-Identifier: Apache-2.0
"""vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``), started on the CPU as a
worker starts it, on the harness's own drive
(:mod:`vllm_capture_guard.tools.harness.v2`): the runner vLLM's loader loads
with MiniMax-M3's attention layer and indexer cache layer, and then

1. ``profile_cudagraph_memory()``, the runner's own, where vLLM's worker
   runs it: while the engine core plans the KV cache, when it asks the
   worker for its free memory (after it resolved the KV-cache layout).
   Where the runner profiles by capturing (a minimal KV cache, its own
   builders, the largest FULL sizes) its builders run here; where it
   answers 0 without capturing, none do;
2. ``initialize_kv_cache``: the rest of the engine core's plan, through the
   worker to the runner's ``initialize_kv_cache`` (new builders, the
   runner's ``CudaGraphManager``);
3. ``capture_model()``: every FULL descriptor of the manager, 512 down to 1,
   warm-up and capture;
4. at serving time, vLLM's worker's ``execute_dummy_batch()`` (an idle
   data-parallel rank's uniform decode batch, its FULL graph's metadata
   built for capture).

The harness sets the host up as vLLM's CPU worker sets it up
(:func:`~vllm_capture_guard.tools.harness.v2.cpu_setup`: vLLM's own CPU
shims, which patch torch for the rest of the process), so this runs only in
a child process. Every metadata build is read at the model state's
``prepare_attn`` (:func:`~vllm_capture_guard.tools.harness.v2.observe`):
how many each step built for capture is known without asking the guard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.harness import v2

STEPS = ("profile_cudagraph_memory", "initialize_kv_cache", "capture_model",
         "execute_dummy_batch")  # fmt: skip


@dataclasses.dataclass
class Step:
    name: str
    error: str | None = None
    site: str | None = None
    #: metadata builds for capture in this step, read at prepare_attn
    builds: int = 0


@dataclasses.dataclass
class StartUp:
    steps: list[Step]
    #: the FULL descriptors of the runner's manager, and how many capture reached
    descriptors: int = 0
    reached: int = 0


class _Stopped(Exception):
    """A step raised (recorded on the step): the start-up stops there."""


def start_up(runner: Any, between: Callable[[str], None] | None = None) -> StartUp:
    """Steps 1-4 of the module docstring on ``runner`` (made by
    :func:`~vllm_capture_guard.tools.harness.v2.load_runner`, no KV cache
    yet); ``between(step)`` runs before each step (a case's change). Stops
    at the first step that raises."""
    builds = v2.observe(runner)
    done = StartUp([])
    marks: list[int] = []

    def begin(name: str) -> None:
        if between is not None:
            between(name)
        done.steps.append(Step(name))
        marks.append(len(builds))

    def end(error: str | None = None, site: str | None = None) -> None:
        step = done.steps[-1]
        step.builds = sum(b.for_capture for b in builds[marks[-1] :])
        if error is not None:
            step.error, step.site = error, site
            raise _Stopped(step.name)

    def failed(e: BaseException) -> None:
        end(harness.error_text(e), harness.error_site(e)[0])

    def profile() -> None:  # the worker's determine_available_memory
        begin(STEPS[0])
        try:
            runner.profile_cudagraph_memory()
        except Exception as e:
            failed(e)
        end()
        begin(STEPS[1])

    try:
        try:
            with v2.driving(runner):
                v2.initialize_kv_cache(runner.vllm_config, runner, profile)
        except _Stopped:
            raise
        except Exception as e:
            if not done.steps:  # the engine core's plan, before it asked
                begin(STEPS[1])
            failed(e)
        if [s.name for s in done.steps] != list(STEPS[:2]):
            raise RuntimeError("the engine core never asked the worker's memory")
        end()
        begin(STEPS[2])
        found = v2.capture(runner)
        done.descriptors = len(found.descriptors)
        done.reached = len(found.per_descriptor())
        if found.error:
            end(found.error, found.error_site)
        end()
        begin(STEPS[3])
        try:
            v2.execute_dummy_batch(runner)
        except Exception as e:
            failed(e)
        end()
    except _Stopped:
        pass
    return done
