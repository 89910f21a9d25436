# SPDX-License-Identifier: Apache-2.0
"""What the guard costs, measured on vLLM's real builders (CPU).

Prints, in one run:
  1. the added cost per capture call, in µs and as a ratio to the unguarded
     call on the same builder and metadata (target: < 10 µs added);
  2. whether every builder's ``build()`` (the serving hot path) is still the
     very same function object (target: zero cost on the hot path);
  3. the plugin's load time, ``register()``, in a fresh interpreter where
     vLLM's platform is imported but no attention backend: under ``auto`` on
     a non-ROCm platform and under ``on`` (target: <= 5 ms each);
  4. the work done in the import hooks when vLLM imports the ROCm backends
     (target: <= 5 ms: the source of each capture is read, nothing is run);
  5. the road not taken: restoring the host fields after the capture instead
     of giving the capture its own copies (same fields, same builder).

Run: ``make bench`` (or ``python benchmarks/bench_guard.py``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPEAT = 7  # timing rounds; the median is reported
CALLS = 2000  # capture calls per round

LOAD_SNIPPET = """
import time
import vllm.plugins
from vllm.platforms import current_platform
current_platform.is_rocm()  # vLLM has resolved its platform before plugins load
t0 = time.perf_counter()
from vllm_capture_guard.runtime.plugin import register
register()
t1 = time.perf_counter()
print(f"{(t1 - t0) * 1e3:.3f}")
"""


def _per_call_us(fn, builder, metadata) -> float:
    rounds = []
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn(builder, metadata)
        rounds.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(rounds)


def capture_cost() -> list[tuple[str, float, float]]:
    from vllm_capture_guard.runtime.patches import PATCHES, original_of
    from vllm_capture_guard.tools import harness as sc

    for backend in sc.seed_backends():
        sc.backend_class(backend)  # the patches act on what vLLM imported
    for patch in PATCHES:
        patch.apply()
    config = sc.make_vllm_config()
    rows = []
    for backend in sc.seed_backends():
        builder = sc.attention_builder(backend, config)
        metadata = sc.shared_metadata(sc.Batch(16, query_len=4))
        guarded = type(builder).build_for_cudagraph_capture
        unguarded = _unguarded_capture(type(builder), original_of)
        base = _per_call_us(unguarded, builder, metadata)
        with_guard = _per_call_us(guarded, builder, metadata)
        rows.append((backend, base, with_guard))
    return rows


def isolate_vs_restore() -> list[tuple[str, float, float]]:
    """The shipped wrapper (the capture gets its own host copies) against the
    alternative (snapshot the host fields, run the capture on the shared
    metadata, copy the values back), on vLLM's ROCm builder."""
    from vllm_capture_guard.runtime.patches import original_of
    from vllm_capture_guard.runtime.patches import rocm_attn_cpu_offsets as rocm
    from vllm_capture_guard.runtime.shape import is_host_field
    from vllm_capture_guard.tools import harness as sc

    config = sc.make_vllm_config()
    builder = sc.attention_builder("ROCM_ATTN", config)
    capture = original_of(type(builder).build_for_cudagraph_capture)
    metadata = sc.shared_metadata(sc.Batch(16, query_len=4))
    names = [n for n in vars(metadata) if is_host_field(n)]

    def restoring(self, cm):
        saved = [
            (t, t.clone())
            for t in (getattr(cm, n) for n in names)
            if hasattr(t, "clone")
        ]
        try:
            return capture(self, cm)
        finally:
            for tensor, values in saved:
                tensor.copy_(values)

    isolating = rocm._isolated(capture)
    return [
        (
            "ROCM_ATTN",
            _per_call_us(isolating, builder, metadata),
            _per_call_us(restoring, builder, metadata),
        )
    ]


def _unguarded_capture(cls, original_of):
    """vLLM's own capture for ``cls``: for our AITER subclass, its parent's."""
    from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as aiter

    if cls.__module__ == aiter.__name__:
        cls = cls.__mro__[1]
    return original_of(cls.__dict__.get("build_for_cudagraph_capture"))


def hot_path_identity() -> list[tuple[str, bool]]:
    """``build`` before and after the patches, for each ROCm backend."""
    import importlib

    from vllm_capture_guard.runtime.patches import PATCHES
    from vllm_capture_guard.tools import harness as sc

    for patch in reversed(PATCHES):
        patch.revert()
    backends = sc.seed_backends()
    before = {b: sc.backend_class(b).get_builder_cls().build for b in backends}
    for patch in PATCHES:
        patch.apply()
    importlib.invalidate_caches()
    return [
        (b, sc.backend_class(b).get_builder_cls().build is before[b]) for b in backends
    ]


HOOK_SNIPPET = """
import time
import vllm.plugins
from vllm_capture_guard.runtime import hooks
spent = []
run = hooks._run
def timed(name, module, todo):
    t0 = time.perf_counter()
    run(name, module, todo)
    spent.append(time.perf_counter() - t0)
hooks._run = timed
vllm.plugins.load_general_plugins()
import vllm.v1.attention.backends.rocm_attn
import vllm.v1.attention.backends.rocm_aiter_unified_attn
from vllm_capture_guard.runtime.plugin import report
assert report().action in ("patched", "not needed"), report()
print(f"{sum(spent) * 1e3:.3f}")
"""


def compile_package() -> None:
    """Byte-compile the package, as pip does when it installs a wheel (this
    machine may set PYTHONDONTWRITEBYTECODE, and a load time that includes
    compiling our source would measure the compiler, not the plugin)."""
    import compileall

    import vllm_capture_guard

    compileall.compile_dir(os.path.dirname(vllm_capture_guard.__file__), quiet=1)


FRESH_RUNS = 5


def fresh_ms(snippet: str, mode: str) -> list[float]:
    env = dict(os.environ, VLLM_CAPTURE_GUARD=mode)
    out = []
    for _ in range(FRESH_RUNS):
        proc = subprocess.run(
            [sys.executable, "-c", snippet],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        out.append(float(proc.stdout.strip().splitlines()[-1]))
    return out


def main() -> int:
    from importlib.metadata import version

    print(
        f"vllm-capture-guard benchmark on vLLM {version('vllm')}, torch "
        f"{version('torch')}, {os.cpu_count()} CPUs"
    )
    print(f"\n1. capture call, batch reqs16 x q4, median of {REPEAT} x {CALLS} calls")
    worst = 0.0
    for backend, base, guarded in capture_cost():
        added = guarded - base
        worst = max(worst, added)
        print(
            f"   {backend:<24} unguarded {base:7.2f} µs  guarded {guarded:7.2f} µs"
            f"  added {added:6.2f} µs  ratio {guarded / base:5.2f}x"
        )
    print(f"   target < 10 µs added: {'met' if worst < 10 else 'MISSED'}")
    print("\n2. serving hot path: build() after patching")
    same = hot_path_identity()
    for backend, identical in same:
        print(f"   {backend:<24} build is vLLM's own function: {identical}")
    print(f"   target zero cost: {'met' if all(s for _, s in same) else 'MISSED'}")
    compile_package()
    print(
        "\n3. register(), fresh interpreter, vLLM's platform imported, no "
        f"backend; median of {FRESH_RUNS}"
    )
    worst = 0.0
    for mode in ("auto", "on"):
        loads = fresh_ms(LOAD_SNIPPET, mode)
        worst = max(worst, statistics.median(loads))
        shown = ", ".join(f"{t:.2f}" for t in loads)
        print(
            f"   VLLM_CAPTURE_GUARD={mode:<4} median {statistics.median(loads):.2f} ms"
            f"  (runs: {shown})"
        )
    print(f"   target <= 5 ms: {'met' if worst <= 5 else 'MISSED'}")
    print(
        "\n4. import hooks: work done when vLLM imports the ROCm backends (on); "
        f"median of {FRESH_RUNS}"
    )
    spent = fresh_ms(HOOK_SNIPPET, "on")
    shown = ", ".join(f"{t:.2f}" for t in spent)
    median = statistics.median(spent)
    print(f"   hooks: median {median:.2f} ms  (runs: {shown})")
    print(f"   target <= 5 ms: {'met' if median <= 5 else 'MISSED'}")
    print("\n5. isolating (shipped) vs restoring the host fields, per capture call")
    for backend, isolate, restore in isolate_vs_restore():
        print(
            f"   {backend:<24} own copies {isolate:7.2f} µs  restore after "
            f"{restore:7.2f} µs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
