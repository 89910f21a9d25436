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


def unknown_disabled() -> str | None:
    """Names in ``VLLM_CAPTURE_GUARD_DISABLE`` that are no patch, or None."""
    if unknown := ", ".join(sorted(switch.disabled_patches() - NAMES)):
        known, env = ", ".join(sorted(NAMES)), switch.DISABLE_ENV
        return f"{env} names no patch: {unknown} (the patches are {known})"
    return None
