# SPDX-License-Identifier: Apache-2.0
"""The device the audit answers for on a host without a GPU: an AMD Instinct
MI300X (gfx942, 304 compute units; an MI325X answers the same).

Four questions only, each answered only where this host has no answer of
its own, and each put back when :func:`simulated_device` exits:

* **the GPU architecture that ``vllm.platforms.rocm`` reads when it is
  imported** (vLLM 0.33 resolves ``_GCN_ARCH`` at module level, through
  amdsmi, then ``torch.cuda.get_device_properties("cuda").gcnArchName``).
  While that one module executes, and only if torch sees no GPU,
  ``torch.cuda.get_device_properties`` answers ``gcnArchName`` =
  :data:`ARCH` and ``multi_processor_count`` = :data:`COMPUTE_UNITS`;
  then torch is put back. Releases whose module asks nothing (0.27 to
  0.29) import it unanswered. The ROCm backends' modules import it;
  nothing here makes ``current_platform`` a ROCm platform;
* **``current_platform.num_compute_units()``**, which MLA and AITER
  builders and layers call when they are made, where the platform raises
  ``NotImplementedError`` (vLLM's platform for a host it does not
  recognise): :data:`COMPUTE_UNITS`;
* **``current_platform.device_type``**, where it is empty (the same
  platform): ``"cpu"``, where every tensor of the audit lives (DeepSeek-V4's
  compressor allocates on it);
* **pinned host memory**, which torch cannot give without a GPU driver
  (vLLM decides ``PIN_MEMORY`` when it is imported, from the platform):
  while the audit runs, an allocation that asks for pinned memory gets
  plain host memory and ``Tensor.pin_memory()`` returns the tensor (a torch
  function mode). Pinning changes where a value lives, never what it is.

One more, before vLLM is imported (:func:`use_triton_interpreter`, called
by ``vllm-capture-guard audit``): **Triton kernels run in Triton's own
interpreter on the CPU** (``TRITON_INTERPRET=1``), so that a builder whose
capture launches one (sparse MLA and DeepSeek-V4 map tokens to requests with
one) really runs it and its writes are seen. vLLM keeps Triton on a host
with no active GPU driver only where no device is visible, so
``CUDA_VISIBLE_DEVICES`` is set empty where it is unset (there is no GPU to
hide). Where vLLM was imported first (a test process), Triton stays off.

Not simulated: no compiled kernel runs (a builder whose capture launches
one fails, and the audit says what it needs), no compiled
extension (AITER, FlashMLA, vLLM's ``_C``) is stood in for, the device
capability stays unknown (so NVIDIA-only layers that ask for it are not
built), and ``current_platform.is_rocm()`` answers as it does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_PIN = torch.Tensor.pin_memory

#: An MI300X's (and MI325X's) architecture, as torch reports it on ROCm.
ARCH = "gfx942:sramecc+:xnack-"
#: Its compute units (``multi_processor_count``).
COMPUTE_UNITS = 304
ROCM_PLATFORM = "vllm.platforms.rocm"


@dataclasses.dataclass
class Simulation:
    """What was answered, for the report: one line per answer given."""

    answered: dict[str, str] = dataclasses.field(default_factory=dict)

    def note(self, what: str, how: str) -> None:
        self.answered.setdefault(what, how)

    def lines(self) -> list[str]:
        return [f"{what}: {how}" for what, how in self.answered.items()]


class _ArchAnswer(importlib.abc.MetaPathFinder):
    """Executes ``vllm.platforms.rocm`` with the architecture query answered."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def find_spec(self, fullname, path, target=None):
        if fullname != ROCM_PLATFORM:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module
        sim = self.sim

        def exec_module(module):
            real = torch.cuda.get_device_properties
            asked: list[Any] = []

            def answer(*args, **kwargs):
                asked.append(args)
                return types.SimpleNamespace(
                    gcnArchName=ARCH, multi_processor_count=COMPUTE_UNITS
                )

            torch.cuda.get_device_properties = answer
            try:
                real_exec(module)
            finally:
                torch.cuda.get_device_properties = real
            if asked:
                sim.note(
                    f"{ROCM_PLATFORM} imported",
                    f"its GPU architecture query answered {ARCH} (an MI300X)",
                )

        spec.loader.exec_module = exec_module
        return spec


class _PlainHostMemory(TorchFunctionMode):
    """Pinned host memory needs a GPU driver: plain host memory instead."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        pinned = func is _PIN or kwargs.get("pin_memory")
        if pinned:
            self.sim.note("pinned host memory", "plain host memory (no driver)")
            if func is _PIN:
                return args[0]
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


INTERPRETER = "TRITON_INTERPRET"


def triton_interpreter_env() -> dict[str, str]:
    """What :func:`use_triton_interpreter` sets, for a process to be started
    (empty where torch sees a GPU or Triton is not installed)."""
    import importlib.util
    import os

    if not _no_gpu() or importlib.util.find_spec("triton") is None:
        return {}
    return {
        INTERPRETER: "1",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }


def use_triton_interpreter() -> bool:
    """Before vLLM is imported, where torch sees no GPU and Triton is
    installed: run Triton kernels in Triton's interpreter (see above).
    Returns whether it was turned on."""
    import os

    if "vllm" in sys.modules or os.environ.get(INTERPRETER):
        return False
    env = triton_interpreter_env()
    os.environ.update(env)
    return bool(env)


def _interpreting() -> bool:
    import os

    utils = sys.modules.get("vllm.triton_utils.importing")
    return os.environ.get(INTERPRETER) == "1" and bool(
        getattr(utils, "HAS_TRITON", False)
    )


def _no_gpu() -> bool:
    return not torch.cuda.is_available()


def _unimplemented(platform: Any, name: str) -> bool:
    try:
        getattr(platform, name)()
    except NotImplementedError:
        return True
    except Exception:
        return False
    return False


@contextlib.contextmanager
def rocm_platform_answered(sim: Simulation | None = None) -> Iterator[Simulation]:
    """The first answer above alone: while inside, ``vllm.platforms.rocm``
    is imported with its GPU architecture query answered, where torch sees
    no GPU. ``check`` and ``status`` import the ROCm backends' modules under
    it (0.33's AITER module imports that platform module) and need nothing
    else of the simulated device. The module imported so stays imported,
    with what it derived from the answer, for the rest of the process (a
    command's own process)."""
    sim = sim or Simulation()
    if not _no_gpu():
        yield sim
        return
    finder = _ArchAnswer(sim)
    sys.meta_path.insert(0, finder)
    try:
        yield sim
    finally:
        sys.meta_path.remove(finder)


@contextlib.contextmanager
def simulated_device() -> Iterator[Simulation]:
    """Answer the questions above, where this host cannot, until exit."""
    sim = Simulation()
    if not _no_gpu():
        yield sim
        return
    from vllm.platforms import current_platform as platform

    finder = _ArchAnswer(sim)
    sys.meta_path.insert(0, finder)
    set_here: list[str] = []
    if _unimplemented(platform, "num_compute_units"):

        def num_compute_units(device_id: int = 0) -> int:
            sim.note(
                "current_platform.num_compute_units()",
                f"{COMPUTE_UNITS} (an MI300X's compute units)",
            )
            return COMPUTE_UNITS

        platform.num_compute_units = num_compute_units
        set_here.append("num_compute_units")
    if not getattr(platform, "device_type", None):
        platform.device_type = "cpu"
        set_here.append("device_type")
        sim.note("current_platform.device_type", "'cpu' (it had none)")
    if _interpreting():
        sim.note("Triton kernels", "run by Triton's interpreter on the CPU")
    try:
        with _PlainHostMemory(sim):
            yield sim
    finally:
        sys.meta_path.remove(finder)
        for name in set_here:
            with contextlib.suppress(AttributeError):
                delattr(platform, name)
        _forget_cached_answers()


def _forget_cached_answers() -> None:
    """vLLM caches ``num_compute_units`` per device (``functools.cache``)."""
    utils = sys.modules.get("vllm.utils.platform_utils")
    cached = getattr(utils, "num_compute_units", None)
    with contextlib.suppress(AttributeError):
        cached.cache_clear()
