# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard``: is this vLLM affected, is the guard active, and does
capture now get past the metadata builders?

This module is the argument parser only; each command lives in its own
module (:mod:`.status`, :mod:`.check`, :mod:`.audit.command`,
:mod:`.tree.command`). Exit codes are in :data:`DESCRIPTION`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import warnings

from vllm_capture_guard import __version__
from vllm_capture_guard.tools.failure import could_not_run, one_line, vllm_problem

#: ``--help`` text: plain, for a terminal (the module docstring is for Sphinx).
DESCRIPTION = """\
Is this vLLM affected by the ROCm full CUDA-graph capture bug (MiniMax-M3,
ROCM_ATTN / ROCM_AITER_UNIFIED_ATTN, "assert decode_query_len > 0"), is the
guard active, and does capture now get past vLLM's metadata builders?

Exit codes:
  0  status printed; check passes; audit finds no shared CPU write; patch
     done or nothing to do
  1  check: startup would still fail; audit: a capture writes shared CPU
     metadata; patch --check: the tree needs the fix
  2  could not run (vLLM not installed or not importable, a release outside
     the supported range, an unknown --backend, or another error); patch:
     the tree is not recognised, or the change was refused; the reason is
     printed on one line on stderr, or as {"ok": false, "error": ...} with
     --json

Every command of status, check and audit prints the same "guard:" line:
loaded by vLLM's plugin loader or not (and why), the mode, and whether it
acts on this host or, in check and audit, only simulates the ROCm path.
"""

#: Per command: (one-line help with its exit codes, ``--help`` description).
COMMANDS = {
    "status": (
        "vLLM version, platform, affected?, guard active? (exit 0; 2: no vLLM)",
        "Print the vLLM version, the platform, whether this vLLM is affected and\n"
        "whether the guard is active in it.\n\n"
        "Exit codes: 0 printed; 2 vLLM is not installed or does not import\n"
        "(one-line reason).",
    ),
    "check": (
        "MiniMax-M3 capture on real vLLM builders (exit 0 pass, 1 fail, 2 error)",
        "Run the MiniMax-M3 full-graph capture sequence on this vLLM's own\n"
        "metadata builders (CPU), at every capture size vLLM derives for the\n"
        "config (512 down to 1), one builder per KV-cache group, in the model\n"
        "runner's order. The guard is loaded through vLLM's own plugin loader,\n"
        "so VLLM_PLUGINS and VLLM_CAPTURE_GUARD apply as in `vllm serve`; on a\n"
        "host that is not ROCm, auto counts as on and the ROCm path is\n"
        "simulated (the guard line says so).\n\n"
        "Exit codes: 0 capture gets past every metadata builder; 1 startup\n"
        "would still fail; 2 the check could not run (one-line reason on\n"
        "stderr; a vLLM without MiniMax-M3 is outside the supported range).",
    ),
    "audit": (
        "every backend's capture vs shared metadata (exit 0 clean, 1 hazard, 2 error)",
        "Every registered attention backend: does its full-graph capture write\n"
        "shared metadata that later builders read? The guard is loaded as in\n"
        "`check`. Writes a cache of vLLM's model inspection under\n"
        "~/.cache/vllm-capture-guard (VLLM_CACHE_ROOT overrides it).\n\n"
        "Exit codes: 0 no capture writes shared CPU metadata; 1 one does;\n"
        "2 the audit could not run, or a --backend name is unknown (one-line\n"
        "reason on stderr, with the valid names).",
    ),
}


#: The module that runs each command (its ``main(as_json, ...)``).
MODULES = {
    "status": "vllm_capture_guard.tools.status",
    "check": "vllm_capture_guard.tools.check",
    "audit": "vllm_capture_guard.tools.audit.command",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-capture-guard",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {
        name: sub.add_parser(
            name,
            help=text,
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for name, (text, description) in COMMANDS.items()
    }
    for p in parsers.values():
        p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    for name in ("check", "audit"):
        parsers[name].add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="also show vLLM's own log lines and Python warnings (on stderr)",
        )
    parsers["audit"].add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="audit only this registry name (repeatable); default: all",
    )
    from vllm_capture_guard.tools.tree import command as tree_command

    tree_command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "patch":  # reads files only: no vLLM import
        from vllm_capture_guard.tools.tree import command as tree_command

        return tree_command.run(args)
    quiet_vllm(getattr(args, "verbose", False))
    # audit points vLLM's cache elsewhere before vLLM is imported
    problem = vllm_problem(import_it=args.command != "audit")
    if problem:
        return could_not_run(args.command, problem, args.json)
    try:
        command = importlib.import_module(MODULES[args.command])
    except Exception as e:  # torch or numpy missing, or vLLM broken
        return could_not_run(args.command, vllm_problem() or one_line(e), args.json)
    if args.command == "audit":
        return command.main(args.json, args.backend)
    return command.main(args.json)


class _Stream:
    """``sys.stdout`` or ``sys.stderr``, whichever it is when written to."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(text)

    def flush(self) -> None:
        getattr(sys, self.name).flush()


def quiet_vllm(verbose: bool) -> None:
    """Keep vLLM's own log lines out of the result (before vLLM is imported).

    stdout is the command's: vLLM logs to stdout by default, so its lines go
    to stderr. Without ``-v`` none of vLLM's lines are shown (a failure is
    the command's one-line reason), and Python
    warnings and torch's own warning lines (deprecations) are silenced; the
    guard's own warnings are part of the result, and the command prints
    them. A ``VLLM_LOGGING_LEVEL`` or ``VLLM_LOGGING_STREAM`` the caller set
    wins."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    default = "INFO" if verbose else "CRITICAL"
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", default)
    # Releases that configure vLLM's logging lazily (0.33: in the launcher)
    # leave the "vllm" logger bare, and Python's last-resort handler would
    # print its warnings; give it the same level.
    with contextlib.suppress(ValueError, TypeError):
        logging.getLogger("vllm").setLevel(level.upper())
    # A vLLM imported before the command (a Python session) has configured
    # its handler already: point it where the variable says, read when it
    # writes (sys.stderr may be replaced later, as pytest does).
    name = {"ext://sys.stderr": "stderr", "ext://sys.stdout": "stdout"}.get(
        os.environ["VLLM_LOGGING_STREAM"]
    )
    for handler in logging.getLogger("vllm").handlers:
        if name is not None and isinstance(handler, logging.StreamHandler):
            handler.setStream(_Stream(name))
    if not verbose:
        os.environ.setdefault("TORCH_LOGS", "-all")  # torch's deprecation lines
        warnings.filterwarnings("ignore")
        # inherited by the subprocess that inspects the model class
        os.environ.setdefault("PYTHONWARNINGS", "ignore")


if __name__ == "__main__":
    sys.exit(main())
