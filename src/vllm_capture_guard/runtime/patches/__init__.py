# SPDX-License-Identifier: Apache-2.0
"""Backports of upstream vLLM fixes, one module per fix, each deletable once
the release that has the fix is the oldest supported; and :data:`PATCHES`,
every change the plugin makes: the capture guard first (``runtime/guard/``,
which stays, whatever the release), then the backports."""

from __future__ import annotations

from vllm_capture_guard.runtime import base, switch
from vllm_capture_guard.runtime.guard import install as guard
from vllm_capture_guard.runtime.patches import graph_capture_stream as stream
from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as aiter

# The AITER backport derives from the builder class the guard already watches.
PATCHES: tuple[base.Patch, ...] = (
    guard.CaptureGuard(),
    aiter.RocmAiterUnifiedBuilder(),
    stream.GraphCaptureStream(),
)
NAMES = frozenset(p.name for p in PATCHES)


def unknown_disabled() -> str | None:
    """Names in ``VLLM_CAPTURE_GUARD_DISABLE`` that are no patch, or None."""
    if unknown := ", ".join(sorted(switch.disabled_patches() - NAMES)):
        known = ", ".join(sorted(NAMES))
        return (
            f"{switch.DISABLE_ENV} names no patch: {unknown} (the patches are {known})"
        )
    return None
