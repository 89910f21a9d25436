# SPDX-License-Identifier: Apache-2.0
"""The warm parent: imported once, by the forkserver of :mod:`tests.warm`.

It models a process that imported vLLM before it loaded plugins: torch and
vLLM's core (``vllm.config``, ``vllm.plugins``), and nothing else. Then it
checks itself, in the process that serves, and leaves the verdict in
:data:`VERDICT` for every child to read (a forkserver silently skips a
preload that fails to import; a child that finds no verdict, or a failed
one, runs in a fresh interpreter instead).

The checks:

* one thread (Python's and the kernel's count), so no lock or OpenMP pool is
  held across ``fork`` (``OMP_NUM_THREADS=1`` is set before torch loads);
* vLLM's plugins not loaded (``vllm.plugins.plugins_loaded``);
* vLLM's current platform: resolved only by vLLM's own import, as in every
  fresh process (``vllm.utils.torch_utils`` asks for it at import), never by
  an accelerator's initialisation;
* no distributed state and no CUDA/HIP initialised;
* none of the modules the runtime watches imported (every patch's modules
  and the runner entries, asked of the runtime in a subprocess that imports
  neither torch nor vLLM, so that nothing of our package is imported here);
* nothing of our package imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

#: Every problem found; empty when the parent is fit to fork children from.
PROBLEMS: list[str] = []
#: The class name of vLLM's current platform, if vLLM's import resolved it.
PLATFORM: list[str | None] = [None]
#: What children read: {"ok": bool, "problems": [...], "platform": name}.
VERDICT: dict = {"ok": False, "problems": ["not checked yet"], "platform": None}

_ASK_RUNTIME = (
    "import json; from vllm_capture_guard.runtime.patches import PATCHES; "
    "print(json.dumps(sorted({m for p in PATCHES for m in p.modules})))"
)


def _watched() -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _ASK_RUNTIME],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        PROBLEMS.append(f"cannot ask the runtime what it watches: {proc.stderr[-300:]}")
        return []
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(watched: list[str]) -> None:
    import torch

    native = (
        len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    )
    if threading.active_count() != 1 or native != 1:
        PROBLEMS.append(f"{threading.active_count()} Python / {native} native threads")
    plugins = sys.modules.get("vllm.plugins")
    if plugins is None or getattr(plugins, "plugins_loaded", True):
        PROBLEMS.append("vLLM's plugins are loaded")
    platforms = sys.modules.get("vllm.platforms")
    resolved = getattr(platforms, "_current_platform", None)
    trace = getattr(platforms, "_init_trace", "")
    if resolved is not None and "vllm_capture_guard" in trace:
        PROBLEMS.append("the platform was resolved by our code")
    PLATFORM[0] = type(resolved).__name__ if resolved is not None else None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        PROBLEMS.append("torch.distributed is initialised")
    if torch.cuda.is_initialized():
        PROBLEMS.append("CUDA/HIP is initialised")
    imported = sorted(m for m in watched if m in sys.modules)
    if imported:
        PROBLEMS.append(f"watched modules imported: {', '.join(imported)}")
    ours = sorted(m for m in sys.modules if m.startswith("vllm_capture_guard"))
    if ours:
        PROBLEMS.append(f"our package imported: {', '.join(ours[:5])}")


def _warm() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads its OpenMP runtime
    os.environ["MKL_NUM_THREADS"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    watched = _watched()
    import torch  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.plugins  # noqa: F401

    _check(watched)


try:
    _warm()
except BaseException as e:  # never break the forkserver: record it instead
    PROBLEMS.append(f"warming failed: {type(e).__name__}: {e}")
VERDICT = {"ok": not PROBLEMS, "problems": PROBLEMS, "platform": PLATFORM[0]}
