# SPDX-License-Identifier: Apache-2.0
"""On a vLLM that is already fixed (0.29.0 and later) the guard, loaded with
``VLLM_CAPTURE_GUARD=on`` by vLLM's own plugin loader, changes nothing: every
attribute of every class a patch may change (``Patch.targets``) and of the
builder each backend returns is the very same object afterwards.

Where the installed vLLM is affected these tests skip (the patches' own tests
cover that case); the version matrix (``scripts/version_matrix.py``) runs them
against 0.29.0 and 0.33.0.
"""

from __future__ import annotations

import pytest

from tests.conftest import guard_lines, run_snippet
from vllm_capture_guard.runtime.patches import PATCHES, Status
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.identity import builder_key, targets

# Runs in a new process; SHIM is replaced by a line or by nothing.
SNIPPET = """
import json
SHIM
from vllm_capture_guard.runtime import plugin
from vllm_capture_guard.tools.identity import around_plugin_load

classes = around_plugin_load()
r = plugin.report()
print(json.dumps({"action": r.action, "message": r.message,
                  "outcomes": {k: o.status for k, o in r.outcomes.items()},
                  "classes": classes}))
"""

SHIM = "from tests.shims import rocm_arch; rocm_arch.install()"


def _affected() -> str | None:
    """Why this vLLM is affected, or None if it is fixed: judged by running
    vLLM's own capture sequence unguarded, not by the guard's detection (a
    detection that wrongly patched a fixed release must fail here, not skip)."""
    batch = harness.Batch(4)
    for backend in harness.seed_backends():
        try:
            harness.backend_class(backend)
        except Exception:  # 0.33's AITER module on a CPU host
            continue
        run = harness.run_capture(backend, batch)
        if run.failed is not None:
            return f"{backend} capture then indexer: {run.failed.error}"
        if run.values("query_start_loc_cpu") != batch.offsets():
            return f"{backend} capture writes query_start_loc_cpu"
        aiter = backend == "ROCM_AITER_UNIFIED_ATTN"
        if aiter and run.values("query_start_loc") != batch.offsets():
            return f"{backend} capture zeroes query_start_loc"
    return None


@pytest.fixture(scope="module")
def fixed_release() -> None:
    why = _affected()
    if why is not None:
        pytest.skip(f"this vLLM is affected, the guard patches it ({why})")


def _load(shim: bool) -> tuple[dict, str]:
    """A warm child; with the shim, a fresh interpreter (the shim must act
    before vLLM's platform is resolved)."""
    return run_snippet(
        SNIPPET.replace("SHIM", SHIM if shim else ""),
        fresh=shim,
        VLLM_CAPTURE_GUARD="on",
    )


def _assert_untouched(classes: dict, key: str) -> None:
    entry = classes[key]
    assert "unavailable" not in entry, entry
    assert entry["same_class"], entry
    assert entry["attributes"] > 0
    assert entry["changed"] == [], f"{key}: the guard replaced {entry['changed']}"


def _check_all(out: dict) -> list[str]:
    """Every importable target and its builder untouched; returns the
    targets that could not be imported."""
    classes, missing = out["classes"], []
    for key in targets():
        if "unavailable" in classes[key]:
            missing.append(key)
            continue
        _assert_untouched(classes, key)
        if builder_key(key) in classes:
            _assert_untouched(classes, builder_key(key))
    return missing


def test_targets_come_from_the_patches():
    wanted = {cls for p in PATCHES for _, cls in p.targets}
    assert set(targets()) == wanted
    assert "RocmAttentionMetadataBuilder" in wanted


def test_fixed_release_builders_are_the_same_objects(fixed_release):
    out, logs = _load(shim=False)
    assert out["action"] == "not needed", out["message"]
    # one line per patch that ran (each logs once)
    assert len(guard_lines(logs)) == len(out["outcomes"]) >= 1
    missing = _check_all(out)
    for patch in PATCHES:
        modules_missing = any(cls in missing for _, cls in patch.targets)
        if modules_missing:
            # 0.33 on a CPU host: the AITER module asks the GPU for its arch
            # at import. The plugin says so and leaves it alone.
            assert out["outcomes"].get(patch.name) in (None, Status.UNAVAILABLE)
        else:
            assert out["outcomes"][patch.name] == Status.NOT_NEEDED


def test_fixed_release_aiter_builder_untouched_with_arch_shim(fixed_release):
    """Where the AITER module needs a GPU to import (0.33), import it with the
    test-only arch shim (tests/shims/rocm_arch.py) and check that vLLM's own
    AITER builder is found, judged "not needed" and left as it was."""
    plain, _ = _load(shim=False)
    if not _check_all(plain):
        pytest.skip("every target module imports on this host without a shim")
    out, _ = _load(shim=True)
    assert out["action"] == "not needed", out["message"]
    assert set(out["outcomes"].values()) == {Status.NOT_NEEDED}
    assert _check_all(out) == []
    aiter = builder_key("RocmAiterUnifiedAttentionBackend")
    assert out["classes"][aiter]["class"] == "RocmAiterUnifiedAttentionMetadataBuilder"
