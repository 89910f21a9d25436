# SPDX-License-Identifier: Apache-2.0
"""The warm parent (:mod:`tests.warm`) is a process where the plugin never
loaded, as a fresh interpreter is; and a forked vLLM worker, which inherits
its parent's loaded plugins, is patched too.

Per release: the parent's own verdict; a fresh interpreter and a warm child
agree, after ``load_general_plugins()``, on vLLM's attention and worker
modules, on ``sys.meta_path`` and on ``plugins_loaded``; a child refuses an
overlay of a module its parent imported; and the real topology of vLLM's
workers: ``register()`` in a parent, ``fork``, a backend imported in the
child, which is then patched and says so once.
"""

from __future__ import annotations

import json

import pytest

from tests import warm
from tests.conftest import LOGGING_AS_VLLM_SERVE, fresh_env, guard_lines

#: What both kinds of process run: the imports the warm parent made, vLLM's
#: plugin loader, then what they look like.
AFTER_LOAD = """
import json, sys
import torch, vllm.config, vllm.plugins
vllm.plugins.load_general_plugins()
print(json.dumps({
    "modules": sorted(
        m for m in sys.modules
        if m.startswith(("vllm.v1.attention", "vllm.v1.worker", "vllm.attention",
                         "vllm.model_executor.layers.attention"))
    ),
    "meta_path": [type(f).__module__ + "." + type(f).__qualname__
                  for f in sys.meta_path],
    "plugins_loaded": vllm.plugins.plugins_loaded,
    "ours": sorted(m for m in sys.modules if m.startswith("vllm_capture_guard")),
}))
"""


def test_the_warm_parent_passes_its_own_checks():
    verdict = warm.verdict()
    assert verdict["ok"], verdict["problems"]


def _after_load(fresh: bool) -> dict:
    proc = warm.python(
        ["-c", AFTER_LOAD], fresh_env(VLLM_CAPTURE_GUARD="on"), fresh=fresh
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_warm_child_looks_like_a_fresh_interpreter_after_loading_plugins():
    fresh, child = _after_load(True), _after_load(False)
    assert child == fresh
    assert child["plugins_loaded"] is True
    assert "vllm_capture_guard.runtime.plugin" in child["ours"]


@pytest.mark.once  # the mechanism, on the venv's release
def test_a_child_refuses_an_overlay_of_a_module_its_parent_imported(tmp_path):
    """``vllm.plugins`` is imported by the parent: an overlay that changes it
    cannot be honoured in a child, which then runs fresh instead."""
    from tests import variants as vv

    text = vv.read_installed("plugins/__init__.py") + "\nCAPTURE_GUARD_OVERLAY = 1\n"
    vv.make_overlay({"plugins/__init__.py": text}, tmp_path)
    code = "import vllm.plugins as p; print(getattr(p, 'CAPTURE_GUARD_OVERLAY', 0))"
    env = fresh_env(PYTHONPATH=str(tmp_path))
    handle = warm.start(["-c", code], env)
    assert handle.warm is not None  # it started warm,
    proc = handle.wait(300)
    assert handle.warm is None  # refused, and ran fresh:
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "1"  # the overlay's module


#: vLLM's worker topology: the engine process loads plugins, then forks a
#: worker, which imports the backend. The worker inherits the loaded plugin
#: (``plugins_loaded`` is a module global) and must be patched by it.
FORKED_WORKER = """
import json, os, sys
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm_capture_guard.tools.revert import pending_hooks
pending = pending_hooks()
sys.stdout.flush(); sys.stderr.flush()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    import vllm.v1.attention.backends.rocm_attn as m
    from vllm_capture_guard.runtime.patching import is_guarded
    from vllm_capture_guard.runtime.plugin import report
    vllm.plugins.load_general_plugins()  # a worker calls it again: nothing new
    capture = m.RocmAttentionMetadataBuilder.build_for_cudagraph_capture
    out = {"guarded": is_guarded(capture), "action": report().action,
           "loaded": vllm.plugins.plugins_loaded}
    os.write(write, json.dumps(out).encode())
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
os.close(write)
os.waitpid(pid, 0)
child = json.loads(os.read(read, 65536))
print(json.dumps({"pending_before_fork": pending, "child": child,
                  "parent_imported": "vllm.v1.attention.backends.rocm_attn"
                  in sys.modules}))
"""


def test_a_forked_worker_inherits_the_plugin_and_is_patched_once():
    proc = warm.python(
        ["-c", LOGGING_AS_VLLM_SERVE + FORKED_WORKER],
        fresh_env(VLLM_CAPTURE_GUARD="on", VLLM_LOGGING_LEVEL="INFO"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "vllm.v1.attention.backends.rocm_attn" in out["pending_before_fork"]
    assert out["parent_imported"] is False
    assert out["child"]["loaded"] is True
    assert out["child"]["guarded"] is True, out
    said = guard_lines(proc.stdout + proc.stderr)
    lines = [ln for ln in said if "builder-capture-guard: patched" in ln]
    assert len(lines) == 1, lines
