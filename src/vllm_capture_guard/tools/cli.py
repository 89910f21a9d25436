# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard``: is this vLLM affected, is the guard active, and does
capture now get past the metadata builders?

Exit codes: ``status`` 0; ``check`` 0 if every capture sequence passes, 1 if
startup would still fail, 2 if the check could not run; ``audit`` 0 if no
backend's capture writes shared CPU metadata, 1 if one does, 2 if it could not
run.

This module is the argument parser only; each command lives in its own
module (:mod:`.status`, :mod:`.check`, :mod:`.audit.command`).
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm_capture_guard import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-capture-guard", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="vLLM version, platform, affected?, guard active?")
    p_check = sub.add_parser(
        "check", help="run the MiniMax-M3 capture scenario on real vLLM builders"
    )
    p_check.add_argument("--json", action="store_true", help="machine-readable")
    p_audit = sub.add_parser(
        "audit",
        help="every registered attention backend: does its capture write "
        "shared metadata that later builders read?",
    )
    p_audit.add_argument("--json", action="store_true", help="machine-readable")
    p_audit.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="audit only this registry name (repeatable); default: all",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The verdict is ours to print; vLLM's INFO chatter would bury it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.command == "status":
        from vllm_capture_guard.tools.status import main as status

        return status()
    if args.command == "audit":
        from vllm_capture_guard.tools.audit.command import main as audit

        return audit(args.json, args.backend)
    from vllm_capture_guard.tools.check import main as check

    return check(args.json)


if __name__ == "__main__":
    sys.exit(main())
