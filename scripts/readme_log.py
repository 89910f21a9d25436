#!/usr/bin/env python
# SPDX-License-Identifier: Apache-2.0
"""The guard's log lines that the README and docs/log.md quote by hand,
against a real run, so that a quoted line cannot drift from what the guard
logs.

A quoted line is a line of a fenced code block that starts with a log level
and ``...`` and holds ``vllm-capture-guard:``, such as::

    INFO ... vllm-capture-guard: builder-capture-guard: patched (...) on vLLM 0.28.0

Each ``...`` in it stands for any text (vLLM's time, file and line, or a
part left out). The run is ``VLLM_CAPTURE_GUARD=on vllm-capture-guard check
-v`` in a new process on the vLLM of this interpreter (the venv's: the
release ``make env`` builds), with the model runner vLLM chooses for the tiny
MiniMax-M3. Its guard lines (those holding ``vllm-capture-guard:``) are
kept in the order logged, each time written ``...``. Every quoted line must
match one of them, whole.

    python scripts/readme_log.py            # print the run's guard lines
    python scripts/readme_log.py --check    # exit 1 if a quoted line is not among them

``tests/test_readme_log.py`` asks the same of a run in a new process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The pages whose quoted log lines are checked.
PAGES = (ROOT / "README.md", ROOT / "docs" / "log.md")
GUARD_LOG = "vllm-capture-guard:"
#: The command, as the pages show it, and as this script runs it.
SHOWN = "VLLM_CAPTURE_GUARD=on vllm-capture-guard check -v"
ARGS = ["-m", "vllm_capture_guard", "check", "-v"]
#: The environment of the run: the guard on, every patch in, vLLM's choice of
#: runner, vLLM's INFO lines where ``-v`` sends them. ``None``: unset.
ENV: dict[str, str | None] = {
    "VLLM_CAPTURE_GUARD": "on",
    "VLLM_CAPTURE_GUARD_DISABLE": None,
    "VLLM_PLUGINS": None,
    "VLLM_USE_V2_MODEL_RUNNER": None,
    "VLLM_LOGGING_LEVEL": None,
    "VLLM_LOGGING_STREAM": None,
    "HF_HUB_OFFLINE": "1",
}
#: vLLM's log prefix: level, then month-day and time.
TIME = re.compile(r"^([A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? ")
#: A quoted line: a level, ``...`` for the time, then the rest.
QUOTED = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR) \.\.\. ")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.S | re.M)
#: The release a quoted line names (the patch lines end so).
NAMED = re.compile(r" on vLLM (\d+\.\d+\.\d+)\b")
ELIDED = "..."


def normal(line: str) -> str:
    """``line`` with vLLM's time written ``...`` (a line without one, or
    already written so, is returned as it is)."""
    return TIME.sub(r"\1 ... ", line.rstrip())


def quoted(text: str) -> list[str]:
    """The guard's log lines that ``text`` quotes in its code blocks."""
    return [
        line.rstrip()
        for block in FENCE.findall(text)
        for line in block.splitlines()
        if QUOTED.match(line) and GUARD_LOG in line
    ]


def pattern(line: str) -> re.Pattern[str]:
    """A quoted line as a pattern: each ``...`` any text, the rest as it is."""
    return re.compile(".*?".join(map(re.escape, line.split(ELIDED))))


def missing(wanted: list[str], logged: list[str]) -> list[str]:
    """The quoted lines that match no logged line, whole."""
    return [w for w in wanted if not any(pattern(w).fullmatch(g) for g in logged)]


def release(lines: list[str]) -> str | None:
    """The vLLM release the quoted lines name, if they name one."""
    return next((m[1] for m in map(NAMED.search, lines) if m), None)


def guard_lines(stdout: str, stderr: str) -> list[str]:
    """The guard's log lines of one run, times written ``...``."""
    lines = [normal(line) for line in (stderr + "\n" + stdout).splitlines()]
    logged = [line for line in lines if GUARD_LOG in line]
    if not logged:
        raise ValueError(f"check -v logged no guard line:\n{stderr[-3000:]}")
    return logged


def run() -> list[str]:
    """:func:`guard_lines` of a run in a new process (see the module)."""
    env = dict(os.environ)
    for key, value in ENV.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = subprocess.run(
        [sys.executable, *ARGS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"check exited {proc.returncode}:\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
    try:
        return guard_lines(proc.stdout, proc.stderr)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if a quoted line is not in what the run logs",
    )
    args = parser.parse_args()
    logged = run()
    if not args.check:
        print("\n".join(logged))
        return 0
    bad = 0
    for page in PAGES:
        wanted = quoted(page.read_text())
        for line in missing(wanted, logged):
            print(f"{page.relative_to(ROOT)}: not in what `{SHOWN}` logs: {line}")
            bad += 1
    if bad:
        print("what it logs:\n" + "\n".join(logged))
        return 1
    print("every quoted guard line is in what this run logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
