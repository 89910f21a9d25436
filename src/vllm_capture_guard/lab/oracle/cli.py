# SPDX-License-Identifier: Apache-2.0
"""Differential oracle: does capture on a patched vLLM behave exactly as on
upstream's fixed release?

Our promise is "on an affected install, capture behaves exactly as in 0.29.0".
The oracle checks it against 0.29.0 itself instead of against our reading of
it: ``record`` (:mod:`.record`) runs the seed scenario in one release's
environment and writes what happened as JSON; ``compare`` (:mod:`.compare`)
puts two records side by side, field by field; ``run`` records in each
release's environment (:mod:`.releases`), then compares.

Commands (exit 0 when every candidate matches, 1 when one differs)::

    python -m vllm_capture_guard.lab.oracle record --out 0.28.0.json
    python -m vllm_capture_guard.lab.oracle compare 0.29.0.json 0.28.0.json
    python -m vllm_capture_guard.lab.oracle run --reference 0.29.0 \\
        --candidate 0.28.0 --candidate 0.27.1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_capture_guard.lab.oracle import releases
from vllm_capture_guard.lab.oracle.compare import compare
from vllm_capture_guard.runtime import switch

REFERENCE = "0.29.0"
CANDIDATES = ("0.28.0", "0.27.1")
MODULE = "vllm_capture_guard.lab.oracle"


def record_in(
    version: str,
    out: str | os.PathLike,
    mode: str,
    envs: str | os.PathLike | None = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """``record`` in a fresh interpreter against vLLM ``version``."""
    proc = releases.run_in(
        version,
        ["-m", MODULE, "record", "--out", str(out)],
        {switch.ENV: mode},
        envs,
        timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"oracle record on vLLM {version} failed ({proc.returncode}):\n"
            + (proc.stdout + proc.stderr)[-4000:]
        )
    result = json.loads(Path(out).read_text())
    problem = releases.wrong_release(version, result["vllm"])
    if problem:
        raise RuntimeError(problem)
    return result


HELP = """\
The differential oracle: patched releases against upstream's fixed one.

Exit codes:
  0  recorded; every candidate MATCHES the reference
  1  a candidate DIFFERS from the reference
  2  could not run (a release's environment missing, vLLM failing, ...)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_rec = sub.add_parser(
        "record", help="record this vLLM's capture as JSON (exit 0; 2 error)"
    )
    p_rec.add_argument("--out", required=True)
    p_cmp = sub.add_parser(
        "compare",
        help="candidates against a reference record (exit 0 match, 1 differ, 2 error)",
    )
    p_cmp.add_argument("reference")
    p_cmp.add_argument("candidates", nargs="+")
    p_run = sub.add_parser(
        "run",
        help="record in each release's env, compare (exit 0 match, 1 differ, 2 error)",
    )
    p_run.add_argument("--reference", default=REFERENCE)
    p_run.add_argument("--candidate", action="append", dest="candidates")
    p_run.add_argument("--mode", default="on", help="guard mode on the candidates")
    p_run.add_argument(
        "--envs", default=None, help=f"default ${releases.ENVS_VAR} or .envs"
    )
    p_run.add_argument("--keep", default=None, help="folder to keep the records in")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except Exception as e:  # never a traceback that reads as "differs"
        from vllm_capture_guard.tools.failure import one_line

        print(f"oracle {args.command} could not run: {one_line(e)}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.command == "record":
        from vllm_capture_guard.lab.oracle.record import record

        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        result = record()
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(
            f"recorded {len(result['cases'])} cases on vLLM {result['vllm']} "
            f"(guard: {result['guard']}) -> {args.out}"
        )
        return 0
    if args.command == "compare":
        reference = json.loads(Path(args.reference).read_text())
        results = [
            compare(reference, json.loads(Path(c).read_text())) for c in args.candidates
        ]
    else:
        folder = Path(args.keep or tempfile.mkdtemp(prefix="capture-guard-oracle-"))
        folder.mkdir(parents=True, exist_ok=True)
        ref_out = folder / f"{args.reference}-off.json"
        reference = record_in(args.reference, ref_out, "off", args.envs)
        results = []
        for version in args.candidates or CANDIDATES:
            out = folder / f"{version}-{args.mode}.json"
            results.append(
                compare(reference, record_in(version, out, args.mode, args.envs))
            )
    for result in results:
        print(result.report())
    return 0 if all(r.ok for r in results) else 1
