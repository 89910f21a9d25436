# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2, made as a worker makes it (see :mod:`..v2`): the host
set-up, the config, the runner with its model and its KV cache."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from vllm_capture_guard.tools.harness import layers, runners
from vllm_capture_guard.tools.harness.model import (
    BLOCK_SIZE,
    ensure_distributed,
    ensure_workspace,
    graph_config,
)
from vllm_capture_guard.tools.harness.models import MINIMAX_M3, write_model

#: vLLM's own set-up for Model Runner V2 on a CPU (its CPU worker imports it
#: before anything else).
CPU_SHIMS = "vllm.v1.worker.cpu.shm"
#: The device memory the harness says is free for the KV cache.
KV_CACHE_BYTES = 64 << 20
#: Chooses Model Runner V2 in releases that still have the V1 runner.
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


# --- a host without a GPU ----------------------------------------------------


def cpu_setup() -> list[str]:
    """Set up what Model Runner V2 needs on a host without a GPU, as vLLM's CPU
    worker sets it up (see the module). Returns what was set up, one line
    each (empty on a GPU host). Raises where vLLM has Triton off: Model
    Runner V2 needs it, and it is decided when vLLM is imported."""
    if torch.cuda.is_available():
        return []
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise RuntimeError(
            "Model Runner V2 needs Triton, and vLLM has it off in this process: "
            "install Triton, and set TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES= "
            "(empty) before vLLM is imported"
        )
    importlib.import_module(CPU_SHIMS)
    from vllm.platforms import current_platform

    told = [f"vLLM's own CPU set-up for Model Runner V2 ({CPU_SHIMS})"]
    try:
        current_platform.get_current_memory_usage(torch.device("cpu"))
    except NotImplementedError:
        current_platform.get_current_memory_usage = lambda *a, **k: 0
        told.append("device memory in use: 0 (the platform has no answer)")
    if not callable(getattr(current_platform, "graph_pool_handle", None)):
        current_platform.graph_pool_handle = lambda *a, **k: None
        told.append("graph pool: none (no graph is captured on a CPU)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        told.append("Triton kernels: run by Triton's interpreter on the CPU")
    return told


# --- the config --------------------------------------------------------------


@contextlib.contextmanager
def chosen() -> Iterator[None]:
    """Model Runner V2 chosen, as ``VLLM_USE_V2_MODEL_RUNNER=1`` chooses it in
    releases that still have the V1 runner (a release without a choice,
    0.34.0 on, is left alone: it raises on ``=0`` and warns on ``=1``)."""
    from vllm.config import VllmConfig

    if not isinstance(getattr(VllmConfig, "use_v2_model_runner", None), property):
        yield
        return
    held = os.environ.get(V2_ENV)
    os.environ[V2_ENV] = "1"
    try:
        yield
    finally:
        if held is None:
            os.environ.pop(V2_ENV, None)
        else:
            os.environ[V2_ENV] = held


@functools.lru_cache(maxsize=1)
def _model_folder() -> Path:
    """The tiny MiniMax-M3's config, its architecture the harness model's."""
    folder = write_model(MINIMAX_M3)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [layers.ARCHITECTURE]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_config(backend: str, device: str = "cpu") -> Any:
    """A real ``VllmConfig`` for the harness model with ``--attention-backend
    backend``, full decode graphs at the sizes vLLM derives
    (:func:`.model.graph_config`), made while Model Runner V2 is chosen."""
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
    )

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    layers.register()
    with chosen():
        model = ModelConfig(
            model=str(_model_folder()),
            skip_tokenizer_init=True,
            max_model_len=4096,
            dtype="bfloat16",
        )
        config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            device_config=DeviceConfig(device=device),
            attention_config=AttentionConfig(backend=backend),
        )
        graph_config(config)
    ensure_distributed(config)
    ensure_workspace(device)
    return config


# --- the runner, as a worker makes it ----------------------------------------


def worker(config: Any, runner: Any) -> Any:
    """vLLM's GPU ``Worker`` of ``runner``, as far as the runner's calls need
    it (its ``__init__`` would start a device: vLLM's ``WorkerBase`` sets the
    rest)."""
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    made = object.__new__(Worker)
    WorkerBase.__init__(
        made,
        vllm_config=config,
        local_rank=0,
        rank=0,
        distributed_init_method="in-process",
        is_driver_worker=True,
    )
    made.model_runner = runner
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():  # a platform vLLM did not recognise:
        # no allocator pools, as a GPU server without sleep mode has none
        made._maybe_get_memory_pool_context = lambda *a, **k: contextlib.nullcontext()
    return made


def _executor(config: Any, runner: Any, profile: Callable[[], Any] | None) -> Any:
    """vLLM's ``Executor``, in-process, over vLLM's GPU ``Worker`` of
    ``runner`` (through vLLM's ``WorkerWrapperBase``, as an executor reaches
    its workers). Only the free memory is the harness's (``profile`` runs
    where the worker measures it). The worker's ``compile_or_warm_up_model``
    (its warm-up dummy runs and kernel warm-ups, then ``capture_model``) is
    not run: the harness calls the runner's ``capture_model`` alone
    (:func:`.watch.capture`), the step where the metadata builders capture."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.worker, wrapper.vllm_config = worker(config, runner), config

    class InProcess(Executor):
        def _init_executor(self) -> None:
            pass

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):  # noqa: ANN001, ANN202
            call = getattr(wrapper, method) if isinstance(method, str) else None
            if call is None:
                return [method(wrapper, *args, **(kwargs or {}))]
            return [call(*args, **(kwargs or {}))]

        def determine_available_memory(self) -> list[int]:
            if profile is not None:  # where the worker profiles graph memory
                profile()
            return [KV_CACHE_BYTES]

        def compile_or_warm_up_model(self) -> list[Any]:
            return []

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            pass

    executor = object.__new__(InProcess)
    executor.vllm_config = config
    for name in ("model_config", "cache_config", "parallel_config"):
        setattr(executor, name, getattr(config, name))
    return executor


def initialize_kv_cache(
    config: Any, runner: Any, profile: Callable[[], Any] | None = None
) -> None:
    """The KV cache as the engine core plans it, with ``runner``'s worker
    (see the module). ``profile`` runs where the worker measures its memory
    (the executor's ``determine_available_memory``, after the engine core
    resolved the KV-cache layout and before it plans the cache): vLLM's
    worker runs the runner's ``profile_cudagraph_memory`` there."""
    from vllm.v1.engine.core import EngineCore

    executor = _executor(config, runner, profile)
    core = types.SimpleNamespace(
        model_executor=executor,
        available_gpu_memory_for_kv_cache=-1,
        collective_rpc=executor.collective_rpc,
        vllm_config=config,
    )
    EngineCore._initialize_kv_caches(core, config)


def load_runner(
    config: Any, device: str = "cpu", runner_cls: type | None = None
) -> Any:
    """vLLM's Model Runner V2 for ``config`` (or ``runner_cls``, a vendor's
    subclass of it) with its model loaded, before the KV cache is planned."""
    from vllm.config import set_current_vllm_config

    module = importlib.import_module(runners.MODULES[runners.V2])
    with chosen(), set_current_vllm_config(config):
        runner = (runner_cls or module.GPUModelRunner)(config, torch.device(device))
        runner.load_model(load_dummy_weights=True)
    return runner


def make_runner(
    config: Any, device: str = "cpu", runner_cls: type | None = None
) -> Any:
    """:func:`load_runner`, with its KV cache made, as a worker starts it
    before capture."""
    from vllm.config import set_current_vllm_config

    runner = load_runner(config, device, runner_cls)
    with chosen(), set_current_vllm_config(config):
        initialize_kv_cache(config, runner)
    return runner
