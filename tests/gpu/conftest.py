# SPDX-License-Identifier: Apache-2.0
"""GPU tier: collects everywhere, runs where ``torch.cuda`` sees a GPU (CUDA,
or HIP on ROCm). Figures go to the JSON file named by ``GPU_TIER_RESULTS``."""

from __future__ import annotations

import json
import os
import time

import pytest

RESULTS_ENV = "GPU_TIER_RESULTS"


@pytest.fixture(scope="session")
def gpu_results():
    """A dict the tests fill; written to ``$GPU_TIER_RESULTS`` at the end."""
    started = time.time()
    data: dict = {"env": {}, "guard": None, "unguarded": [], "cases": []}
    data["commit"] = os.environ.get("GPU_TIER_COMMIT", "unknown")
    yield data
    data["session_seconds"] = round(time.time() - started, 1)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
