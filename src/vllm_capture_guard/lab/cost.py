# SPDX-License-Identifier: Apache-2.0
"""The guard's own time, by phase, on whatever runs while :func:`account` is
open: saving the host values, waiting for the copies it followed, comparing,
putting back. It wraps the guard's four phase functions for that time (each
wrapper adds a clock read around the call, so the figures are slightly high);
the runtime itself keeps no clock. Following the copies runs inside the
capture, call by call; :func:`unfollowed` turns it off for one measurement,
so that its cost is the difference (the GPU tier reports it that way)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

#: phase -> (the guard's module, its function for that phase)
PHASES = {
    "save": ("restore", "save"),
    "wait": ("copies", "wait"),
    "compare": ("restore", "changed"),
    "put_back": ("restore", "restore"),
}


def _module(name: str):  # noqa: ANN202
    from vllm_capture_guard.runtime.guard import copies, restore

    return {"copies": copies, "restore": restore}[name]


@contextlib.contextmanager
def account() -> Iterator[dict[str, float]]:
    """``{"calls": guarded captures, phase: seconds, ...}``, filled while open."""
    spent: dict[str, float] = dict.fromkeys(("calls", *PHASES), 0)
    originals = {p: getattr(_module(m), f) for p, (m, f) in PHASES.items()}

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

    for phase, (module, name) in PHASES.items():
        setattr(_module(module), name, timed(phase, originals[phase]))
    try:
        yield spent
    finally:
        for phase, (module, name) in PHASES.items():
            setattr(_module(module), name, originals[phase])


@contextlib.contextmanager
def unfollowed() -> Iterator[None]:
    """The guard as it is, but following no copies (so waiting for none): only
    for measuring what following them costs; not exact on a GPU."""
    copies = _module("copies")
    follow = copies.follow
    copies.follow = lambda watch: None
    try:
        yield
    finally:
        copies.follow = follow
