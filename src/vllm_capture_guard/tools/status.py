# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard status``: vLLM version, platform, affected?, is the
guard active here? Reads the switches through
:mod:`vllm_capture_guard.runtime.switch` only."""

from __future__ import annotations

import json
from typing import Any

from vllm_capture_guard import __version__
from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.plugin import PREFIX, platform_name, vllm_version


def entry_point() -> Any:
    """Our ``vllm.general_plugins`` entry point, or None if not installed."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=switch.ENTRY_POINT_GROUP):
        if ep.name == switch.ENTRY_POINT_NAME:
            return ep
    return None


def inactive_reasons(mode: switch.Mode, is_rocm: bool) -> list[str]:
    """Why vLLM processes here would not run the guard (empty: they would)."""
    reasons = []
    name = switch.ENTRY_POINT_NAME
    if entry_point() is None:
        reasons.append(f"no '{name}' entry point in {switch.ENTRY_POINT_GROUP}")
    if not switch.loaded_by_vllm():
        reasons.append(f"{switch.PLUGINS_ENV} does not list '{name}'")
    if mode is switch.Mode.OFF:
        reasons.append(f"{switch.ENV}=off")
    elif mode is switch.Mode.AUTO and not is_rocm:
        reasons.append(f"{switch.ENV}=auto acts on ROCm only")
    return reasons


def facts() -> dict[str, Any]:
    """What ``status`` reports, as one JSON-able dict."""
    from vllm_capture_guard.runtime.patches import PATCHES, Status
    from vllm_capture_guard.tools.tree.command import status_line

    mode, problem = switch.read_mode()
    is_rocm, platform = platform_name()
    patches = []
    for patch in PATCHES:
        try:
            found = patch.inspect()
            patches.append(
                {
                    "name": patch.name,
                    "status": str(found.status),
                    "detail": found.detail,
                }
            )
        except Exception as e:
            patches.append(
                {
                    "name": patch.name,
                    "status": "error",
                    "detail": f"{type(e).__name__}: {e}",
                }
            )
    affected = {str(Status.NEEDED), str(Status.PATCHED), str(Status.ALREADY)}
    reasons = inactive_reasons(mode, is_rocm)
    return {
        "ok": True,
        "guard_version": __version__,
        "vllm": vllm_version(),
        "platform": platform,
        "rocm": is_rocm,
        "patches": patches,
        "affected": any(p["status"] in affected for p in patches),
        "in_tree_fix": status_line(),
        "mode": mode.value,
        "mode_warning": problem,
        "active": not reasons,
        "inactive_because": reasons,
    }


def main(as_json: bool = False) -> int:
    """``vllm-capture-guard status``: 0 printed, 2 could not run."""
    from vllm_capture_guard.tools.failure import could_not_run, one_line

    try:
        found = facts()
    except Exception as e:
        return could_not_run("status", one_line(e), as_json)
    if as_json:
        print(json.dumps(found, indent=2))
        return 0
    print(f"{PREFIX} {found['guard_version']}")
    print(f"vLLM:        {found['vllm']}")
    print(f"platform:    {found['platform']}{'' if found['rocm'] else ' (not ROCm)'}")
    for p in found["patches"]:
        if p["status"] == "error":
            print(f"  {p['name']}: could not check ({p['detail']})")
        else:
            print(f"  {p['name']}: {p['status']} ({p['detail']})")
    print(f"affected:    {'yes' if found['affected'] else 'no'}")
    print(f"in-tree fix: {found['in_tree_fix']}")
    if found["mode_warning"]:
        print(f"warning:     {found['mode_warning']}")
    print(f"{switch.ENV}: {found['mode']}")
    if found["inactive_because"]:
        print(f"guard:       inactive here: {'; '.join(found['inactive_because'])}")
    elif found["affected"]:
        print("guard:       active: vLLM processes here load it and patch capture")
    else:
        print("guard:       active, with nothing to do on this vLLM")
    return 0
