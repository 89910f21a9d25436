# SPDX-License-Identifier: Apache-2.0
"""Load the guard the way a vLLM worker does, judging the ROCm code path.

Every tool that judges vLLM's capture (``check``, ``audit``, the oracle's
``record``, the version matrix) loads the plugins through vLLM's own loader,
so ``VLLM_CAPTURE_GUARD`` and ``VLLM_PLUGINS`` decide exactly as in ``vllm
serve``. The switch is read by :mod:`vllm_capture_guard.runtime.switch`
only; ``auto`` counts as ``on`` here, because the tools judge the ROCm code
path on any host.
"""

from __future__ import annotations

import os
import sys

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.plugin import PREFIX


def judge_rocm_path(environ: dict[str, str] | None = None) -> str:
    """Read the switch; under ``auto`` set it to ``on``. Returns the mode as
    the tools print it."""
    env = os.environ if environ is None else environ
    mode, problem = switch.read_mode(env)
    if problem:
        print(f"{PREFIX}: {problem}", file=sys.stderr)
    if mode is switch.Mode.AUTO:
        env[switch.ENV] = switch.Mode.ON.value
        return "auto (counts as on: judges the ROCm path)"
    return mode.value


def load_plugins_as_worker() -> str:
    """:func:`judge_rocm_path`, then ``vllm.plugins.load_general_plugins()``.
    The backend modules are patched when they are imported afterwards."""
    shown = judge_rocm_path()
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    return shown
