# SPDX-License-Identifier: Apache-2.0
"""What ``vllm-capture-guard patch --check`` costs on an installed vLLM.

Prints, in one run:
  1. the whole command in a fresh interpreter (``python -m vllm_capture_guard
     patch --check``), wall time, median of several runs after one warm-up
     (target: <= 1 s);
  2. the modules it imported: none of vLLM, and not torch (target: zero);
  3. the check itself inside that process (find the tree, parse both files,
     plan and self-check the edit), for information.

It reads the vLLM that this Python imports and writes nothing.
Run: ``make bench`` (or ``python benchmarks/bench_tree.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

RUNS = 7

SNIPPET = """
import contextlib, io, json, sys, time
t0 = time.perf_counter()
from vllm_capture_guard.tools.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    rc = main(["patch", "--check"])
t1 = time.perf_counter()
mods = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print(json.dumps({"rc": rc, "vllm_modules": mods, "torch": "torch" in sys.modules,
                  "inner_ms": (t1 - t0) * 1e3, "out": out.getvalue()}))
"""


def one_run() -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", SNIPPET], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - start
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    one_run()  # warm-up: this package's bytecode is written once
    runs = [one_run() for _ in range(RUNS)]
    walls = [w for w, _ in runs]
    last = runs[-1][1]
    tree = last["out"].splitlines()[0] if last["out"] else "?"
    print(f"vllm-capture-guard patch --check, {os.cpu_count()} CPUs; {tree}")
    print(f"   exit code {last['rc']} (0 nothing to do, 1 needs the fix, 2 refused)")
    median = statistics.median(walls)
    print(
        f"\n1. fresh interpreter, whole command, median of {RUNS}: "
        f"{median * 1e3:.0f} ms (max {max(walls) * 1e3:.0f} ms)"
    )
    print(f"   target <= 1 s (median): {'met' if median <= 1.0 else 'MISSED'}")
    mods = {m for _, r in runs for m in r["vllm_modules"]}
    torch = any(r["torch"] for _, r in runs)
    print(f"\n2. vLLM modules imported: {len(mods)}; torch imported: {torch}")
    print(f"   target zero: {'met' if not mods and not torch else 'MISSED'}")
    inner = statistics.median(r["inner_ms"] for _, r in runs)
    print(f"\n3. inside the process (import + check): {inner:.1f} ms median")
    return 0 if median <= 1.0 and not mods and not torch else 1


if __name__ == "__main__":
    sys.exit(main())
