# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard``: is this vLLM affected, is the guard active, and does
capture now get past the metadata builders?

Exit codes: ``status`` 0, 2 if vLLM cannot be imported; ``check`` 0 if every
capture sequence passes, 1 if startup would still fail, 2 if the check could
not run; ``audit`` 0 if no backend's capture writes shared CPU metadata, 1 if
one does, 2 if it could not run. With ``--json`` each prints one JSON object,
also when it could not run (``{"ok": false, "error": ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from vllm_capture_guard import __version__
from vllm_capture_guard.runtime.plugin import PREFIX
from vllm_capture_guard.runtime.switch import ENV, loaded_by_vllm, read_mode

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "capture_guard"


def _entry_point() -> Any:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == ENTRY_POINT_NAME:
            return ep
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _vllm_problem(import_it: bool = True) -> str | None:
    """Why vLLM cannot be used in this Python, in one line; None if it is
    installed (and, with ``import_it``, imports)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm") is not None
    except Exception as e:
        return f"vLLM cannot be found: {_one_line(e)}"
    if not found:
        return f"vLLM is not installed in this Python ({sys.executable})"
    if not import_it:
        return None
    try:
        import vllm  # noqa: F401
    except (Exception, SystemExit) as e:  # a broken install may exit on import
        return f"vLLM is installed but fails to import: {_one_line(e)}"
    return None


def _could_not_run(command: str, reason: str, as_json: bool) -> int:
    """Exit status 2 with one line (or one JSON object) saying why."""
    if as_json:
        print(json.dumps({"ok": False, "command": command, "error": reason}))
    else:
        print(f"{PREFIX} {command} could not run: {reason}")
    return 2


def _status_facts() -> dict[str, Any]:
    from vllm_capture_guard.runtime.patches import PATCHES, Status
    from vllm_capture_guard.runtime.plugin import platform_name, vllm_version

    mode, problem = read_mode()
    is_rocm, platform = platform_name()
    patches = []
    for patch in PATCHES:
        try:
            found = patch.inspect()
        except Exception as e:
            error = _one_line(e)
            patches.append({"name": patch.name, "status": "error", "detail": error})
            continue
        patches.append(
            {"name": patch.name, "status": str(found.status), "detail": found.detail}
        )
    affected = {str(Status.NEEDED), str(Status.PATCHED), str(Status.ALREADY)}
    needed = [p["name"] for p in patches if p["status"] in affected]
    from vllm_capture_guard.tools.tree.command import status_line

    in_tree = status_line()
    reasons = []
    if _entry_point() is None:
        reasons.append(f"no '{ENTRY_POINT_NAME}' entry point in {ENTRY_POINT_GROUP}")
    if not loaded_by_vllm():
        reasons.append(f"VLLM_PLUGINS does not list '{ENTRY_POINT_NAME}'")
    if mode == "off":
        reasons.append(f"{ENV}=off")
    elif mode == "auto" and not is_rocm:
        reasons.append(f"{ENV}=auto acts on ROCm only")
    return {
        "ok": True,
        "guard_version": __version__,
        "vllm": vllm_version(),
        "platform": platform,
        "rocm": is_rocm,
        "patches": patches,
        "affected": bool(needed),
        "in_tree_fix": in_tree,
        "mode": mode,
        "mode_warning": problem,
        "active": not reasons,
        "inactive_because": reasons,
    }


def status(as_json: bool = False) -> int:
    if as_json:  # keep stdout for the JSON: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    problem = _vllm_problem()
    if problem:
        return _could_not_run("status", problem, as_json)
    try:
        facts = _status_facts()
    except Exception as e:
        return _could_not_run("status", _one_line(e), as_json)
    if as_json:
        print(json.dumps(facts, indent=2))
        return 0
    print(f"{PREFIX} {facts['guard_version']}")
    print(f"vLLM:        {facts['vllm']}")
    print(f"platform:    {facts['platform']}{'' if facts['rocm'] else ' (not ROCm)'}")
    for p in facts["patches"]:
        if p["status"] == "error":
            print(f"  {p['name']}: could not check ({p['detail']})")
        else:
            print(f"  {p['name']}: {p['status']} ({p['detail']})")
    print(f"affected:    {'yes' if facts['affected'] else 'no'}")
    print(f"in-tree fix: {facts['in_tree_fix']}")
    if facts["mode_warning"]:
        print(f"warning:     {facts['mode_warning']}")
    print(f"{ENV}: {facts['mode']}")
    if facts["inactive_because"]:
        print(f"guard:       inactive here: {'; '.join(facts['inactive_because'])}")
    elif facts["affected"]:
        print("guard:       active: vLLM processes here load it and patch capture")
    else:
        print("guard:       active, with nothing to do on this vLLM")
    return 0


def check(as_json: bool) -> int:
    if as_json:  # keep stdout for the JSON: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    problem = _vllm_problem()
    if problem:
        return _could_not_run("check", problem, as_json)
    mode, _ = read_mode()
    if mode == "auto":
        # Judge the ROCm code path on any host: act as on ROCm.
        os.environ[ENV] = "on"
    try:
        import vllm.plugins

        vllm.plugins.load_general_plugins()  # exactly as a vLLM worker does
        from vllm_capture_guard.tools.check import run_seed

        result = run_seed()
    except Exception as e:
        return _could_not_run("check", _one_line(e), as_json)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print_verdict(result)
    if not result["runs"]:
        return 2
    return 0 if result["ok"] else 1


def _print_verdict(result: dict[str, Any]) -> None:
    print(f"vLLM {result['vllm']}; guard: {result['guard'] or 'not loaded'}")
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for run in result["runs"]:
        by_backend.setdefault(run["backend"], []).append(run)
    for backend, runs in by_backend.items():
        bad = [r for r in runs if not r["ok"]]
        if not bad:
            print(f"  {backend}: PASS, {len(runs)}/{len(runs)} capture sequences")
            continue
        first = bad[0]
        print(
            f"  {backend}: FAIL, {len(bad)}/{len(runs)} capture sequences fail; "
            f"first: {first['error']} at {first['error_site']} "
            f"(batch {first['batch']['label']})"
        )
    for backend, why in result["unavailable"].items():
        print(f"  {backend}: not checked here ({why})")
    if result["ok"]:
        print(
            "verdict: capture gets past every metadata builder; startup is not "
            "blocked by this bug"
        )
    else:
        print("verdict: startup would still fail (EngineCore failed to start)")


def audit(as_json: bool, backends: list[str] | None) -> int:
    """Every registered backend's capture, as this install's vLLM processes
    would run it: the guard is loaded through vLLM's plugin loader, following
    VLLM_CAPTURE_GUARD and VLLM_PLUGINS as ``check`` does."""
    if as_json:  # keep stdout for the JSON: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    mode, problem = read_mode()
    if problem:
        print(f"{PREFIX}: {problem}", file=sys.stderr)
    missing = _vllm_problem(import_it=False)
    if missing:
        return _could_not_run("audit", missing, as_json)
    if mode == "auto":
        # Judge the ROCm code path on any host: act as on ROCm.
        os.environ[ENV] = "on"
    shown = mode if mode != "auto" else "auto (counts as on: audits the ROCm path)"
    try:
        from vllm_capture_guard.tools.audit import use_version_cache
    except Exception as e:  # numpy/torch missing: say so, or why vLLM is broken
        return _could_not_run("audit", _vllm_problem() or _one_line(e), as_json)
    use_version_cache()  # before vLLM is imported
    broken = _vllm_problem()
    if broken:
        return _could_not_run("audit", broken, as_json)
    try:
        import vllm.plugins

        vllm.plugins.load_general_plugins()  # exactly as a vLLM worker does
        from vllm_capture_guard.tools.audit import print_report, run_audit

        result = run_audit(backends, guard_mode=shown)
    except Exception as e:
        return _could_not_run("audit", _one_line(e), as_json)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_report(result)
    if not result.built:
        return 2
    return 1 if result.cpu_writers else 0


#: ``--help`` text: plain, for a terminal (the module docstring is for Sphinx).
DESCRIPTION = """\
Is this vLLM affected by the ROCm full CUDA-graph capture bug (MiniMax-M3,
ROCM_ATTN / ROCM_AITER_UNIFIED_ATTN, "assert decode_query_len > 0"), is the
guard active, and does capture now get past vLLM's metadata builders?

Exit codes:
  0  status printed; check passes; audit finds no shared CPU write
  1  check: startup would still fail; audit: a capture writes shared CPU
     metadata
  2  could not run (vLLM not installed or not importable, or another error);
     the reason is printed on one line, or as {"ok": false, "error": ...}
     with --json
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
        "metadata builders (CPU), with the guard loaded as vLLM loads it.\n\n"
        "Exit codes: 0 capture gets past every metadata builder; 1 startup\n"
        "would still fail; 2 the check could not run (one-line reason).",
    ),
    "audit": (
        "every backend's capture vs shared metadata (exit 0 clean, 1 hazard, 2 error)",
        "Every registered attention backend: does its full-graph capture write\n"
        "shared metadata that later builders read?\n\n"
        "Exit codes: 0 no capture writes shared CPU metadata; 1 one does;\n"
        "2 the audit could not run (one-line reason).",
    ),
}


def main(argv: list[str] | None = None) -> int:
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
    parsers["audit"].add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="audit only this registry name (repeatable); default: all",
    )
    from vllm_capture_guard.tools.tree import command as tree_command

    tree_command.add_parser(sub)
    args = parser.parse_args(argv)
    # The verdict is ours to print; vLLM's INFO chatter would bury it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.command == "status":
        return status(args.json)
    if args.command == "patch":
        return tree_command.run(args)
    if args.command == "audit":
        return audit(args.json, args.backend)
    return check(args.json)


if __name__ == "__main__":
    sys.exit(main())
