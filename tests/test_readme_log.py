# SPDX-License-Identifier: Apache-2.0
"""The guard's log lines that the README and docs/log.md quote by hand are
what the guard logs: ``VLLM_CAPTURE_GUARD=on vllm-capture-guard check -v`` in
a new process where the plugin never loaded (:func:`tests.conftest.run_fresh`),
its guard lines kept as ``scripts/readme_log.py`` keeps them (times written
``...``); each quoted line must match one of them whole, each ``...`` in it
standing for any text.

The quoted lines name one release, the venv's (the one ``make env`` builds),
so the test is marked ``once``: the version matrix runs it in the venv only.
On another release it skips.
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


def _quoted() -> dict[Path, list[str]]:
    return {page: readme_log.quoted(page.read_text()) for page in readme_log.PAGES}


def test_the_quoted_guard_lines_are_what_check_logs(vllm_version):
    quoted = _quoted()
    assert quoted[ROOT / "README.md"], "the README quotes no guard log line"
    every = [line for lines in quoted.values() for line in lines]
    named = readme_log.release(every)
    if named and named != vllm_version:
        pytest.skip(f"the quoted lines are vLLM {named}'s; this is {vllm_version}")
    proc = run_fresh(readme_log.ARGS, **readme_log.ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = readme_log.guard_lines(proc.stdout, proc.stderr)
    for page, lines in quoted.items():
        gone = readme_log.missing(lines, logged)
        assert not gone, (
            f"{page.relative_to(ROOT)} quotes guard lines that `{readme_log.SHOWN}` "
            f"does not log: {gone}\nwhat it logs:\n" + "\n".join(logged)
        )


def test_times_are_written_as_dots():
    line = "INFO 12-06 05:40:20 [plugin.py:97] vllm-capture-guard: x: patched"
    assert (
        readme_log.normal(line)
        == "INFO ... [plugin.py:97] vllm-capture-guard: x: patched"
    )
    assert readme_log.normal(readme_log.normal(line)) == readme_log.normal(line)


LOGGED = [
    "INFO ... [plugin.py:97] vllm-capture-guard: builder-capture-guard: patched "
    "(every builder's capture) on vLLM 0.28.0",
    "INFO ... [base.py:116] vllm-capture-guard: RocmAttentionMetadataBuilder's "
    "capture wrote query_start_loc_cpu (size 512); kept from the other builders",
]


@pytest.mark.parametrize(
    ("quoted", "found"),
    [
        (
            "INFO ... vllm-capture-guard: builder-capture-guard: patched (...) on "
            "vLLM 0.28.0",
            True,
        ),
        (
            "INFO ... vllm-capture-guard: RocmAttentionMetadataBuilder's capture "
            "wrote query_start_loc_cpu (size 512); kept ...",
            True,
        ),
        # a word changed, a level changed, a part of the line only
        (
            "INFO ... vllm-capture-guard: RocmAttentionMetadataBuilder's capture "
            "wrote query_start_loc (size 512); kept ...",
            False,
        ),
        (
            "WARNING ... vllm-capture-guard: builder-capture-guard: patched (...) "
            "on vLLM 0.28.0",
            False,
        ),
        ("INFO ... vllm-capture-guard: builder-capture-guard: patched", False),
    ],
)
def test_a_quoted_line_matches_a_logged_line_whole(quoted, found):
    assert (readme_log.missing([quoted], LOGGED) == []) is found


def test_quoted_lines_are_the_log_lines_of_code_blocks():
    text = (
        "INFO ... vllm-capture-guard: in prose, not quoted\n"
        "```\n"
        "INFO ... vllm-capture-guard: a: patched (...)\n"
        "$ vllm-capture-guard status\n"
        "INFO ... vLLM's own line\n"
        "```\n"
    )
    assert readme_log.quoted(text) == ["INFO ... vllm-capture-guard: a: patched (...)"]
    assert readme_log.release(["x on vLLM 0.27.0"]) == "0.27.0"
    assert readme_log.release(["x"]) is None
