# SPDX-License-Identifier: Apache-2.0
"""Backports of upstream fixes, one module each, deletable once the release with
the fix is the oldest supported; :data:`PATCHES`: the capture guard, then them."""

from __future__ import annotations

from vllm_capture_guard.runtime import patching, switch
from vllm_capture_guard.runtime.guard import install as guard
from vllm_capture_guard.runtime.patches import graph_capture_stream as stream
from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as aiter

# The AITER backport derives from the builder class the guard already watches.
PATCHES: tuple[patching.Patch, ...] = (
    guard.CaptureGuard(),
    aiter.RocmAiterUnifiedBuilder(),
    stream.GraphCaptureStream(),
)
NAMES = frozenset(p.name for p in PATCHES)
FORMER_NAMES = {former: p.name for p in PATCHES for former in p.former_names}


def switch_problems() -> list[str]:
    """What ``VLLM_CAPTURE_GUARD_DISABLE`` lists by a former name, or is no patch."""
    listed, env, found = switch.disabled_patches(), switch.DISABLE_ENV, []
    for old in sorted(listed & FORMER_NAMES.keys()):
        new = FORMER_NAMES[old]
        found.append(f"{env} names {old}, renamed {new}: {new} is off; use its name")
    if unknown := ", ".join(sorted(listed - NAMES - FORMER_NAMES.keys())):
        known = ", ".join(sorted(NAMES))
        found.append(f"{env} names no patch: {unknown} (the patches are {known})")
    return found
