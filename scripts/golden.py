# SPDX-License-Identifier: Apache-2.0
"""Golden output: what the operator's commands print, on a few releases, with
times and paths taken out, so that a refactor can show it changed nothing.

    python scripts/golden.py DIR [VERSION ...]   (default: 0.27.0 0.28.0 0.34.0)
    diff -ru OLD_DIR NEW_DIR

Each command's file holds its exit status, its stdout and the guard's own
stderr lines (a log line as its level and its text after
``vllm-capture-guard:``, so that a moved line, which changes vLLM's
``[file:line]`` prefix, reads the same).

For an older commit, run this script from a checkout of that commit with its
own venv (``git worktree add DIR COMMIT``, copy this file there, ``make env``),
so that its own code prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("0.27.0", "0.28.0", "0.34.0")
COMMANDS = {
    "status": ["status"],
    "status-json": ["status", "--json"],
    "check": ["check"],
    "check-verbose": ["check", "-v"],
    "check-json": ["check", "--json"],
    "audit-json": ["audit", "--json"],
    "patch-check": ["patch", "--check"],
    "patch-check-json": ["patch", "--check", "--json"],
}
#: Times vary from run to run: "16 s", "0.53 s", "2.1 ms", "12.5s" in text, and
#: the JSON keys that hold seconds.
TIME = re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|s)\b")
JSON_TIME = re.compile(r'("(?:[a-z_]*seconds|[a-z_]*_s|wall[a-z_]*)": )[0-9.e-]+')
OURS = "vllm-capture-guard"


def normalise(text: str, paths: dict[str, str]) -> str:
    for path, name in sorted(paths.items(), key=lambda p: -len(p[0])):
        text = text.replace(path, name)
    return TIME.sub("<time>", JSON_TIME.sub(r"\1<time>", text))


#: vLLM's log prefix: its level, then the date, time and ``[file:line]``.
VLLM_PREFIX = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \S+ \[[^]]+\] ")


def ours(stderr: str) -> str:
    """The guard's own stderr lines: a log line as its level and its text after
    our name (a moved line changes only the ``[file:line]`` taken out)."""
    lines = []
    for line in stderr.splitlines():
        if OURS not in line:
            continue
        level = VLLM_PREFIX.match(line)
        text = line[line.index(OURS) :].removeprefix(f"{OURS}: ")
        lines.append(f"{level.group(1)} {text}" if level else text)
    return "\n".join(lines)


def run(version: str, args: list[str], envs: Path) -> str:
    python, cli = ROOT / ".venv/bin/python", ROOT / ".venv/bin/vllm-capture-guard"
    command = [str(ROOT / "scripts/with-vllm.sh"), str(python), str(envs), version]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [*command, str(cli), *args], capture_output=True, text=True, env=env
    )
    paths = {str(envs): "<envs>", str(ROOT): "<repo>", str(Path.home()): "<home>"}
    stdout = "\n".join(
        line for line in done.stdout.splitlines() if not line.startswith("== vLLM ")
    )
    return normalise(
        f"exit: {done.returncode}\n--- stdout\n{stdout}\n--- stderr\n"
        f"{ours(done.stderr)}\n",
        paths,
    )


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, versions = Path(sys.argv[1]), sys.argv[2:] or VERSIONS
    envs = Path(os.environ.get("CAPTURE_GUARD_ENVS", ROOT / ".envs")).resolve()
    for version in versions:
        (out / version).mkdir(parents=True, exist_ok=True)
        for name, args in COMMANDS.items():
            (out / version / f"{name}.txt").write_text(run(version, args, envs))
            print(f"golden: vLLM {version} {' '.join(args)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
