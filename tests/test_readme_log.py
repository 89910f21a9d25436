# SPDX-License-Identifier: Apache-2.0
"""The README's log excerpt ("What the log shows") is what the guard logs:
``VLLM_CAPTURE_GUARD=on vllm-capture-guard check -v`` in a new process where
the plugin never loaded (:func:`tests.conftest.run_fresh`), its guard lines
kept as ``scripts/readme_log.py`` keeps them (times written ``...``), against
the block between the README's ``log-excerpt`` markers.

The excerpt names one release, the venv's (the one ``make env`` builds), so
the test is marked ``once``: the version matrix runs it in the venv only. On
another release it skips.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import run_fresh

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "readme_log", ROOT / "scripts" / "readme_log.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_log"] = module
    spec.loader.exec_module(module)
    return module


readme_log = _load()


def test_the_readme_log_excerpt_is_what_check_logs(vllm_version):
    have = readme_log.in_readme(readme_log.README.read_text())
    named = readme_log.release(have)
    assert named, f"the README's excerpt names no release: {have[:3]}"
    if named != vllm_version:
        pytest.skip(f"the README's excerpt is vLLM {named}'s; this is {vllm_version}")
    proc = run_fresh(readme_log.ARGS, **readme_log.ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = readme_log.excerpt(proc.stdout, proc.stderr)
    assert logged == have, (
        "README.md's log excerpt is not what check -v logs; "
        "run `python scripts/readme_log.py` to rewrite it"
    )


def test_times_are_written_as_dots():
    line = "INFO 12-06 05:40:20 [plugin.py:97] vllm-capture-guard: x: patched"
    assert (
        readme_log.normal(line)
        == "INFO ... [plugin.py:97] vllm-capture-guard: x: patched"
    )
    assert readme_log.normal(readme_log.normal(line)) == readme_log.normal(line)
