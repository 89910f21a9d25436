# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard status``: vLLM version, platform, affected?, is the
guard active here? The guard line is :func:`.guard.story`'s, the one that
``check`` and ``audit`` print too."""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm_capture_guard import __version__
from vllm_capture_guard.runtime.plugin import PREFIX, vllm_version
from vllm_capture_guard.tools.guard import story


def facts() -> dict[str, Any]:
    """What ``status`` reports, as one JSON-able dict."""
    from vllm_capture_guard.runtime.patches import PATCHES, Status
    from vllm_capture_guard.tools import support
    from vllm_capture_guard.tools.tree.command import status_line

    told = story()
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
    unsupported = support.problem()
    return {
        "ok": True,
        "guard_version": __version__,
        "vllm": vllm_version(),
        "supported": unsupported is None,
        "unsupported_because": unsupported,
        "platform": told.platform,
        "rocm": told.rocm,
        "patches": patches,
        "affected": any(p["status"] in affected for p in patches),
        "in_tree_fix": status_line(),
        "mode": told.mode,
        "mode_warning": told.mode_problem,
        "loaded": told.loaded,
        "not_loaded_because": told.not_loaded_because,
        "active": told.acts,
        "guard": told.line(),
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
    if found["unsupported_because"]:
        print(f"supported:   no: {found['unsupported_because']}")
    print(f"in-tree fix: {found['in_tree_fix']}")
    if found["mode_warning"]:
        print(f"warning:     {found['mode_warning']}", file=sys.stderr)
    print(found["guard"])
    return 0
