# SPDX-License-Identifier: Apache-2.0
"""On a host where CUDA/HIP really is there, loading the plugin and running
its import hooks (whose probe asks the builders what they do on the GPU path)
must not initialise it: the plugin runs in every vLLM process, including ones
that fork workers afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here"),
]

TRAPPED = """
import json, traceback
import torch, torch.cuda
calls = []
def trap(name, real):
    def f(*a, **k):
        calls.append([name, "".join(traceback.format_stack(limit=16))])
        return real(*a, **k)
    return f
torch.cuda._lazy_init = trap("torch.cuda._lazy_init", torch.cuda._lazy_init)
torch._C._cuda_init = trap("torch._C._cuda_init", torch._C._cuda_init)
import vllm.plugins
vllm.plugins.load_general_plugins()
at_load = len(calls)
import vllm.v1.attention.backends.rocm_attn
import vllm.v1.attention.backends.rocm_aiter_unified_attn
from vllm_capture_guard.runtime.plugin import report
ours = [c for c in calls if "vllm_capture_guard" in c[1]]
print(json.dumps({"at_load": at_load, "ours": ours, "all": len(calls),
                  "initialised": torch.cuda.is_initialized(),
                  "action": report().action}))
"""


def test_plugin_and_hooks_never_initialise_cuda():
    env = dict(os.environ, VLLM_CAPTURE_GUARD="on")
    proc = subprocess.run(
        [sys.executable, "-c", TRAPPED],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["action"] in ("patched", "not needed"), out
    assert out["at_load"] == 0
    assert out["ours"] == [], out["ours"][0][1]
    if out["all"] == 0:  # vLLM's own imports did not initialise it either
        assert out["initialised"] is False
