# SPDX-License-Identifier: Apache-2.0
"""GPU tier: collects everywhere, runs where ``torch.cuda`` sees a GPU (CUDA,
or HIP on ROCm). Figures go to the JSON file named by ``GPU_TIER_RESULTS``.

``GPU_TIER_MUTATE`` runs the tier against a deliberately broken guard, to show
which tests catch it: ``unfollowed`` (the guard follows no copy, so it waits
for none) or ``always-wait`` (it waits for the stream after every capture)."""

from __future__ import annotations

import json
import os
import time

import pytest

RESULTS_ENV = "GPU_TIER_RESULTS"
MUTATE_ENV = "GPU_TIER_MUTATE"


@pytest.fixture(scope="session", autouse=True)
def mutation():
    """The guard broken as ``GPU_TIER_MUTATE`` says, for the whole session."""
    name = os.environ.get(MUTATE_ENV, "")
    if not name:
        yield None
        return
    from vllm_capture_guard.runtime.guard import copies

    follow, wait = copies.follow, copies.wait

    def always_wait(watch):  # noqa: ANN001, ANN202
        watch.unfollowed = watch.unfollowed or f"{MUTATE_ENV}={name}"
        return wait(watch)

    if name == "unfollowed":
        copies.follow = lambda watch: None
    elif name == "always-wait":
        copies.wait = always_wait
    else:
        raise pytest.UsageError(f"{MUTATE_ENV}={name!r}: unfollowed or always-wait")
    yield name
    copies.follow, copies.wait = follow, wait


@pytest.fixture(scope="session")
def gpu_results():
    """A dict the tests fill; written to ``$GPU_TIER_RESULTS`` at the end."""
    started = time.time()
    data: dict = {"env": {}, "guard": None, "unguarded": [], "cases": []}
    data["commit"] = os.environ.get("GPU_TIER_COMMIT", "unknown")
    data["mutation"] = os.environ.get(MUTATE_ENV) or None
    yield data
    data["session_seconds"] = round(time.time() - started, 1)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
