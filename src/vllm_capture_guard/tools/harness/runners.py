# SPDX-License-Identifier: Apache-2.0
"""Which model runner vLLM uses for a config: the one place the harness
chooses, and it asks vLLM.

* Where the installed vLLM has the choice (``VllmConfig.use_v2_model_runner``,
  0.27 to 0.33), its answer for the config as on a ROCm host (the platform
  answering ``is_rocm()`` while it is read): Model Runner V2 for the
  architectures vLLM makes it the default for, under
  ``VLLM_USE_V2_MODEL_RUNNER=1``, and where a feature needs it; the V1
  runner otherwise. vLLM's GPU worker asks the same property.
* Where it has no choice, the one GPU runner it has, by its files: Model
  Runner V2 (``vllm/v1/worker/gpu/``) alone from 0.34.0 on, or the V1 runner
  (``vllm/v1/worker/gpu_model_runner.py``) alone.

Model Runner V2's answer can depend on Triton (vLLM falls back to V1 for a
default architecture where Triton is off), which vLLM decides when it is
imported; ``check`` sets Triton up before that
(:func:`vllm_capture_guard.tools.simulate.use_triton_interpreter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from vllm_capture_guard.tools.support import module_exists

V1 = "v1"
V2 = "v2"
#: What the output calls each runner, and where it lives in vLLM's tree.
NAMES = {V1: "the V1 model runner", V2: "Model Runner V2"}
FILES = {
    V1: "vllm/v1/worker/gpu_model_runner.py",
    V2: "vllm/v1/worker/gpu/model_runner.py",
}
MODULES = {
    V1: "vllm.v1.worker.gpu_model_runner",
    V2: "vllm.v1.worker.gpu.model_runner",
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The runner vLLM uses, and how that was learnt."""

    runner: str  # V1 or V2
    why: str

    @property
    def name(self) -> str:
        return NAMES[self.runner]

    def line(self) -> str:
        return f"{self.name} ({FILES[self.runner]}): {self.why}"


def present(runner: str) -> bool:
    """Does the installed vLLM have ``runner`` (by its files)?"""
    return module_exists(MODULES[runner])


@contextlib.contextmanager
def _as_rocm() -> Iterator[None]:
    """vLLM's platform answering ``is_rocm()`` as on a ROCm host, and the
    answers vLLM cached from it asked again (0.29.0 to 0.33.0 keep some
    architectures on the V1 runner on ROCm only; 0.28.0 caches its default
    set per platform), while vLLM's choice is read: check judges the ROCm
    path on any host."""
    import sys

    from vllm.platforms import current_platform

    cached = getattr(
        sys.modules.get("vllm.config.vllm"),
        "default_v2_model_runner_architectures",
        None,
    )
    clear = getattr(cached, "cache_clear", lambda: None)
    own = vars(current_platform).get("is_rocm")
    current_platform.is_rocm = lambda: True
    clear()
    try:
        yield
    finally:
        if own is None:
            vars(current_platform).pop("is_rocm", None)
        else:
            current_platform.is_rocm = own
        clear()


def choose(config: Any) -> Choice:
    """The runner vLLM's GPU worker makes for ``config``."""
    from vllm.config import VllmConfig

    has = {r: present(r) for r in (V1, V2)}
    if not any(has.values()):
        raise RuntimeError(
            f"this vLLM has no GPU model runner ({FILES[V1]} nor {FILES[V2]})"
        )
    if isinstance(getattr(VllmConfig, "use_v2_model_runner", None), property):
        with _as_rocm():
            runner = V2 if config.use_v2_model_runner else V1
        if has[runner]:
            why = "vLLM's choice for this model on ROCm (use_v2_model_runner)"
            return Choice(runner, why)
    only = V2 if has[V2] else V1
    other = V1 if only == V2 else V2
    if not has[other]:
        return Choice(only, "the only GPU model runner of this vLLM")
    raise RuntimeError(
        "this vLLM has both GPU model runners and no way to choose between them"
    )
