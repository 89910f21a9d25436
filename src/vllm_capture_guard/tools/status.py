# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard status``: vLLM version, platform, affected?, is the
guard active here? Reads the switches through
:mod:`vllm_capture_guard.runtime.switch` only."""

from __future__ import annotations

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


def main() -> int:
    from vllm_capture_guard.runtime.patches import PATCHES, Status

    mode, problem = switch.read_mode()
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
        print(f"  {found}")
        if found.status in (Status.NEEDED, Status.PATCHED, Status.ALREADY):
            needed.append(patch.name)
    print(f"affected:    {'yes' if needed else 'no'}")
    if problem:
        print(f"warning:     {problem}")
    print(f"{switch.ENV}: {mode}")
    reasons = inactive_reasons(mode, is_rocm)
    if reasons:
        print(f"guard:       inactive here: {'; '.join(reasons)}")
    elif needed:
        print("guard:       active: vLLM processes here load it and patch capture")
    else:
        print("guard:       active, with nothing to do on this vLLM")
    return 0
