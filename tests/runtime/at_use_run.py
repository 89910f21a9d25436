# SPDX-License-Identifier: Apache-2.0
"""The process that runs :mod:`tests.runtime.at_use`'s cases on one GPU model
runner of the installed vLLM: ``python -m tests.runtime.at_use_run RUNNER``
(``v1`` or ``v2``), with :func:`tests.runtime.at_use.write` 's folder first
on ``PYTHONPATH`` and the guard's mode in ``VLLM_CAPTURE_GUARD``.

Each case runs on a runner of its own, started as a worker starts it: the V1
runner through :mod:`tests.runtime.cpu_runner`, Model Runner V2 through
:mod:`tests.runtime.v2_runner`. One JSON line is printed: per case, each step
and its first error, the builders the runner holds, the guard's calls per
builder and the guard's log lines.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

from tests import variants as vv
from tests.runtime import at_use
from tests.runtime.at_use import CASES, FORK_MODULE, MODULE
from vllm_capture_guard.tools.harness import runners

#: Per runner: the module where it makes its CommonAttentionMetadata.
MAKER = {
    runners.V1: runners.MODULES[runners.V1],
    runners.V2: "vllm.v1.worker.gpu.attn_utils",
}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "vllm-capture-guard" in message:
            self.lines.append(f"{record.levelname} {message}")


def _runner_class(runner: str, kind: str) -> type:
    """The runner class of a case: vLLM's, a vendor's subclass whose capture
    entries do not call ``super()``, or (V1) the runner of the vendor's fork.
    Model Runner V2's fork is of the module its model state builds through
    (:func:`_forked`): its runner class is vLLM's."""
    base = importlib.import_module(runners.MODULES[runner]).GPUModelRunner
    if kind == "fork" and runner == runners.V1:
        return importlib.import_module(FORK_MODULE[runner]).GPUModelRunner
    if kind == "subclass":
        own = {
            name: types.FunctionType(
                fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__
            )
            for name in ("profile_cudagraph_memory", "capture_model")
            for fn in [base.__dict__[name]]
        }
        return type("VendorModelRunner", (base,), own)
    return base


def _forked(runner: Any) -> Callable[[], None]:
    """Model Runner V2's model state builds its metadata through the vendor's
    fork of ``attn_utils`` (as its module imports ``build_attn_metadata`` by
    name). Returns the undo."""
    name = "build_attn_metadata"
    module = sys.modules[type(runner.model_state).__module__]
    own = getattr(module, name)
    fork = importlib.import_module(FORK_MODULE[runners.V2])
    setattr(module, name, getattr(fork, name))
    return lambda: setattr(module, name, own)


def _device_tensor(value: Any) -> Any:
    from tests.fake_device import DeviceTensor

    return value if isinstance(value, DeviceTensor) else value.as_subclass(DeviceTensor)


def _on_device(kind: str, runner: Any) -> None:
    """Every device buffer of the runner's batch reports a GPU (data stays on
    the CPU, tests.fake_device), as on a ROCm host. Model Runner V2: the
    offsets and the lengths its metadata holds (the harness model makes its
    outputs on the device of the positions, which stay on the CPU)."""
    import torch

    if kind == runners.V2:
        buffers = runner.input_buffers
        for name in ("query_start_loc", "seq_lens"):
            setattr(buffers, name, _device_tensor(getattr(buffers, name)))
        return
    from vllm.v1.utils import CpuGpuBuffer

    holders = [runner, getattr(runner, "input_batch", None)]
    block_table = getattr(holders[1], "block_table", None)
    holders += list(getattr(block_table, "block_tables", []) or [])
    for holder in holders:
        for name, value in list(vars(holder or object()).items()):
            if isinstance(value, CpuGpuBuffer) and value.gpu is not value.cpu:
                value.gpu = _device_tensor(value.gpu)
            elif (
                isinstance(value, torch.Tensor)
                and holder is runner
                and name in ("seq_lens", "positions")
            ):
                setattr(holder, name, _device_tensor(value))


def _device_name(kind: str, runner: Any) -> str:
    """The class of the runner's device query offsets."""
    if kind == runners.V2:
        return type(runner.input_buffers.query_start_loc).__name__
    return type(runner.query_start_loc.gpu).__name__


#: What ``dataclass()`` makes, and ``copy``'s cache of slot names: left out
#: when a class is declared again.
MADE = frozenset({"__dict__", "__weakref__", "__init__", "__repr__", "__eq__",
                  "__hash__", "__match_args__", "__dataclass_fields__",
                  "__dataclass_params__", "__slotnames__"})  # fmt: skip


#: How many metadata objects the runner made of the slotted class.
SLOTTED = {"made": 0}


def slotted_metadata(kind: str, maker: str) -> Callable[[], None]:
    """vLLM's ``CommonAttentionMetadata`` made slotted, where vLLM's attention
    package and ``maker`` (the runner's module that makes the metadata) name
    it: a ``@dataclass(slots=True)`` subclass, or the class itself declared
    again from its own namespace with ``slots=True``. Returns the undo."""
    from vllm.v1.attention import backend

    name = "CommonAttentionMetadata"
    common = getattr(backend, name)
    if kind == "subclass":
        made = type(f"Vendor{name}", (common,), {"__module__": __name__})
    else:  # its own namespace, less what dataclass() makes
        made = type(name, (), {k: v for k, v in vars(common).items() if k not in MADE})
    made, SLOTTED["made"] = dataclasses.dataclass(slots=True)(made), 0
    init = made.__init__

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        SLOTTED["made"] += 1  # the runner made its metadata of this class
        init(self, *args, **kwargs)

    made.__init__ = __init__
    modules = [backend, importlib.import_module(maker)]
    modules = [m for m in modules if getattr(m, name) is common]
    for module in modules:
        setattr(module, name, made)

    def undo() -> None:
        for module in modules:
            setattr(module, name, common)

    return undo


def run_case(runner: str, case: str, log: _Lines) -> dict:
    """One case on a runner of its own; slotted metadata, and Model Runner
    V2's fork, only while it runs."""
    kind = CASES[case].metadata
    undo = [slotted_metadata(kind, MAKER[runner])] if kind else []
    try:
        return _run_case(runner, case, log, undo)
    finally:
        for step in reversed(undo):
            step()


def _start(runner: str, case: str, backend: type, undo: list) -> tuple[Any, Any]:
    """The case's runner, made as a worker makes it, and its start-up."""
    spec = CASES[case]
    cls = _runner_class(runner, spec.runner)
    if runner == runners.V1:
        from tests.runtime import cpu_runner

        made = cpu_runner.make_runner(cpu_runner.make_config("CUSTOM"), backend, cls)
        return made, cpu_runner.start_up
    from tests.runtime import v2_runner
    from vllm_capture_guard.tools.harness import v2

    made = v2.load_runner(v2.make_config("CUSTOM"), runner_cls=cls)
    if spec.runner == "fork":
        undo.append(_forked(made))
    return made, v2_runner.start_up


def _run_case(runner: str, case: str, log: _Lines, undo: list) -> dict:
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from vllm_capture_guard.runtime.guard import guarded_call as guard

    spec = CASES[case]
    module = __import__(MODULE)
    builder = getattr(module, f"Case{at_use.camel(case)}Builder")
    backend = getattr(module, f"Case{at_use.camel(case)}Backend")
    register_backend(AttentionBackendEnum.CUSTOM, f"{MODULE}.{backend.__name__}")
    affected = getattr(module, f"{builder.__name__}Affected").__dict__[vv.CAPTURE]
    start = len(log.lines)
    before = {n: s.calls for n, s in guard.SEEN.items()}
    made, start_up = _start(runner, case, backend, undo)

    def between(step: str) -> None:
        if spec.device:
            _on_device(runner, made)
        if step == spec.between:
            setattr(builder, vv.CAPTURE, affected)  # put back on the class

    if spec.device and runner == runners.V1:  # new device buffers, every time
        initialize = made.initialize_kv_cache

        def initialize_kv_cache(*args, **kwargs):  # noqa: ANN002, ANN003
            done = initialize(*args, **kwargs)
            _on_device(runner, made)
            return done

        made.initialize_kv_cache = initialize_kv_cache
    done = start_up(made, between)
    steps = done if isinstance(done, list) else done.steps  # V1: the steps
    builders = {
        type(b).__name__
        for groups in made.attn_groups
        for g in groups
        for b in g.metadata_builders
    }
    return {
        "steps": [dataclasses.asdict(s) for s in steps],
        "descriptors": getattr(done, "descriptors", None),
        "reached": getattr(done, "reached", None),
        "builders": sorted(builders),
        "calls": {
            n: s.calls - before.get(n, 0)
            for n, s in guard.SEEN.items()
            if n in builders
        },
        "log": log.lines[start:],
        "device": spec.device and _device_name(runner, made),
        "slotted_made": SLOTTED["made"] if spec.metadata else None,
    }


def _set_up(runner: str) -> None:
    """What a worker of ``runner`` sets up before it makes its runner."""
    if runner == runners.V2:
        from vllm_capture_guard.tools.harness import v2

        v2.cpu_setup()  # vLLM's own CPU shims: this process only
        importlib.import_module(runners.MODULES[runners.V2])
        return
    importlib.import_module(runners.MODULES[runners.V1])  # a worker's first import
    from tests.runtime import cpu_runner

    cpu_runner.stub_gpu_leaves()


def _logging_as_vllm_serve() -> None:
    """vLLM's logging configured as ``vllm serve`` configures it before any
    plugin loads (releases that configure it lazily, in the launcher)."""
    import argparse

    try:
        from vllm.logger import configure_logging_from_args
    except ImportError:
        return
    configure_logging_from_args(argparse.Namespace())


def main(runner: str) -> dict:
    import gc
    import os

    import vllm.plugins

    _logging_as_vllm_serve()
    vllm.plugins.load_general_plugins()  # as every vLLM process does
    _set_up(runner)
    # vLLM runs a full garbage collection around every capture phase (0.5 s
    # each over torch's and vLLM's objects); what is imported by now is frozen
    # out of them, and vLLM's own switch keeps it so (it would unfreeze).
    gc.collect()
    gc.freeze()
    os.environ["VLLM_ENABLE_CUDAGRAPH_GC"] = "1"
    log = _Lines()
    logging.getLogger("vllm").addHandler(log)
    found = {case: run_case(runner, case, log) for case in CASES}
    if runner == runners.V1:
        from tests.runtime import cpu_runner
        from vllm_capture_guard.tools.harness.sizes import capture_batches

        sizes = len(capture_batches(cpu_runner.make_config("CUSTOM")))
    else:  # the runner's own FULL descriptors
        sizes = max(c["descriptors"] or 0 for c in found.values())
    return {"runner": runner, "sizes": sizes, "cases": found}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else runners.V1)))
    sys.stdout.flush()
