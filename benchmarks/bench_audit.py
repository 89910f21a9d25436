# SPDX-License-Identifier: Apache-2.0
"""How long a full ``vllm-capture-guard audit`` takes, as a user runs it.

Runs ``python -m vllm_capture_guard audit --json`` in a fresh interpreter
(import of vLLM, config building, every registered backend) and prints the
wall time, the CPU time of the child, and the audit's own phases (target:
a full audit in at most 30 s on a 2-core machine).

Run: ``python benchmarks/bench_audit.py [--repeat N]``. The child inherits the
environment, so ``PYTHONPATH=src:/path/to/other/vllm`` benchmarks another vLLM.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from vllm_capture_guard.tools.audit.schema import from_json  # noqa: E402

TARGET_S = 30.0


def once() -> tuple[float, float, object]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_capture_guard", "audit", "--json"],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1):
        sys.exit(f"audit failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, cpu, from_json(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    walls, cpus = [], []
    out = None
    for _ in range(args.repeat):
        wall, cpu, out = once()
        walls.append(wall)
        cpus.append(cpu)
    t = out.timings
    wall = statistics.median(walls)
    print(f"vLLM {out.vllm}, {os.cpu_count()} CPUs, guard: {out.guard_mode}")
    print(
        f"coverage: built {out.built} of {out.registered} registered "
        f"backends; {out.captured} captured"
    )
    print(
        f"full audit, fresh interpreter: {wall:.1f} s wall (median of "
        f"{len(walls)}; all: {', '.join(f'{w:.1f}' for w in walls)}), "
        f"{statistics.median(cpus):.1f} s CPU"
    )
    rest = wall - t["setup_s"] - t["backends_s"]
    print(
        f"  import vLLM + load plugins + start-up: {rest:.1f} s; configs "
        f"{t['configs_s']:.1f} s (within setup {t['setup_s']:.1f} s); "
        f"backends {t['backends_s']:.1f} s"
    )
    verdict = "within" if wall <= TARGET_S else "OVER"
    print(f"target <= {TARGET_S:.0f} s: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
