# SPDX-License-Identifier: Apache-2.0
"""How a command says it could not run: exit status 2 and one line on stderr
(or one JSON object on stdout with ``--json``), never a traceback. Also: is
vLLM usable here?"""

from __future__ import annotations

import json
import sys

from vllm_capture_guard.runtime.plugin import PREFIX


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def vllm_problem(import_it: bool = True) -> str | None:
    """Why vLLM cannot be used in this Python, in one line; None if it is
    installed (and, with ``import_it``, imports)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm") is not None
    except Exception as e:
        return f"vLLM cannot be found: {one_line(e)}"
    if not found:
        return f"vLLM is not installed in this Python ({sys.executable})"
    if not import_it:
        return None
    try:
        import vllm  # noqa: F401
    except (Exception, SystemExit) as e:  # a broken install may exit on import
        return f"vLLM is installed but fails to import: {one_line(e)}"
    return None


#: The one prefix of every warning a command prints (on stderr).
WARNING = f"{PREFIX} warning: "


def warn(warnings: list[str]) -> None:
    """Each warning on one line on stderr, with :data:`WARNING` before it."""
    for text in warnings:
        print(WARNING + " ".join(text.split()), file=sys.stderr)


#: The exit status of a command that could not run, or could not judge.
CANNOT_JUDGE = 2


def could_not_run_json(command: str, reason: str) -> dict[str, object]:
    """The one JSON object of a command that could not run (docs/json.md)."""
    return {
        "ok": False,
        "command": command,
        "exit": CANNOT_JUDGE,
        "cannot_judge": True,
        "error": reason,
    }


def could_not_run(command: str, reason: str, as_json: bool) -> int:
    """Exit status 2 with one line on stderr saying why (with ``--json``: one
    JSON object on stdout, which is the result there)."""
    reason = " ".join(reason.split())  # one line, whatever the error held
    if as_json:
        print(json.dumps(could_not_run_json(command, reason)))
    else:
        print(f"{PREFIX} {command} could not run: {reason}", file=sys.stderr)
    return CANNOT_JUDGE
