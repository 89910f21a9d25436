# SPDX-License-Identifier: Apache-2.0
"""The plugin entry point: modes, hooks instead of imports, one log line per
patch, idempotency and threads, and our own failure handling (where fakes
stand in for a broken vLLM)."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from tests.conftest import guard_lines, run_snippet
from vllm_capture_guard.runtime import hooks, plugin, switch
from vllm_capture_guard.runtime import patches as patches_pkg
from vllm_capture_guard.runtime.patches import by_name, original_of

LOAD_TWICE = """
import json, sys
import vllm.plugins
from vllm_capture_guard.runtime import plugin
vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()
plugin.register()  # a second call in the same process adds nothing
r = plugin.report()
print(json.dumps({
    "action": r.action, "mode": r.mode, "message": r.message,
    "rocm_modules": sorted(
        m for m in sys.modules
        if m.startswith(("vllm.", "vllm_capture_guard.runtime.patches."))
        and "rocm" in m
    ),
}))
"""


def test_auto_on_cpu_skips_and_imports_no_rocm_module():
    out, logs = run_snippet(LOAD_TWICE, VLLM_CAPTURE_GUARD=None)
    assert out["mode"] == "auto"
    assert out["action"] == "skipped"
    assert "not ROCm" in out["message"]
    assert out["rocm_modules"] == []
    lines = guard_lines(logs)
    assert len(lines) == 1 and "INFO" in lines[0], lines


def test_off_does_nothing():
    code = LOAD_TWICE.replace(
        '"rocm_modules"',
        '"patched": hasattr(__import__("vllm.v1.attention.backends.rocm_attn", '
        'fromlist=["x"]).RocmAttentionMetadataBuilder.build_for_cudagraph_capture, '
        '"__vllm_capture_guard_original__"), "rocm_modules"',
    )
    out, logs = run_snippet(code, VLLM_CAPTURE_GUARD="off")
    assert out["action"] == "disabled"
    assert out["patched"] is False
    assert len(guard_lines(logs)) == 1


IMPORT_BACKENDS = """
import json, sys
import vllm.plugins
from vllm_capture_guard.runtime import plugin
vllm.plugins.load_general_plugins()
armed = plugin.report().action
rocm_after_load = sorted(m for m in sys.modules if m.startswith("vllm.v1.attention"))
import vllm.v1.attention.backends.rocm_attn
try:
    import vllm.v1.attention.backends.rocm_aiter_unified_attn
except Exception:  # some releases ask the GPU at import
    pass
vllm.plugins.load_general_plugins()
r = plugin.report()
print(json.dumps({"armed": armed, "action": r.action, "message": r.message,
                  "reported": len(r.outcomes),
                  "attention_after_load": rocm_after_load}))
"""


def test_on_imports_no_attention_module_and_patches_on_import(
    vllm_version, zeroes_cpu_offsets
):
    out, logs = run_snippet(IMPORT_BACKENDS, VLLM_CAPTURE_GUARD="on")
    assert out["armed"] == "armed"
    assert not [m for m in out["attention_after_load"] if "rocm" in m]
    assert out["action"] == ("patched" if zeroes_cpu_offsets else "not needed")
    assert vllm_version in out["message"]
    lines = guard_lines(logs)
    # one line per patch whose backend vLLM imported; none at load
    assert len(lines) == out["reported"] >= 1, lines
    assert all("INFO" in line for line in lines), lines


def test_invalid_value_warns_with_allowed_values():
    out, logs = run_snippet(LOAD_TWICE, VLLM_CAPTURE_GUARD="yes please")
    assert out["mode"] == "auto"
    (warning, info) = guard_lines(logs)
    assert "WARNING" in warning
    for allowed in ("auto", "on", "off"):
        assert allowed in warning


@pytest.fixture
def fresh_plugin(monkeypatch, caplog):
    """register() as in a new process, logging to a test logger."""
    monkeypatch.setattr(plugin, "_report", None)
    monkeypatch.setenv(switch.ENV, "on")
    monkeypatch.setattr(plugin, "_logger", lambda: logging.getLogger("cg-test"))
    caplog.set_level(logging.INFO, logger="cg-test")
    yield caplog
    hooks.clear()


def test_four_threads_register_one_layer(fresh_plugin, unpatched, zeroes_cpu_offsets):
    if not zeroes_cpu_offsets:
        pytest.skip("this vLLM's ROCm capture leaves the CPU offsets alone")
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    cls = RocmAttentionMetadataBuilder
    capture = cls.__dict__["build_for_cudagraph_capture"]
    barrier = threading.Barrier(4)

    def run():
        barrier.wait()
        plugin.register()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrapper = cls.__dict__["build_for_cudagraph_capture"]
    assert wrapper.__vllm_capture_guard_original__ is capture
    assert original_of(wrapper) is capture
    infos = [r for r in fresh_plugin.records if "rocm-attn-cpu-offsets" in r.message]
    assert len(infos) == 1
    assert by_name("rocm-attn-cpu-offsets").revert()
    assert cls.__dict__["build_for_cudagraph_capture"] is capture


# --- our own failure handling: fakes allowed here ---------------------------


class _Boom(patches_pkg.Patch):
    name = "boom"
    pr = "#0"
    modules = ("vllm.v1.attention.backends.rocm_attn",)
    backends = ()
    targets = ()

    def apply(self):
        raise AttributeError("module has no attribute 'RocmAttentionMetadataBuilder'")


def test_failing_patch_becomes_one_warning_and_says_failed(
    monkeypatch, fresh_plugin, unpatched
):
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    capture = RocmAttentionMetadataBuilder.build_for_cudagraph_capture
    monkeypatch.setattr(patches_pkg, "PATCHES", (_Boom(),))
    plugin.register()  # must not raise; the module is imported: hook runs now
    report = plugin.report()
    assert report.action == "failed"
    assert "boom" in report.message
    warnings = [r for r in fresh_plugin.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "boom: failed (AttributeError" in warnings[0].getMessage()
    assert RocmAttentionMetadataBuilder.build_for_cudagraph_capture is capture


def test_unexpected_error_never_reaches_vllm(monkeypatch, fresh_plugin):
    def explode(mode, log):
        raise RuntimeError("platform detection exploded")

    monkeypatch.setattr(plugin, "_arm", explode)
    plugin.register()
    report = plugin.report()
    assert report.action == "failed"
    (warning,) = [r for r in fresh_plugin.records if r.levelno == logging.WARNING]
    assert "platform detection exploded" in warning.getMessage()
    assert "unpatched" in warning.getMessage()


def test_revert_stops_pending_hooks(fresh_plugin, unpatched, zeroes_cpu_offsets):
    if not zeroes_cpu_offsets:
        pytest.skip("this vLLM's ROCm capture leaves the CPU offsets alone")
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    capture = RocmAttentionMetadataBuilder.__dict__["build_for_cudagraph_capture"]
    patch = by_name("rocm-attn-cpu-offsets")
    plugin.register()
    assert patch.revert()
    # a later import, or the capture entry, applies again: the patch stays out
    log = logging.getLogger("cg-test")
    plugin.apply_all(log)
    assert RocmAttentionMetadataBuilder.__dict__["build_for_cudagraph_capture"] is (
        capture
    )


def test_unrecognisable_backend_module_is_failed_not_not_needed(
    monkeypatch, fresh_plugin, unpatched
):
    """A vLLM whose ROCm backend module no longer has the classes we know:
    the report says failed, with one WARNING, never "not needed"."""
    from vllm.v1.attention.backends import rocm_attn

    monkeypatch.delattr(rocm_attn, "RocmAttentionMetadataBuilder")
    monkeypatch.delattr(rocm_attn, "RocmAttentionBackend")
    # nor does any other module name a ROCm builder
    monkeypatch.delitem(
        sys.modules, "vllm.v1.attention.backends.rocm_aiter_unified_attn", raising=False
    )
    monkeypatch.setenv(switch.DISABLE_ENV, "rocm-aiter-unified-builder")
    plugin.register()
    report = plugin.report()
    assert report.action == "failed", report.message
    warnings = [r for r in fresh_plugin.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rocm-attn-cpu-offsets" in warnings[0].getMessage()


def test_unknown_name_in_disable_warns_with_the_patches(
    monkeypatch, fresh_plugin, unpatched
):
    monkeypatch.setenv(switch.DISABLE_ENV, "rocm_attn_cpu_offsets")
    plugin.register()
    (warning,) = [
        r.getMessage()
        for r in fresh_plugin.records
        if r.levelno == logging.WARNING and switch.DISABLE_ENV in r.getMessage()
    ]
    assert "rocm_attn_cpu_offsets" in warning
    for patch in patches_pkg.PATCHES:
        assert patch.name in warning


ENTRY = """
import json
import vllm.plugins
from vllm_capture_guard.runtime import plugin
from vllm_capture_guard.runtime.patches import is_guarded, original_of
vllm.plugins.load_general_plugins()
import vllm.v1.worker.gpu_model_runner as v1
import vllm.v1.worker.gpu.model_runner as v2
r = plugin.report()
out = {"entries": r.entries if r else None}
for key, module in (("v1", v1), ("v2", v2)):
    found = [vars(module.GPUModelRunner)[n]
             for n in ("profile_cudagraph_memory", "capture_model")]
    out[key] = all(is_guarded(f) for f in found)
    out[key + "_original"] = all(
        original_of(f).__module__ == module.__name__ for f in found)
print(json.dumps(out))
"""


def test_both_runners_check_again_where_they_capture():
    out, _ = run_snippet(ENTRY, VLLM_CAPTURE_GUARD="on")
    assert out["v1"] and out["v2"], out
    assert out["v1_original"] and out["v2_original"]
    assert sorted(out["entries"]) == [
        "vllm.v1.worker.gpu.model_runner",
        "vllm.v1.worker.gpu_model_runner",
    ]
    off, _ = run_snippet(ENTRY, VLLM_CAPTURE_GUARD="off")
    assert not off["v1"] and not off["v2"]


def test_runner_without_capture_entry_warns_once(fresh_plugin, unpatched):
    import types

    plugin.register()
    hook = plugin._guard_entry(logging.getLogger("cg-test"))
    hook(types.ModuleType("vendor.worker.model_runner"))
    (warning,) = [r for r in fresh_plugin.records if r.levelno == logging.WARNING]
    assert "vendor.worker.model_runner has no GPUModelRunner.capture_model" in (
        warning.getMessage()
    )
