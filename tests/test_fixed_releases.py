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
from vllm_capture_guard import scenarios as sc
from vllm_capture_guard.patches import (
    NOT_NEEDED,
    UNAVAILABLE,
    rocm_aiter_unified_builder,
    rocm_attn_cpu_offsets,
)

# Runs in a fresh interpreter; SHIM is replaced by a line or by nothing.
SNIPPET = """
import importlib, json
SHIM
import vllm.plugins
from vllm_capture_guard import plugin

TARGETS = {
    "rocm_builder": ("vllm.v1.attention.backends.rocm_attn",
                     "RocmAttentionMetadataBuilder"),
    "aiter_backend": ("vllm.v1.attention.backends.rocm_aiter_unified_attn",
                      "RocmAiterUnifiedAttentionBackend"),
}

def classes():
    out = {}
    for key, (module, name) in TARGETS.items():
        try:
            out[key] = getattr(importlib.import_module(module), name)
        except Exception as e:
            out[key] = f"{type(e).__name__}: {e}"
    backend = out["aiter_backend"]
    if not isinstance(backend, str):
        out["aiter_builder"] = backend.get_builder_cls()
    return out

def members(found):
    return {k: (v if isinstance(v, str) else (v, dict(v.__dict__)))
            for k, v in found.items()}

before = members(classes())
vllm.plugins.load_general_plugins()
after = members(classes())
result = {}
for key, was in before.items():
    if isinstance(was, str):
        result[key] = {"unavailable": was}
        continue
    cls, attrs = was
    now_cls, now_attrs = after[key]
    result[key] = {
        "class": cls.__qualname__,
        "same_class": now_cls is cls,
        "attributes": len(attrs),
        "changed": sorted(n for n in set(attrs) | set(now_attrs)
                          if attrs.get(n) is not now_attrs.get(n)),
    }
r = plugin.report()
print(json.dumps({"action": r.action, "message": r.message,
                  "outcomes": {o.patch: o.status for o in r.outcomes},
                  "classes": result}))
"""

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
    _assert_untouched(classes, "rocm_builder")
    assert out["outcomes"][rocm_attn_cpu_offsets.NAME] == NOT_NEEDED
    aiter = rocm_aiter_unified_builder.NAME
    if "unavailable" in classes["aiter_backend"]:
        # 0.33 on a CPU host: the module asks the GPU for its arch at import.
        # The plugin says so and leaves it alone.
        assert out["outcomes"][aiter] == UNAVAILABLE
        assert f"{aiter}: unavailable (cannot import" in out["message"]
    else:
        assert out["outcomes"][aiter] == NOT_NEEDED
        _assert_untouched(classes, "aiter_backend")
        _assert_untouched(classes, "aiter_builder")
        assert classes["aiter_builder"]["class"] == rocm_aiter_unified_builder.BUILDER


def test_fixed_release_aiter_builder_untouched_with_arch_shim(fixed_release):
    """Where the AITER module needs a GPU to import (0.33), import it with the
    test-only arch shim (tests/shims/rocm_arch.py) and check that vLLM's own
    AITER builder is found, judged "not needed" and left as it was."""
    plain, _ = _load(shim=False)
    if "unavailable" not in plain["classes"]["aiter_backend"]:
        pytest.skip("the AITER unified module imports on this host without a shim")
    out, _ = _load(shim=True)
    assert out["action"] == "not needed", out["message"]
    assert out["outcomes"][rocm_aiter_unified_builder.NAME] == NOT_NEEDED
    for key in ("rocm_builder", "aiter_backend", "aiter_builder"):
        _assert_untouched(out["classes"], key)
    assert out["classes"]["aiter_builder"]["class"] == (
        rocm_aiter_unified_builder.BUILDER
    )
