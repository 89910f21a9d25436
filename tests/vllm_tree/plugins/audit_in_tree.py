# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (``-p audit_in_tree``): once the tests have run, run
vllm-capture-guard's audit (``run_audit``, what ``vllm-capture-guard audit``
runs) in this same process, on the same vLLM, platform and answered ROCm
gate as the tests, and write its result (``audit --json``'s schema) to the
file ``$CAPTURE_GUARD_AUDIT_JSON``; on an error, ``{"error": ...}``.

``$CAPTURE_GUARD_AUDIT_LATER`` names the later builders of the sequenced
check (comma-separated; empty: none, only the captures and their writes,
which is what the audit's exit status and its ``cpu_writers`` come from);
unset: the audit's default ones. Test-only."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import pytest

OUT = "CAPTURE_GUARD_AUDIT_JSON"
LATER = "CAPTURE_GUARD_AUDIT_LATER"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    out = os.environ.get(OUT)
    if not out:
        return
    start = time.process_time()
    try:
        from vllm_capture_guard.tools.audit.run import run_audit
        from vllm_capture_guard.tools.audit.schema import to_json

        kwargs = {}
        if LATER in os.environ:
            kwargs["later"] = [n for n in os.environ[LATER].split(",") if n]
        mode = os.environ.get("VLLM_CAPTURE_GUARD", "?")
        found = to_json(run_audit(guard_mode=mode, **kwargs))
    except Exception:
        found = {"error": traceback.format_exc()[-4000:]}
    found["in_tree_cpu_s"] = round(time.process_time() - start, 1)
    Path(out).write_text(json.dumps(found))
