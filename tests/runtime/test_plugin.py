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
from vllm_capture_guard.runtime import logs, patching, plugin, switch
from vllm_capture_guard.runtime import patches as patches_pkg
from vllm_capture_guard.runtime.patching import original_of
from vllm_capture_guard.tools.fixes import by_name
from vllm_capture_guard.tools.revert import clear_hooks, revert

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
    assert out["action"] == "patched"  # every release: the guard acts at use
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
    monkeypatch.setattr(logs, "LOG", logging.getLogger("cg-test"))
    caplog.set_level(logging.INFO, logger="cg-test")
    yield caplog
    clear_hooks()


def test_four_threads_register_one_layer(fresh_plugin, unpatched):
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
    infos = [r for r in fresh_plugin.records if "builder-capture-guard" in r.message]
    assert len(infos) == 1
    assert revert(by_name("builder-capture-guard"))
    assert cls.__dict__["build_for_cudagraph_capture"] is capture


# --- our own failure handling: fakes allowed here ---------------------------


class _Boom(patching.Patch):
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


def test_revert_stops_pending_hooks(fresh_plugin, unpatched):
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    capture = RocmAttentionMetadataBuilder.__dict__["build_for_cudagraph_capture"]
    patch = by_name("builder-capture-guard")
    plugin.register()
    assert revert(patch)
    # a later import, or the capture entry, applies again: the patch stays out
    log = logging.getLogger("cg-test")
    plugin.apply_all(log)
    assert RocmAttentionMetadataBuilder.__dict__["build_for_cudagraph_capture"] is (
        capture
    )


def test_unrecognisable_backend_module_is_failed_not_not_needed(
    monkeypatch, fresh_plugin, unpatched
):
    """A vLLM whose ROCm backend modules no longer have the classes we know:
    the host guard still guards every builder (it needs no class of them),
    the AITER backport says failed, with one WARNING, and nothing says "not
    needed"."""
    try:
        from vllm.v1.attention.backends import rocm_aiter_unified_attn, rocm_attn
    except Exception as e:  # 0.33's AITER module asks the GPU at import
        pytest.skip(f"the AITER unified module cannot be imported here: {e!r:.200}")

    monkeypatch.delattr(rocm_attn, "RocmAttentionMetadataBuilder")
    monkeypatch.delattr(rocm_aiter_unified_attn, "RocmAiterUnifiedAttentionBackend")
    plugin.register()
    report = plugin.report()
    assert report.action == "failed", report.message
    assert "not needed" not in report.message
    assert report.outcomes["builder-capture-guard"].status.value == "patched"
    warnings = [r for r in fresh_plugin.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [w.getMessage() for w in warnings]
    assert "rocm-aiter-unified-builder: failed (LookupError" in warnings[0].getMessage()


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


def test_former_name_in_disable_switches_the_patch_off_with_one_warning(
    monkeypatch, fresh_plugin, unpatched
):
    """The capture guard was called rocm-attn-cpu-offsets up to 0.1.0: an image
    that sets the old name gets the guard switched off, as before, and one
    WARNING that names the new name; the same lines for status and check."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionMetadataBuilder

    from vllm_capture_guard.tools.guard import warnings

    capture = RocmAttentionMetadataBuilder.__dict__["build_for_cudagraph_capture"]
    monkeypatch.setenv(switch.DISABLE_ENV, " Rocm-Attn-CPU-Offsets ")
    plugin.register()
    plugin.register()  # loaded twice in one process: still one WARNING
    plugin.apply_all()
    report = plugin.report()
    assert report.outcomes["builder-capture-guard"].status.value == "disabled"
    assert RocmAttentionMetadataBuilder.__dict__["build_for_cudagraph_capture"] is (
        capture
    )
    said = [
        r.getMessage()
        for r in fresh_plugin.records
        if r.levelno == logging.WARNING and switch.DISABLE_ENV in r.getMessage()
    ]
    assert len(said) == 1, said
    assert "rocm-attn-cpu-offsets, renamed builder-capture-guard" in said[0]
    assert "names no patch" not in said[0]
    assert [w for w in warnings() if switch.DISABLE_ENV in w] == [
        said[0].split("vllm-capture-guard: ", 1)[1]
    ]
    from vllm_capture_guard.tools.status import _disabled

    assert _disabled("builder-capture-guard") == (
        f"builder-capture-guard is listed in {switch.DISABLE_ENV} by its former "
        "name rocm-attn-cpu-offsets"
    )


FACTORY = """
import json
import vllm.plugins
from vllm_capture_guard.runtime.patching import is_guarded
vllm.plugins.load_general_plugins()
import vllm.v1.worker.utils as utils
make = vars(utils.AttentionGroup)["create_metadata_builders"]
print(json.dumps({"guarded": is_guarded(make)}))
"""


def test_vllms_builder_factory_is_guarded_where_builders_are_made():
    """V1, Model Runner V2, the encoder-only state and the proposers all make
    their builders with ``AttentionGroup.create_metadata_builders``."""
    on, _ = run_snippet(FACTORY, VLLM_CAPTURE_GUARD="on")
    assert on["guarded"] is True
    off, _ = run_snippet(FACTORY, VLLM_CAPTURE_GUARD="off")
    assert off["guarded"] is False


def test_a_worker_utils_without_the_factory_warns_once(
    monkeypatch, fresh_plugin, unpatched
):
    import types

    fake = types.ModuleType("vllm.v1.worker.utils")  # a vendor's, with no factory
    fake.AttentionGroup = type("AttentionGroup", (), {})
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.utils", fake)
    plugin.register()
    plugin.apply_all(logging.getLogger("cg-test"))
    warnings = [r.getMessage() for r in fresh_plugin.records if r.levelno >= 30]
    assert len(warnings) == 1, warnings
    assert "has no AttentionGroup.create_metadata_builders" in warnings[0]


def test_a_new_warning_is_logged_whatever_the_status(monkeypatch, fresh_plugin):
    """An outcome that says nothing new but brings a new WARNING (as a site
    module imported after the first one can) is still logged."""
    from vllm_capture_guard.runtime.patching import Outcome, Status

    class Twice(patching.Patch):
        name, pr, modules = "twice", "#0", ("vllm.v1.attention.backends.rocm_attn",)
        done = []

        def apply(self):
            self.done.append(1)
            if len(self.done) == 1:
                return Outcome(self.name, Status.PATCHED, "site A")
            return Outcome(self.name, Status.ALREADY, "site A", "cannot reach B")

    monkeypatch.setattr(patches_pkg, "PATCHES", (Twice(),))
    plugin.register()  # the module is imported: applies at once
    plugin.apply_all(logging.getLogger("cg-test"))
    plugin.apply_all(logging.getLogger("cg-test"))
    warnings = [r.getMessage() for r in fresh_plugin.records if r.levelno >= 30]
    assert warnings == ["vllm-capture-guard: twice: cannot reach B"], warnings
    assert plugin.report().outcomes["twice"].status is Status.PATCHED
