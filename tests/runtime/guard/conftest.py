# SPDX-License-Identifier: Apache-2.0
"""The guard's log lines reach ``caplog`` whatever vLLM did to its loggers
(vLLM's own logger stops propagating to the root once vLLM configures it)."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def guard_log_to_caplog(monkeypatch):
    import vllm.logger  # noqa: F401  (vLLM configures its logger on import)

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
