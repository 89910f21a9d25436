# SPDX-License-Identifier: Apache-2.0
"""The guard's own time, by phase, on whatever runs while :func:`account` is
open: saving the host values, waiting for the device, comparing, putting
back. It wraps the guard's four phase functions for that time (each wrapper
adds a clock read around the call, so the figures are slightly high); the
runtime itself keeps no clock."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

#: phase -> the guard's function for it
PHASES = {
    "save": "save",
    "wait": "wait_for",
    "compare": "changed",
    "put_back": "put_back",
}


@contextlib.contextmanager
def account() -> Iterator[dict[str, float]]:
    """``{"calls": guarded captures, phase: seconds, ...}``, filled while open."""
    from vllm_capture_guard.runtime.patches import rocm_attn_cpu_offsets as guard

    spent: dict[str, float] = dict.fromkeys(("calls", *PHASES), 0)
    originals = {name: getattr(guard, name) for name in PHASES.values()}

    def timed(phase: str, fn):  # noqa: ANN001, ANN202
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start
                spent["calls"] += phase == "save"

        return wrapper

    for phase, name in PHASES.items():
        setattr(guard, name, timed(phase, originals[name]))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(guard, name, fn)
