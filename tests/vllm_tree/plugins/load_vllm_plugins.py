# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (``-p load_vllm_plugins``): load vLLM's general plugins the
way each vLLM process does (``vllm.plugins.load_general_plugins()``), before
any test file is collected, and say at the end what vllm-capture-guard did in
this process (one ``vllm-capture-guard report:`` line). Test-only."""

from __future__ import annotations

import json

REPORT = "vllm-capture-guard report:"


def pytest_configure(config):
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def pytest_terminal_summary(terminalreporter):
    try:
        from vllm_capture_guard.runtime import plugin

        report = plugin.report()
    except Exception as e:  # the line says so; the caller decides
        found = {"error": f"{type(e).__name__}: {e}"}
    else:
        found = {"action": None, "outcomes": {}}
        if report is not None:
            found["action"] = report.action
            for name, outcome in report.outcomes.items():
                status = getattr(outcome, "status", outcome)
                found["outcomes"][name] = getattr(status, "value", str(status))
    terminalreporter.write_line(f"{REPORT} {json.dumps(found, sort_keys=True)}")
