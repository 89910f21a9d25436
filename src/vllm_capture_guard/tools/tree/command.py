# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard patch``: ``--check``, ``--diff``, ``--apply``,
``--revert`` on a vLLM tree.

Exit codes: ``--check`` 0 nothing to do (fixed upstream, or already carries
the in-tree fix), 1 the tree needs the fix, 2 the tree is not recognised.
``--diff``, ``--apply`` and ``--revert`` exit 0 when done (an empty diff and
a no-op count as done) and 2 when they refuse; a refusal writes nothing.
Findings and results go to stdout (with ``--diff``: to stderr, its stdout
is only the diff); every exit 2 gives its reason on one line on stderr.
``--check --json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Any, TextIO

from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.files import (
    SIDECAR,
    Change,
    WriteError,
    commit,
    find_stale_bytecode,
    preflight,
    recompile,
    remove_bytecode,
    sidecar,
    tree_lock,
)
from vllm_capture_guard.tools.tree.locate import Tree, TreeError, find_tree
from vllm_capture_guard.tools.tree.plan import (
    FILES,
    Plan,
    inspect_bytes,
    make_plan,
    read_tree,
)

HELP = """\
The in-tree form: write the backports into a vLLM tree (for image builders).

Exit codes:
  --check                      0 nothing to do (fixed upstream, or the tree
                               already carries the in-tree fix), 1 the tree
                               needs the fix, 2 the tree is not recognised
  --diff, --apply, --revert    0 done (an empty diff and a no-op count as
                               done), 2 refused; a refusal writes nothing

Findings and results go to stdout (with --diff: to stderr, its stdout is
only the diff); every exit 2 gives its reason on one line on stderr.
--json (with --check only): one JSON object on stdout, the reason of an
exit 2 included.
"""
PROG = "vllm-capture-guard patch"
MODES = ("check", "diff", "apply", "revert")


class Refused(Exception):
    """The command refuses; nothing was written."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "patch",
        help="the in-tree form: write the backports into a vLLM tree, for "
        "image builders (exit 0 done or nothing to do, 1 --check: needs the fix, "
        "2 not recognised)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # not required here: the CLI names an unknown option first (check_args)
    mode = p.add_mutually_exclusive_group()
    for name, text in (
        ("check", "exit 0 if nothing to do, 1 if the tree needs the fix, 2 if "
         "it is not recognised"),
        ("diff", "print the fix as a unified diff (for git apply / patch -p1)"),
        ("apply", "write the fix into the tree (original kept as *" + SIDECAR
         + ")"),
        ("revert", "undo --apply, byte for byte"),
    ):  # fmt: skip
        mode.add_argument(
            f"--{name}", dest="patch_mode", action="store_const", const=name, help=text
        )
    p.add_argument(
        "--tree",
        metavar="PATH",
        help="a vLLM source checkout (folder holding vllm/) or a vllm package "
        "folder; default: the vLLM this Python imports (not imported to find it)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="with --check: one JSON object on stdout (the findings and verdict)",
    )
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (argparse's way) without a mode, or with --json but not --check."""
    if args.patch_mode is None:
        parser.error("one of --check, --diff, --apply, --revert is required")
    if args.json and args.patch_mode != "check":
        parser.error(
            "--json goes with --check only (--diff prints the diff; --apply and "
            "--revert print what they wrote)"
        )


def _print_findings(plan: Plan, out: TextIO) -> None:
    print(f"vLLM tree: {plan.tree.describe()}", file=out)
    for f in plan.findings:
        print(f"  {f}", file=out)


def _unified(rel: str, old: bytes, new: bytes) -> bytes:
    lines = difflib.diff_bytes(
        difflib.unified_diff,
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=b"a/" + rel.encode(),
        tofile=b"b/" + rel.encode(),
    )
    out = []
    for line in lines:
        if not line.endswith((b"\n", b"\r")):
            line += b"\n\\ No newline at end of file\n"
        out.append(line)
    return b"".join(out)


def diff_bytes(plan: Plan) -> bytes:
    return b"".join(
        _unified(plan.tree.rel(inside), plan.data[inside] or b"", new)
        for inside, new in plan.new.items()
    )


def _unrecognised(plan: Plan) -> str:
    return "; ".join(f"{f.rel}: {f.detail}" for f in plan.refused)


def _refuse_if_unrecognised(plan: Plan) -> None:
    if plan.refused:
        raise Refused(f"not recognised, nothing written: {_unrecognised(plan)}")


def _write(tree: Tree, changes: list[Change], sources: list[str]) -> list[str]:
    """Commit ``changes`` all or nothing; refresh the bytecode of
    ``sources`` (files inside the package). Returns notes for the user."""
    paths = [tree.path(inside) for inside in sources]
    preflight(changes, paths)
    stale = {p: find_stale_bytecode(p) for p in paths}
    commit(changes)  # all or nothing: a refusal has removed no bytecode yet
    notes = []
    for path, found in stale.items():
        gone = remove_bytecode(found)
        if gone:
            again = recompile(path, gone)
            notes.append(
                f"  {len(gone)} stale bytecode file(s) of {path.name} removed"
                + (f"; compiled again: {', '.join(again)}" if again else "")
            )
    return notes


def apply(tree: Tree) -> int:
    plan = make_plan(tree)
    _print_findings(plan, sys.stdout)
    _refuse_if_unrecognised(plan)
    if not plan.needed:
        print("nothing to do: the tree is already fixed")
        return 0
    changes = []
    for inside, new in plan.new.items():
        path = tree.path(inside)
        changes.append(Change(sidecar(path), plan.data[inside], like=path))
        changes.append(Change(path, new))
    notes = _write(tree, changes, list(plan.new))
    for inside in plan.new:
        kept = tree.rel(inside) + SIDECAR
        print(f"patched {tree.rel(inside)} (original kept as {kept})")
    if notes:
        print("\n".join(notes))
    return 0


def revert(tree: Tree) -> int:
    data = read_tree(tree)
    originals = {}
    for inside in FILES:
        saved = sidecar(tree.path(inside))
        if saved.is_file():
            originals[inside] = saved.read_bytes()
    findings = inspect_bytes(tree, data)
    print(f"vLLM tree: {tree.describe()}")
    orphans = [
        f
        for f, inside in zip(findings, FILES, strict=True)
        if f.state == model.APPLIED and inside not in originals
    ]
    if orphans:
        raise Refused(
            f"{orphans[0].rel} carries the fix but has no saved original "
            f"(*{SIDECAR}): it was not patched by --apply; reverse the diff "
            f"that patched it (git apply -R)"
        )
    if not originals:
        print("nothing to revert: no file was patched by --apply")
        return 0
    expected = make_plan(tree, {**data, **originals})
    _refuse_if_unrecognised(expected)
    changes, restored = [], []
    for inside, original in originals.items():
        path = tree.path(inside)
        if data[inside] != original:
            if expected.new.get(inside) != data[inside]:
                raise Refused(
                    f"{tree.rel(inside)} is not what --apply made of "
                    f"{sidecar(path).name} (changed since?); not reverting"
                )
            changes.append(Change(path, original))
            restored.append(inside)
        changes.append(Change(sidecar(path), None))
    notes = _write(tree, changes, restored)
    for inside in restored:
        print(f"restored {tree.rel(inside)} byte for byte")
    if notes:
        print("\n".join(notes))
    return 0


VERDICTS = (
    "nothing to do",
    f"the tree needs the fix ({PROG} --apply, or --diff)",
    "not recognised; nothing would be written",
)


def _refusal(text: str) -> None:
    """An exit 2's reason: one line on stderr."""
    print(" ".join(text.split()), file=sys.stderr)


def check_json(plan: Plan) -> dict[str, Any]:
    """``--check --json``: the findings and the verdict."""
    code = plan.check_code
    out: dict[str, Any] = {
        "ok": code != 2,
        "command": "patch --check",
        "tree": plan.tree.describe(),
        "exit": code,
        "cannot_judge": code == 2,
        "verdict": VERDICTS[code].split(" (")[0],
        "findings": [
            {"fix": f.fix, "pr": f.pr, "file": f.rel, "state": str(f.state),
             "detail": f.detail}
            for f in plan.findings
        ],
    }  # fmt: skip
    if code == 2:
        out["error"] = f"not recognised: {_unrecognised(plan)}"
    return out


def run(args: argparse.Namespace) -> int:
    mode, as_json = args.patch_mode, getattr(args, "json", False)
    out = sys.stderr if mode == "diff" else sys.stdout
    try:
        tree = find_tree(args.tree)
        if mode == "check":
            plan = make_plan(tree)
            code = plan.check_code
            if as_json:
                print(json.dumps(check_json(plan), indent=2))
                return code
            _print_findings(plan, out)
            print(f"verdict: {VERDICTS[code]}", file=out)
            if code == 2:
                _refusal(f"{PROG}: not recognised: {_unrecognised(plan)}")
            return code
        if mode == "diff":
            plan = make_plan(tree)
            _print_findings(plan, out)
            _refuse_if_unrecognised(plan)
            sys.stdout.flush()
            sys.stdout.buffer.write(diff_bytes(plan))
            sys.stdout.flush()
            return 0
        with tree_lock(tree.package):  # concurrent runs, one after the other
            return apply(tree) if mode == "apply" else revert(tree)
    except (TreeError, Refused, WriteError) as e:
        why = f"{PROG}: refused: {e}"
    except OSError as e:  # a file we cannot read: not "needs the fix"
        why = f"{PROG}: could not read the tree: {e}"
    if as_json:
        from vllm_capture_guard.tools.failure import could_not_run_json

        print(json.dumps(could_not_run_json("patch --check", why)))
    else:
        _refusal(why)
    return 2


def verdict(tree: Tree | None = None) -> dict[str, Any]:
    """The in-tree patch on a tree (default: this Python's vLLM), for the
    version matrix: ``applies`` / ``nothing to do`` / ``refused``."""
    try:
        plan = make_plan(tree or find_tree())
    except TreeError as e:
        return {"verdict": "refused", "fixes": {}, "detail": str(e)}
    word = ("nothing to do", "applies", "refused")[plan.check_code]
    fixes: dict[str, list[model.State]] = {}
    for f in plan.findings:
        fixes.setdefault(f.fix, []).append(f.state)
    return {
        "verdict": word,
        "fixes": {fix: model.combined(states) for fix, states in fixes.items()},
        "detail": plan.refused[0].detail if plan.refused else "",
    }


def status_line(tree: Tree | None = None) -> str:
    """One line for ``vllm-capture-guard status``, from the marker scan: each
    fix once, however many files it spans."""
    try:
        plan = make_plan(tree or find_tree())
    except TreeError as e:
        return f"not checked ({e})"
    fixes: dict[str, list[model.Finding]] = {}
    for f in plan.findings:
        fixes.setdefault(f.fix, []).append(f)
    states = {f.state for f in plan.findings}
    prs = ", ".join(
        dict.fromkeys(f"PR {f.pr}" for f in plan.findings if f.state == model.APPLIED)
    )
    if model.APPLIED in states and states <= {
        model.APPLIED,
        model.UPSTREAM,
        model.ABSENT,
    }:
        return f"yes: this vLLM's files carry the backports ({prs})"
    if states <= {model.UPSTREAM, model.ABSENT}:
        return "not needed: this vLLM's files are fixed upstream"
    parts = []
    for fix, found in fixes.items():
        state = model.combined([f.state for f in found])
        files = f", {len(found)} files" if len(found) > 1 else ""
        parts.append(f"{fix}: {state}{files}")
    return "no (" + "; ".join(parts) + f"; `{PROG} --check` names the files)"
