# SPDX-License-Identifier: Apache-2.0
"""What the guard costs, in CPU time, on vLLM's real V1 start-up (CPU).

Prints, in one run (medians of several runs; CPU time of the calling thread
for 1 and 2, of a fresh interpreter's process for 3 and 4):
  1. the guard's own work summed over a whole start-up's captures: vLLM's
     ``profile_cudagraph_memory``, ``capture_model`` at its 51 sizes and one
     ``execute_dummy_batch``, MiniMax-M3's two KV-cache groups (the ROCm
     builder and the indexer's), beside the captures' own time in the same
     run: a per-call regression figure (the cost goal, at most 8 ms per
     start-up, is measured on a GPU: ``tests/gpu/test_guard_cost.py``);
  2. the same for one serving-time dummy batch;
  3. ``register()`` in a fresh interpreter where vLLM's platform is imported
     but no attention backend, under ``auto`` (a non-ROCm platform) and
     ``on`` (goal: <= 5 ms each);
  4. the work done in the import hooks when vLLM imports the ROCm backends
     and its runner utilities (goal: <= 5 ms);
  5. whether every builder's ``build()`` (the serving hot path) is still
     vLLM's own function object.

The guard's own work is the CPU time of each guarded call less the time of
the capture inside it (the clock's own reads are in the guard's figure); the
captures' time is what vLLM's captures take inside the guard. The CPU runner's
pinned-memory stub (a torch function mode, which sees every torch call) is on
only while a runner is made, as a real server has no such mode.

Run: ``make bench`` (or ``python benchmarks/bench_guard.py``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.runtime
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ["VLLM_CAPTURE_GUARD"] = "on"
os.environ["VLLM_ENABLE_CUDAGRAPH_GC"] = "1"  # see tests/runtime/at_use.py

REPEAT = 5  # start-ups; the median is reported
FRESH_RUNS = 5

LOAD_SNIPPET = """
import time
import vllm.plugins
from vllm.platforms import current_platform
current_platform.is_rocm()  # vLLM has resolved its platform before plugins load
t0 = time.process_time()
from vllm_capture_guard.runtime.plugin import register
register()
print(f"{(time.process_time() - t0) * 1e3:.3f}")
"""

HOOK_SNIPPET = """
import time
import vllm.plugins
from vllm_capture_guard.runtime import hooks
spent = []
run = hooks._run
def timed(name, module, todo):
    t0 = time.process_time()
    run(name, module, todo)
    spent.append(time.process_time() - t0)
hooks._run = timed
vllm.plugins.load_general_plugins()
import vllm.v1.attention.backends.rocm_attn
import vllm.v1.attention.backends.rocm_aiter_unified_attn
import vllm.v1.worker.utils
from vllm_capture_guard.runtime.plugin import report
assert report().action == "patched", report()
print(f"{sum(spent) * 1e3:.3f}")
"""


class Clock:
    """CPU time of each guarded call not nested on the same metadata, less the
    capture's own, on the calling thread."""

    def __init__(self) -> None:
        from vllm_capture_guard.runtime.guard import guarded_call as g

        self.guard = self.capture = 0.0
        self.calls = 0
        guarded_call, clock = g.run, time.thread_time

        def call(capture, owner, metadata, *args, **kwargs):  # noqa: ANN001, ANN202
            if id(metadata) in getattr(g._thread, "active", ()):  # nested: not again
                return guarded_call(capture, owner, metadata, *args, **kwargs)
            inner = []

            def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
                t0 = clock()
                try:
                    return capture(*a, **k)
                finally:
                    inner.append(clock() - t0)

            t0 = clock()
            try:
                return guarded_call(timed, owner, metadata, *args, **kwargs)
            finally:
                total = clock() - t0
                self.calls += 1
                self.capture += sum(inner)
                self.guard += total - sum(inner)

        g.run = call

    def reset(self) -> None:
        self.guard = self.capture = 0.0
        self.calls = 0


def start_ups(clock: Clock) -> tuple[list, list]:
    """(whole start-ups, dummy batches): (guard ms, captures ms, calls) each."""
    from tests.runtime import cpu_runner

    whole, dummy = [], []
    for _ in range(REPEAT):
        config = cpu_runner.make_config("ROCM_ATTN")
        from vllm_capture_guard.tools import harness

        with cpu_runner.NoPinnedMemory():  # pinned buffers need a driver
            runner = cpu_runner.make_runner(config, harness.backend_class("ROCM_ATTN"))
        clock.reset()
        steps = cpu_runner.start_up(runner)
        assert all(s.error is None for s in steps), steps
        whole.append((clock.guard * 1e3, clock.capture * 1e3, clock.calls))
        clock.reset()
        cpu_runner._worker(runner).execute_dummy_batch()
        dummy.append((clock.guard * 1e3, clock.capture * 1e3, clock.calls))
    return whole, dummy


def hot_path_identity() -> list[tuple[str, bool]]:
    """``build`` of each ROCm backend's builder: vLLM's own function?"""
    from vllm_capture_guard.runtime.patching import original_of
    from vllm_capture_guard.tools import harness as sc

    found = []
    for backend in sc.seed_backends():
        cls = sc.backend_class(backend).get_builder_cls()
        own = next(c for c in cls.__mro__ if "build" in vars(c))
        found.append((backend, vars(own)["build"] is original_of(vars(own)["build"])
                      and own.__module__.startswith("vllm.")))  # fmt: skip
    return found


def compile_package() -> None:
    """Byte-compile the package, as pip does when it installs a wheel, so a
    load time measures the plugin, not the compiler."""
    import compileall

    import vllm_capture_guard

    compileall.compile_dir(os.path.dirname(vllm_capture_guard.__file__), quiet=1)


def fresh_ms(snippet: str, mode: str) -> list[float]:
    env = dict(os.environ, VLLM_CAPTURE_GUARD=mode)
    out = []
    for _ in range(FRESH_RUNS):
        proc = subprocess.run(
            [sys.executable, "-c", snippet], env=env, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        out.append(float(proc.stdout.strip().splitlines()[-1]))
    return out


def _median(rows: list, i: int) -> float:
    return statistics.median(r[i] for r in rows)


def main() -> int:
    import gc
    from importlib.metadata import version

    import vllm.plugins

    vllm.plugins.load_general_plugins()
    import vllm.v1.worker.gpu_model_runner  # noqa: F401
    from tests.runtime import cpu_runner

    cpu_runner.stub_gpu_leaves().close()  # the pinned-memory mode: see start_ups
    gc.collect()
    gc.freeze()
    print(
        f"vllm-capture-guard benchmark on vLLM {version('vllm')}, torch "
        f"{version('torch')}, {os.cpu_count()} CPUs; CPU time, median of {REPEAT}"
    )
    clock = Clock()
    whole, dummy = start_ups(clock)
    g, c, n = _median(whole, 0), _median(whole, 1), whole[0][2]
    print("\n1. a whole start-up (profile, capture_model at every size, a dummy batch)")
    print(f"   {n} guarded captures: the guard {g:.3f} ms ({g / n * 1e3:.1f} µs a call)"
          f"; the captures themselves {c:.1f} ms")  # fmt: skip
    print("   (a per-call regression figure; the cost goal is taken on a GPU)")
    g, c, n = _median(dummy, 0), _median(dummy, 1), dummy[0][2]
    print("\n2. one serving-time execute_dummy_batch")
    print(f"   {n} guarded captures: the guard {g * 1e3:.1f} µs; the captures "
          f"{c * 1e3:.1f} µs")  # fmt: skip
    compile_package()
    print(f"\n3. register(), fresh interpreter; median of {FRESH_RUNS}")
    worst = 0.0
    for mode in ("auto", "on"):
        loads = fresh_ms(LOAD_SNIPPET, mode)
        worst = max(worst, statistics.median(loads))
        shown = ", ".join(f"{t:.2f}" for t in loads)
        mid = statistics.median(loads)
        print(f"   VLLM_CAPTURE_GUARD={mode:<4} median {mid:.2f} ms  (runs: {shown})")
    print(f"   goal <= 5 ms: {'met' if worst <= 5 else 'MISSED'}")
    print(
        f"\n4. import hooks (ROCm backends, runner utilities); median of {FRESH_RUNS}"
    )
    spent = fresh_ms(HOOK_SNIPPET, "on")
    median = statistics.median(spent)
    shown = ", ".join(f"{t:.2f}" for t in spent)
    print(f"   hooks: median {median:.2f} ms  (runs: {shown})")
    print(f"   goal <= 5 ms: {'met' if median <= 5 else 'MISSED'}")
    print("\n5. serving hot path: build() after patching")
    same = hot_path_identity()
    for backend, identical in same:
        print(f"   {backend:<24} build is vLLM's own function: {identical}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
