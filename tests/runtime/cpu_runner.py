# SPDX-License-Identifier: Apache-2.0
"""vLLM's own V1 model runner, started on the CPU as a worker starts it.

:func:`start_up` runs what a GPU worker runs before it serves, on vLLM's real
``GPUModelRunner`` and the tiny MiniMax-M3 (one attention layer, one
MiniMax-M3 indexer cache layer, each in its own KV-cache group):

1. ``profile_cudagraph_memory()``, which makes a minimal KV cache, the
   attention groups and their builders (``initialize_kv_cache`` ->
   ``AttentionGroup.create_metadata_builders``), then captures the two
   largest sizes;
2. ``initialize_kv_cache()`` again, not for profiling (new builders; with the
   KV-cache config vLLM made in step 1);
3. ``capture_model()``: every FULL size vLLM derives, 512 down to 1;
4. at serving time, the worker's ``execute_dummy_batch()`` (an idle
   data-parallel rank's FULL decode at size 1).

Only GPU-only leaves are stubbed, and only in the process that runs this (a
child): streams and events (vLLM's own stand-ins from its CPU runner, plus
``torch.cuda.current_stream``/``stream``), device synchronisation (vLLM's
own no-ops), memory queries (``torch.accelerator.get_memory_info``, the
platform's memory usage and graph pool), the device's compute-unit count,
pinned host memory (it needs the driver: allocated as plain host memory) and
the model's forward (the layers are vLLM's; the forward returns zeros). No
graph is recorded on a CPU: capture runs the warm-up and capture passes,
which is where the metadata builders run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.harness.sizes import graph_config

HIDDEN = 256  # the tiny model's hidden size


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    device = torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


class NoPinnedMemory(TorchFunctionMode):
    """Pinned host memory needs the driver: plain host memory instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


def stub_gpu_leaves() -> contextlib.ExitStack:
    """The stubs named in the module docstring; the returned stack keeps the
    pinned-memory mode on until it is closed."""
    import vllm.utils.torch_utils as torch_utils
    from vllm.platforms import current_platform
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    cpu_model_runner._set_torch_accelerator_to_noop()  # vLLM's own no-ops
    torch.Event = torch.cuda.Event = _Event
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch_utils.current_stream = lambda: _Stream()
    torch.accelerator.get_memory_info = lambda *a: (80 << 30, 96 << 30)
    platform = type(current_platform)
    platform.get_current_memory_usage = lambda self, device=None: 0
    platform.graph_pool_handle = lambda self: None
    platform.is_pin_memory_available = lambda self: False
    gpu_model_runner.GPUModelRunner._init_device_properties = lambda self: setattr(
        self, "num_sms", 1
    )
    stack = contextlib.ExitStack()
    stack.enter_context(NoPinnedMemory())
    return stack


class StubModel(torch.nn.Module):
    """The model's layers are vLLM's; its forward returns hidden states of
    zeros (no weights, no kernels)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, input_ids=None, positions=None, *args, **kwargs):  # noqa: ANN001
        n = positions.shape[-1] if positions is not None else input_ids.shape[0]
        return torch.zeros(n, HIDDEN, dtype=torch.bfloat16)


def make_config(backend: str) -> Any:
    """A real ``VllmConfig`` for the tiny MiniMax-M3, text only, with
    ``--attention-backend backend`` and full decode graphs at the sizes vLLM
    derives (``harness.sizes.graph_config``)."""
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=str(harness.write_tiny_model()),
        skip_tokenizer_init=True,
        max_model_len=4096,
        dtype="bfloat16",
        limit_mm_per_prompt={"image": 0, "video": 0},
    )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=harness.BLOCK_SIZE),
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(backend=backend),
    )
    graph_config(config)
    harness.model.ensure_distributed(config)
    return config


@dataclasses.dataclass
class Step:
    name: str
    error: str | None = None
    site: str | None = None


def make_runner(config: Any, backend_cls: type, runner_cls: type | None = None) -> Any:
    """vLLM's ``GPUModelRunner`` (or ``runner_cls``, a vendor's) on the CPU,
    with the model's two layers made as the model makes them (they register
    in the forward context)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerCache
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.workspace import init_workspace_manager

    with set_current_vllm_config(config):
        init_workspace_manager(torch.device("cpu"))  # as the worker does first
        cls = runner_cls or GPUModelRunner
        if "_init_device_properties" in vars(cls):  # a forked runner's own copy
            cls._init_device_properties = GPUModelRunner._init_device_properties
        runner = cls(config, torch.device("cpu"))
        attn = Attention(
            4,
            harness.HEAD_SIZE,
            harness.HEAD_SIZE**-0.5,
            num_kv_heads=1,
            cache_config=config.cache_config,
            prefix=harness.ATTN_LAYER,
            attn_backend=backend_cls,
        )
        index = MiniMaxM3IndexerCache(
            harness.HEAD_SIZE, harness.INDEXER_LAYER, config.cache_config
        )
        runner.model = StubModel([attn, index])
        _resolve_kv_cache_layout(config, runner)
    return runner


def _resolve_kv_cache_layout(config: Any, runner: Any) -> None:
    """What the engine core does before memory profiling in releases that
    resolve one KV-cache layout (0.29.0 and later): vLLM's own worker method
    lists the layouts, vLLM's resolver records the choice in the config."""
    from vllm.v1.attention.backends import utils
    from vllm.v1.worker.worker_base import WorkerBase

    resolve = getattr(utils, "resolve_kv_cache_layout", None)
    if resolve is None:
        return
    worker = types.SimpleNamespace(vllm_config=config)
    supported = WorkerBase.get_supported_kv_cache_layouts(worker)
    resolve(config, [supported], list(runner.get_kv_cache_spec().values()))


def _worker(runner: Any) -> Any:
    """vLLM's GPU worker around ``runner``, as far as serving-time calls need
    it (its ``__init__`` starts a device; only the attributes are set)."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)
    worker.model_runner, worker.vllm_config = runner, runner.vllm_config
    worker.parallel_config = runner.vllm_config.parallel_config
    return worker


def start_up(
    runner: Any,
    between: Callable[[str], None] | None = None,
) -> list[Step]:
    """Steps 1-4 of the module docstring; ``between(step)`` runs before each
    step (a case's change). Stops at the first step that raises."""
    from vllm.config import set_current_vllm_config

    made = []  # the KV-cache config vLLM makes for profiling, reused as the real one
    initialize = runner.initialize_kv_cache

    def initialize_kv_cache(config: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(config)
        return initialize(config, *args, **kwargs)

    runner.initialize_kv_cache = initialize_kv_cache
    steps = [
        ("profile_cudagraph_memory", runner.profile_cudagraph_memory),
        ("initialize_kv_cache", lambda: initialize(made[0])),
        ("capture_model", runner.capture_model),
        ("execute_dummy_batch", lambda: _worker(runner).execute_dummy_batch()),
    ]  # fmt: skip
    done = []
    for name, run in steps:
        if between is not None:
            between(name)
        step = Step(name)
        done.append(step)
        try:
            with set_current_vllm_config(runner.vllm_config):
                run()
        except Exception as e:
            step.error = harness.error_text(e)
            step.site = harness.error_site(e)[0]
            break
    return done


if __name__ == "__main__":  # a smoke run: python -m tests.runtime.cpu_runner
    import json

    import vllm.plugins

    vllm.plugins.load_general_plugins()
    stack = stub_gpu_leaves()
    backend = sys.argv[1] if len(sys.argv) > 1 else "ROCM_ATTN"
    cfg = make_config(backend)
    r = make_runner(cfg, harness.backend_class(backend))
    print(json.dumps([dataclasses.asdict(s) for s in start_up(r)]))
    import dataclasses

    from vllm_capture_guard.runtime.guard import guarded_call as g

    print(json.dumps({n: dataclasses.asdict(s) for n, s in g.SEEN.items()}))
