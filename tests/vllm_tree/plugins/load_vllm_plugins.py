# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (``-p load_vllm_plugins``): load vLLM's general plugins the
way each vLLM process does (``vllm.plugins.load_general_plugins()``), before
any test file is collected, and say at the end which of them vLLM's loader
imported (one ``vllm-capture-guard report:`` line: the modules of the
``vllm.general_plugins`` entry points that are imported now). It reads nothing
of the guard's own state, which is the guard's business. Test-only."""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points

REPORT = "vllm-capture-guard report:"
GROUP = "vllm.general_plugins"


def _imported() -> dict[str, bool]:
    return {ep.name: ep.module in sys.modules for ep in entry_points(group=GROUP)}


def pytest_configure(config):
    from vllm.plugins import load_general_plugins

    config._plugins_before = _imported()
    load_general_plugins()


def pytest_terminal_summary(terminalreporter, config):
    found = {
        "before": getattr(config, "_plugins_before", {}),
        "after": _imported(),
    }
    terminalreporter.write_line(f"{REPORT} {json.dumps(found, sort_keys=True)}")
