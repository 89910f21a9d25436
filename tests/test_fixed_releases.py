# SPDX-License-Identifier: Apache-2.0
"""On a vLLM that is already fixed (0.29.0 and later) the guard, loaded with
``VLLM_CAPTURE_GUARD=on`` by vLLM's own plugin loader, changes nothing: every
attribute of the ROCm builder, the AITER unified backend and the builder it
returns is the very same object afterwards.

Where the installed vLLM is affected these tests skip (the patches' own tests
cover that case); the version matrix (``scripts/version_matrix.py``) runs them
against 0.29.0 and 0.33.0.
"""

from __future__ import annotations

import pytest

from tests.conftest import guard_lines, run_snippet
from vllm_capture_guard.runtime.patches import (
    NOT_NEEDED,
    UNAVAILABLE,
    rocm_aiter_unified_builder,
    rocm_attn_cpu_offsets,
)
from vllm_capture_guard.tools import scenarios as sc
from vllm_capture_guard.tools.identity import AITER_BUILDER, TARGETS

# Runs in a fresh interpreter; SHIM is replaced by a line or by nothing.
SNIPPET = """
import json
SHIM
from vllm_capture_guard.runtime import plugin
from vllm_capture_guard.tools.identity import around_plugin_load

classes = around_plugin_load()
r = plugin.report()
print(json.dumps({"action": r.action, "message": r.message,
                  "outcomes": {o.patch: o.status for o in r.outcomes},
                  "classes": classes}))
"""

ROCM_BUILDER, AITER_BACKEND = TARGETS

SHIM = "from tests.shims import rocm_arch; rocm_arch.install()"


def _affected() -> str | None:
    """Why this vLLM is affected, or None if it is fixed: judged by running
    vLLM's own capture sequence unguarded, not by the guard's detection (a
    detection that wrongly patched a fixed release must fail here, not skip)."""
    batch = sc.Batch(4)
    for backend in sc.ROCM_BACKENDS:
        try:
            sc.backend_class(backend)
        except Exception:  # 0.33's AITER module on a CPU host
            continue
        run = sc.run_capture(backend, batch)
        if run.failed is not None:
            return f"{backend} capture then indexer: {run.failed.error}"
        if run.query_start_loc_cpu_after != batch.offsets():
            return f"{backend} capture writes query_start_loc_cpu"
        aiter = backend == sc.ROCM_AITER_UNIFIED_ATTN
        if aiter and run.query_start_loc_after != batch.offsets():
            return f"{backend} capture zeroes query_start_loc"
    return None


@pytest.fixture(scope="module")
def fixed_release() -> None:
    why = _affected()
    if why is not None:
        pytest.skip(f"this vLLM is affected, the guard patches it ({why})")


def _load(shim: bool) -> tuple[dict, str]:
    return run_snippet(
        SNIPPET.replace("SHIM", SHIM if shim else ""), VLLM_CAPTURE_GUARD="on"
    )


def _assert_untouched(classes: dict, key: str) -> None:
    entry = classes[key]
    assert "unavailable" not in entry, entry
    assert entry["same_class"], entry
    assert entry["attributes"] > 0
    assert entry["changed"] == [], f"{key}: the guard replaced {entry['changed']}"


def test_fixed_release_builders_are_the_same_objects(fixed_release):
    out, logs = _load(shim=False)
    assert out["action"] == "not needed", out["message"]
    assert len(guard_lines(logs)) == 1
    classes = out["classes"]
    _assert_untouched(classes, ROCM_BUILDER)
    assert out["outcomes"][rocm_attn_cpu_offsets.NAME] == NOT_NEEDED
    aiter = rocm_aiter_unified_builder.NAME
    if "unavailable" in classes[AITER_BACKEND]:
        # 0.33 on a CPU host: the module asks the GPU for its arch at import.
        # The plugin says so and leaves it alone.
        assert out["outcomes"][aiter] == UNAVAILABLE
        assert f"{aiter}: unavailable (cannot import" in out["message"]
    else:
        assert out["outcomes"][aiter] == NOT_NEEDED
        _assert_untouched(classes, AITER_BACKEND)
        _assert_untouched(classes, AITER_BUILDER)
        assert classes[AITER_BUILDER]["class"] == rocm_aiter_unified_builder.BUILDER


def test_fixed_release_aiter_builder_untouched_with_arch_shim(fixed_release):
    """Where the AITER module needs a GPU to import (0.33), import it with the
    test-only arch shim (tests/shims/rocm_arch.py) and check that vLLM's own
    AITER builder is found, judged "not needed" and left as it was."""
    plain, _ = _load(shim=False)
    if "unavailable" not in plain["classes"][AITER_BACKEND]:
        pytest.skip("the AITER unified module imports on this host without a shim")
    out, _ = _load(shim=True)
    assert out["action"] == "not needed", out["message"]
    assert out["outcomes"][rocm_aiter_unified_builder.NAME] == NOT_NEEDED
    for key in (ROCM_BUILDER, AITER_BACKEND, AITER_BUILDER):
        _assert_untouched(out["classes"], key)
    assert out["classes"][AITER_BUILDER]["class"] == (
        rocm_aiter_unified_builder.BUILDER
    )
