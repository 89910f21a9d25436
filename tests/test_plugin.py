# SPDX-License-Identifier: Apache-2.0
"""The plugin entry point: modes, one log line, idempotency, the hot path, and
our own failure handling (where fakes stand in for a broken vLLM)."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import guard_lines, run_snippet
from vllm_capture_guard.runtime import plugin
from vllm_capture_guard.runtime.patches import (
    ALREADY,
    NEEDED,
    PATCHED,
    UNAVAILABLE,
    original_of,
    rocm_attn_cpu_offsets,
)

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
        if m.startswith(("vllm.", "vllm_capture_guard.runtime.patches.")) and "rocm" in m
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


def test_on_patches_once_and_logs_one_line(vllm_version):
    out, logs = run_snippet(LOAD_TWICE, VLLM_CAPTURE_GUARD="on")
    assert out["action"] in ("patched", "not needed")
    assert vllm_version in out["message"]
    lines = guard_lines(logs)
    assert len(lines) == 1 and "INFO" in lines[0], lines


def test_invalid_value_warns_with_allowed_values():
    out, logs = run_snippet(LOAD_TWICE, VLLM_CAPTURE_GUARD="yes please")
    assert out["mode"] == "auto"
    (warning, info) = guard_lines(logs)
    assert "WARNING" in warning
    for allowed in ("auto", "on", "off"):
        assert allowed in warning


@pytest.mark.parametrize(
    "raw, mode",
    [(None, "auto"), ("", "auto"), ("on", "on"), (" OFF ", "off"), ("Auto", "auto")],
)
def test_read_mode(raw, mode):
    env = {} if raw is None else {plugin.ENV: raw}
    assert plugin.read_mode(env) == (mode, None)


def test_apply_is_idempotent_and_keeps_build(unpatched):
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    cls = RocmAttentionMetadataBuilder
    build = cls.build
    capture = cls.build_for_cudagraph_capture
    if rocm_attn_cpu_offsets.inspect().status != NEEDED:
        pytest.skip("this vLLM does not need the patch")
    assert rocm_attn_cpu_offsets.apply().status == PATCHED
    wrapped = cls.build_for_cudagraph_capture
    assert rocm_attn_cpu_offsets.apply().status == ALREADY
    assert cls.build_for_cudagraph_capture is wrapped
    assert original_of(wrapped) is capture
    assert cls.build is build  # the serving hot path is untouched
    assert rocm_attn_cpu_offsets.revert()
    assert cls.build_for_cudagraph_capture is capture


# --- our own failure handling: fakes allowed here ---------------------------


def test_missing_module_is_reported_unavailable(monkeypatch):
    monkeypatch.setattr(rocm_attn_cpu_offsets, "MODULE", "vllm.no_such_backend")
    outcome = rocm_attn_cpu_offsets.apply()
    assert outcome.status == UNAVAILABLE
    assert "vllm.no_such_backend" in outcome.detail


class _Boom:
    NAME = "boom"

    @staticmethod
    def apply():
        raise AttributeError("module has no attribute 'RocmAttentionMetadataBuilder'")


def _register_fresh(monkeypatch, patches, caplog):
    from vllm_capture_guard.runtime.patches import registry

    monkeypatch.setattr(registry, "PATCHES", patches)
    monkeypatch.setattr(plugin, "_report", None)
    monkeypatch.setenv(plugin.ENV, "on")
    monkeypatch.setattr(plugin, "_logger", lambda: logging.getLogger("cg-test"))
    with caplog.at_level(logging.INFO, logger="cg-test"):
        plugin.register()  # must not raise
    return plugin.report()


def test_failing_patch_becomes_one_warning(monkeypatch, caplog, unpatched):
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    capture = RocmAttentionMetadataBuilder.build_for_cudagraph_capture
    report = _register_fresh(monkeypatch, (_Boom,), caplog)
    assert report.action == "failed"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "boom: AttributeError" in warnings[0].getMessage()
    assert RocmAttentionMetadataBuilder.build_for_cudagraph_capture is capture


def test_unexpected_error_never_reaches_vllm(monkeypatch, caplog):
    def explode(mode):
        raise RuntimeError("platform detection exploded")

    monkeypatch.setattr(plugin, "decide_and_apply", explode)
    report = _register_fresh(monkeypatch, (), caplog)
    assert report.action == "failed"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "platform detection exploded" in warning.getMessage()
    assert "unpatched" in warning.getMessage()
