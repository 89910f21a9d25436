# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard``: is this vLLM affected, is the guard active, and does
capture now get past the metadata builders?

Exit codes: ``status`` 0; ``check`` 0 if every capture sequence passes, 1 if
startup would still fail, 2 if the check could not run; ``audit`` 0 if no
backend's capture writes shared CPU metadata, 1 if one does, 2 if it could not
run.
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


def status() -> int:
    from vllm_capture_guard.runtime.patches import PATCHES, Status
    from vllm_capture_guard.runtime.plugin import platform_name, vllm_version

    mode, problem = read_mode()
    is_rocm, platform = platform_name()
    print(f"{PREFIX} {__version__}")
    print(f"vLLM:        {vllm_version()}")
    print(f"platform:    {platform}{'' if is_rocm else ' (not ROCm)'}")
    needed = []
    for patch in PATCHES:
        try:
            found = patch.inspect()
        except Exception as e:
            print(f"  {patch.name}: could not check ({type(e).__name__}: {e})")
            continue
        print(f"  {patch.name}: {found.status} ({found.detail})")
        if found.status in (Status.NEEDED, Status.PATCHED, Status.ALREADY):
            needed.append(patch.name)
    print(f"affected:    {'yes' if needed else 'no'}")
    from vllm_capture_guard.tools.tree.command import status_line

    print(f"in-tree fix: {status_line()}")
    reasons = []
    if _entry_point() is None:
        reasons.append(f"no '{ENTRY_POINT_NAME}' entry point in {ENTRY_POINT_GROUP}")
    if not loaded_by_vllm():
        reasons.append(f"VLLM_PLUGINS does not list '{ENTRY_POINT_NAME}'")
    if problem:
        print(f"warning:     {problem}")
    if mode == "off":
        reasons.append(f"{ENV}=off")
    elif mode == "auto" and not is_rocm:
        reasons.append(f"{ENV}=auto acts on ROCm only")
    print(f"{ENV}: {mode}")
    if reasons:
        print(f"guard:       inactive here: {'; '.join(reasons)}")
    elif needed:
        print("guard:       active: vLLM processes here load it and patch capture")
    else:
        print("guard:       active, with nothing to do on this vLLM")
    return 0


def check(as_json: bool) -> int:
    if as_json:  # keep stdout for the JSON: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
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
        print(f"{PREFIX} check could not run: {type(e).__name__}: {e}")
        return 2
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
    if mode == "auto":
        # Judge the ROCm code path on any host: act as on ROCm.
        os.environ[ENV] = "on"
    shown = mode if mode != "auto" else "auto (counts as on: audits the ROCm path)"
    from vllm_capture_guard.tools.audit import use_version_cache

    use_version_cache()
    try:
        import vllm.plugins

        vllm.plugins.load_general_plugins()  # exactly as a vLLM worker does
        from vllm_capture_guard.tools.audit import print_report, run_audit

        result = run_audit(backends, guard_mode=shown)
    except Exception as e:
        print(f"{PREFIX} audit could not run: {type(e).__name__}: {e}")
        return 2
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_report(result)
    if not result.built:
        return 2
    return 1 if result.cpu_writers else 0


def main(argv: list[str] | None = None) -> int:
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
    from vllm_capture_guard.tools.tree import command as tree_command

    tree_command.add_parser(sub)
    args = parser.parse_args(argv)
    # The verdict is ours to print; vLLM's INFO chatter would bury it.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.command == "status":
        return status()
    if args.command == "patch":
        return tree_command.run(args)
    if args.command == "audit":
        return audit(args.json, args.backend)
    return check(args.json)


if __name__ == "__main__":
    sys.exit(main())
