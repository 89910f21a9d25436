# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard``: is this vLLM affected by either start-up failure
(the MiniMax-M3 indexer's ``assert decode_query_len > 0``, and AITER's
split-K workspace on torch's side stream), is the guard active, and does
capture now get past both?

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
Two start-up failures of vLLM 0.27.x / 0.28.0 in full CUDA-graph capture,
fixed without rebuilding vLLM:
  MiniMax-M3 with ROCM_ATTN or ROCM_AITER_UNIFIED_ATTN: "assert
    decode_query_len > 0" in vllm/models/minimax_m3/common/indexer.py
    (upstream PRs #51585, #53821);
  Kimi-K3 / Model Runner V2 on AITER: "splitk workspace not initialized for
    the current CUDA stream" (capture on torch's side stream; PR #53818).
Is this vLLM affected, is the guard active, and does capture now get past
both?

Exit codes:
  0  status: protected or not affected; check passes; audit finds no shared
     CPU write; patch done or nothing to do
  1  status: affected and not protected; check: a failure would remain;
     audit: a capture writes shared CPU metadata; patch --check: the tree
     needs the fix
  2  could not run or could not judge (vLLM not installed or not
     importable, a release outside the supported range, an unknown option
     or --backend, a check or a fix that could not run or be read on this
     host, no backend built, or another error); patch: the tree is not
     recognised, or the change was refused; the reason is printed on one
     line on stderr

--json (one JSON object on stdout) is taken by status, check, audit and
patch --check. Every object carries "exit" (the exit status) and
"cannot_judge" (true exactly where it is 2, with the reason in "error").
Warnings go to stderr, each after "vllm-capture-guard warning:".

Every command of status, check and audit prints the same "guard:" line:
loaded by vLLM's plugin loader or not (and why), the mode, and whether it
acts on this host or, in check and audit, only simulates the ROCm path.
"""

#: Per command: (one-line help with its exit codes, ``--help`` description).
COMMANDS = {
    "status": (
        "is this vLLM affected, and protected? (exit 0 yes or not affected, "
        "1 affected and not protected, 2 cannot judge or error)",
        "Print the vLLM version, the platform, which fixes this vLLM needs (read\n"
        "from its source), whether the guard is loaded and would apply them, and\n"
        "one verdict: protected: yes, no (why), not affected, or cannot judge\n"
        "(why). Off ROCm, under auto, it judges the ROCm path as check does. It\n"
        "reads this shell's VLLM_PLUGINS and VLLM_CAPTURE_GUARD*, which may\n"
        "differ from the server's.\n\n"
        "Exit codes: 0 protected, or not affected; 1 affected and not protected;\n"
        "2 cannot judge (a fix's code could not be read here and the guard does\n"
        "not install it here), or vLLM is not installed or does not import\n"
        "(one-line reason).",
    ),
    "check": (
        "both start-up failures on vLLM's own code (exit 0 pass, 1 fail, 2 cannot "
        "judge or error)",
        "Judge every failure the guard fixes, on this vLLM's own code (CPU):\n"
        "  the MiniMax-M3 indexer after ROCM_ATTN and ROCM_AITER_UNIFIED_ATTN,\n"
        "    at every capture size vLLM derives for the config (512 down to 1),\n"
        "    one builder per KV-cache group, in the model runner's order;\n"
        "  ROCM_AITER_UNIFIED_ATTN keeps the query offsets its kernel reads;\n"
        "  capture on vLLM's current stream at Model Runner V2's, the encoder's\n"
        "    and Gemma4's capture sites (a recording torch.cuda.graph).\n"
        "The guard is loaded through vLLM's own plugin loader, so VLLM_PLUGINS\n"
        "and VLLM_CAPTURE_GUARD* apply as in `vllm serve`; on a host that is\n"
        "not ROCm, auto counts as on and the ROCm path is simulated (the guard\n"
        "line says so). A PASS does not show that AITER's kernels are satisfied\n"
        "on a GPU, nor a vendor runner's own host fields.\n\n"
        "Exit codes: 0 every check ran and passes; 1 a failure would remain\n"
        "(named); 2 cannot judge: a check did not run on this host (named), or\n"
        "check could not run at all (one-line reason on stderr; a vLLM without\n"
        "MiniMax-M3 is outside the supported range).",
    ),
    "audit": (
        "every backend's capture vs shared metadata (exit 0 clean, 1 hazard, 2 error)",
        "Every registered attention backend: does its full-graph capture write\n"
        "shared metadata that later builders read? The guard is loaded as in\n"
        "`check`. Writes a cache of vLLM's model inspection under\n"
        "~/.cache/vllm-capture-guard (VLLM_CACHE_ROOT overrides it).\n\n"
        "Exit codes: 0 no capture of a built backend writes shared CPU metadata\n"
        "(the others are listed as skipped); 1 one does; 2 the audit could not\n"
        "run, built no backend, or a --backend name is unknown (one-line reason\n"
        "on stderr, with the valid names).",
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
    # not required here: main() names an unknown option before a missing
    # COMMAND (argparse would say only that COMMAND is missing)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    parsers["check"].add_argument(
        "--trace",
        action="store_true",
        help="print every capture size's record too, as JSON (implies --json; "
        "large: for comparing runs)",
    )
    parsers["audit"].add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="audit only this registry name (repeatable); default: all",
    )
    from vllm_capture_guard.tools.tree import command as tree_command

    parser.patch = tree_command.add_parser(sub)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; an unknown option is named (exit 2), then a missing
    COMMAND or patch mode."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.error(f"a COMMAND is required: {', '.join([*COMMANDS, 'patch'])}")
    if args.command == "patch":
        from vllm_capture_guard.tools.tree import command as tree_command

        tree_command.check_args(parser.patch, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.json = args.json or getattr(args, "trace", False)
    try:
        return _run(args)
    except Exception as e:  # a bug of ours: exit 2 with its reason, never 1
        name = "patch --check" if args.command == "patch" else args.command
        return could_not_run(name, one_line(e), args.json)


def _run(args: argparse.Namespace) -> int:
    if args.command == "patch":  # reads files only: no vLLM import
        from vllm_capture_guard.tools.tree import command as tree_command

        return tree_command.run(args)
    quiet_vllm(getattr(args, "verbose", False))
    if args.command == "check":  # before torch and vLLM are imported
        hide_gpus()
        with contextlib.suppress(ImportError):  # no torch: said just below
            from vllm_capture_guard.tools.simulate import use_triton_interpreter

            use_triton_interpreter()  # vLLM decides whether it has Triton
    # audit points vLLM's cache elsewhere before vLLM is imported
    problem = vllm_problem(import_it=args.command != "audit")
    if problem:
        return could_not_run(args.command, problem, args.json)
    if getattr(args, "verbose", False):
        log_as_vllm_serve()
    try:
        command = importlib.import_module(MODULES[args.command])
    except Exception as e:  # torch or numpy missing, or vLLM broken
        return could_not_run(args.command, vllm_problem() or one_line(e), args.json)
    if args.command == "audit":
        return command.main(args.json, args.backend)
    if args.command == "check":
        return command.main(args.json, args.trace)
    return command.main(args.json)


#: What hides a host's GPUs from a process, on CUDA and on ROCm.
VISIBLE = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def hide_gpus() -> None:
    """``check`` runs on the CPU on any host (its harness makes no kernel run,
    and it must never touch a serving GPU): its own process sees no GPU."""
    for name in VISIBLE:
        os.environ[name] = ""


def log_as_vllm_serve() -> None:
    """vLLM's logging set up as ``vllm serve`` sets it up: releases that
    configure it lazily, in the launcher (0.33 on), would show none of
    vLLM's (or the guard's) lines under ``-v`` otherwise."""
    try:
        from vllm.logger import configure_logging_from_args
    except ImportError:  # configured when vllm.logger is imported (to 0.29)
        return
    with contextlib.suppress(Exception):
        configure_logging_from_args(argparse.Namespace())


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
