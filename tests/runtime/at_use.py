# SPDX-License-Identifier: Apache-2.0
"""Captures that only a guard at use catches, run through vLLM's own V1
start-up (:mod:`tests.runtime.cpu_runner`: ``profile_cudagraph_memory``,
``initialize_kv_cache``, ``capture_model`` at every size, a serving-time
``execute_dummy_batch``), with MiniMax-M3's indexer in the second KV-cache
group after the case's attention builder.

Every case's builder is derived at test time from the installed
``rocm_attn.py`` (``tests.variants`` locates and splices; no vLLM source is
stored): the ROCm builder class, renamed, with the *fixed* capture (the
installed one less the ``query_start_loc_cpu.zero_()`` that 0.27/0.28 have)
plus the one hazard the case adds, so each case applies on every release.
Its backend subclasses vLLM's ROCm backend and is registered as ``CUSTOM``,
so the builder is made by vLLM's ``AttentionGroup`` inside its runner. It is
not a subclass of vLLM's ROCm builder (the last case asks exactly that).

One process per guard mode runs every case, each on a runner of its own
(``python -m tests.runtime.at_use MODE`` with :func:`write` 's folder first on
``PYTHONPATH``); it prints one JSON line: per case, each step and the first
error, and the guard's log lines.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path

from tests import variants as vv

MODULE = "capture_guard_cases"  # the derived builders and backends
RUNNER_MODULE = "capture_guard_case_runner"  # the vendor runner of one case
NEUTRAL = "vendor_request_offsets"  # a host field whose name does not say so


@dataclasses.dataclass(frozen=True)
class Case:
    doc: str
    edit: Callable[[str, str], str]  # (class text, metadata arg) -> class text
    between: str | None = None  # the step before which the affected capture goes on
    runner: str = "vllm"  # vllm, subclass (no super()), fork (a copied module)
    device: bool = False  # device fields report a GPU (tests.fake_device)
    passes_unguarded: bool = False
    wrote: tuple[str, ...] = ("query_start_loc_cpu",)  # the fields the log names
    metadata: str | None = None  # slotted metadata: "subclass" or "replaced"


# --- the class text: the fixed capture, then one hazard ------------------------


def _capture(text: str) -> ast.FunctionDef:
    return vv.find_method(ast.parse(text).body[0], vv.CAPTURE)


def _fixed(text: str) -> str:
    fn = _capture(text)
    stmt = vv.zeroing_in(fn.body, fn.args.args[1].arg).get(vv.CPU_FIELD)
    if stmt is None:
        return text
    ed = vv.Editor(text)
    ed.replace(stmt.lineno - 1, stmt.end_lineno, "")
    return ed.text()


def _after_device_zeroing(lines: str, top: str = "") -> Callable[[str, str], str]:
    def edit(text: str, cm: str) -> str:
        fn = _capture(text)
        stmt = vv.zeroing_in(fn.body, cm)[vv.DEVICE_FIELD]
        ed = vv.Editor(text)
        pad = vv.indent_of(ed.lines[stmt.lineno - 1])
        ed.insert(stmt.end_lineno, textwrap.indent(textwrap.dedent(lines), pad))
        return ed.text()

    return edit


def _nothing(text: str, cm: str) -> str:
    return text


AFFECTED = None  # set below, once _lines exists


def _lines(template: str) -> Callable[[str, str], str]:
    """Insert ``template`` (``{cm}``: the metadata argument) after the
    capture's device zeroing."""
    return lambda text, cm: _after_device_zeroing(template.format(cm=cm))(text, cm)


def _alias_in_build(text: str, cm: str) -> str:
    """``build()`` keeps the shared host offsets in what it returns, under
    another name; the capture zeroes them there."""
    cls = ast.parse(text).body[0]
    build = vv.find_method(cls, "build")
    arg = build.args.args[2].arg  # (self, common_prefix_len, common_attn_metadata)
    returns = [n for n in ast.walk(build) if isinstance(n, ast.Return)]
    ed = vv.Editor(text)
    for ret in returns:
        pad = vv.indent_of(ed.lines[ret.lineno - 1])
        value = ast.get_source_segment(text, ret.value)
        ed.replace(
            ret.lineno - 1,
            ret.end_lineno,
            f"{pad}_vendor = {value}\n"
            f"{pad}_vendor.host_offsets = {arg}.query_start_loc_cpu\n"
            f"{pad}return _vendor\n",
        )
    text = ed.text()
    fn = _capture(text)
    built = next(
        s.targets[0].id
        for s in fn.body
        if isinstance(s, ast.Assign) and "self.build" in ast.unparse(s.value)
    )
    return _after_device_zeroing(f"{built}.host_offsets.zero_()\n")(text, cm)


def _per_instance(text: str, cm: str) -> str:
    """``__init__`` binds the instance's capture to a method of its own (as
    vLLM's ``CustomOp`` binds its forward); the class's capture is fixed."""
    affected = AFFECTED(text, cm)
    method = vv.Editor(affected).segment(_capture(affected))
    method = method.replace(f"def {vv.CAPTURE}(", "def _vendor_capture(", 1)
    init = vv.find_method(ast.parse(text).body[0], "__init__")
    ed = vv.Editor(text)
    pad = vv.indent_of(ed.lines[init.body[0].lineno - 1])
    bind = f"{pad}self.{vv.CAPTURE} = self._vendor_capture\n\n"
    ed.insert(init.end_lineno, bind + method)
    return ed.text()


AFFECTED = _lines("{cm}.query_start_loc_cpu.zero_()\n")

CASES: dict[str, Case] = {
    "batch-dependent": Case(
        "writes the host offsets only at 256 requests and more",
        _lines("if {cm}.num_reqs >= 256:\n    {cm}.query_start_loc_cpu.zero_()\n"),
    ),
    "stateful": Case(
        "writes the host offsets from its second call on one builder on",
        _lines(
            'self._vendor_calls = getattr(self, "_vendor_calls", 0) + 1\n'
            "if self._vendor_calls > 1:\n    {cm}.query_start_loc_cpu.zero_()\n"
        ),
    ),  # fmt: skip
    "first-call-workspace": Case(
        "sizes a workspace on its first call (vLLM's largest size): fine both ways",
        _lines(
            "if getattr(self, '_vendor_ws', None) is None:\n"
            "    self._vendor_ws = {cm}.query_start_loc.new_zeros({cm}.num_reqs + 1)\n"
            "self._vendor_ws.narrow(0, 0, {cm}.num_reqs + 1).copy_(\n"
            "    {cm}.query_start_loc[: {cm}.num_reqs + 1]\n)\n"
        ),
        passes_unguarded=True,
    ),  # fmt: skip
    "other-host-field": Case(
        "sets the host upper bound of the sequence lengths to 1",
        _lines(
            "{cm}.seq_lens_cpu_upper_bound.fill_(1)\n{cm}.query_start_loc_cpu.zero_()\n"
        ),
        wrote=("query_start_loc_cpu", "seq_lens_cpu_upper_bound"),
    ),  # fmt: skip
    "neutral-host-field": Case(
        "a vendor runner hands a host view of the offsets under a neutral name, "
        "which the capture zeroes (device fields on a GPU)",
        _lines(f"{{cm}}.{NEUTRAL}.zero_()\n"),
        runner="fork",
        device=True,
        wrote=("query_start_loc_cpu", NEUTRAL),
    ),
    "neutral-host-field-on-a-cpu-host": Case(
        "the same, with every field on the CPU: names decide there and this "
        "name does not say host, but its memory is the named host offsets', "
        "which the guard puts back",
        _lines(f"{{cm}}.{NEUTRAL}.zero_()\n"),
        runner="fork",
    ),
    "alias-in-build": Case(
        "build() keeps the shared host offsets under another name; the capture "
        "zeroes them there",
        _alias_in_build,
    ),
    "per-instance": Case(
        "__init__ binds the capture per instance to one that zeroes the offsets",
        _per_instance,
    ),
    "made-late": Case(
        "the backend makes its builder class, with the zeroing capture, on its "
        "first get_builder_cls() call (inside profile_cudagraph_memory)",
        _nothing,
        between="made-late",
    ),
    "runner-subclass": Case(
        "a runner subclass whose capture entries do not call super(); the "
        "zeroing capture put back on the class after import",
        _nothing,
        between="profile_cudagraph_memory",
        runner="subclass",
    ),
    "dummy-batch": Case(
        "the zeroing capture put back on the class while serving, before an idle "
        "data-parallel rank's execute_dummy_batch",
        _nothing,
        between="execute_dummy_batch",
    ),
    "slotted-subclass": Case(
        "a vendor runner makes its metadata as a @dataclass(slots=True) "
        "subclass of vLLM's (an instance dict, empty: the fields are slots)",
        AFFECTED,
        metadata="subclass",
    ),
    "slotted-class": Case(
        "a vendor declares CommonAttentionMetadata itself @dataclass(slots=True) "
        "(no instance dict), as the runner module imports it by name",
        AFFECTED,
        metadata="replaced",
    ),
    "unrelated-builder": Case(
        "a builder class that is not derived from vLLM's ROCm builder, with the "
        "capture of vLLM 0.27/0.28 (as a new ROCm backend in review upstream)",
        AFFECTED,
    ),
}


def _camel(case: str) -> str:
    return "".join(p.capitalize() for p in case.split("-"))


def _classes(src: str, case: str) -> str:
    """The case's builder, its affected twin (whose capture a put-back uses)
    and its backend."""
    cls = vv.find_class(ast.parse(src), vv.BUILDER)
    text = _fixed(vv.Editor(src).segment(cls))
    cm = _capture(text).args.args[1].arg
    if vv.DEVICE_FIELD not in vv.zeroing_in(_capture(text).body, cm):
        raise vv.VariantMismatch(f"{vv.BUILDER}'s capture no longer zeroes the offsets")
    name = f"Case{_camel(case)}Builder"
    head = f"class {vv.BUILDER}("
    built = CASES[case].edit(text, cm).replace(head, f"class {name}(", 1)
    twin = AFFECTED(text, cm).replace(head, f"class {name}Affected(", 1)
    made = f"_late_builder({name}, {name}Affected)" if case == "made-late" else name
    backend = (
        f"class Case{_camel(case)}Backend({vv.BACKEND}):\n"
        f"    @staticmethod\n    def get_builder_cls():\n        return {made}\n"
    )
    return "\n\n".join([built, twin, backend]) + "\n"


_LATE = '''
_LATE = {}


def _late_builder(base, affected):
    """A class defined on the first call, whose capture zeroes the offsets."""
    if base not in _LATE:
        capture = affected.__dict__["build_for_cudagraph_capture"]
        _LATE[base] = type(base.__name__ + "Late", (base,),
                           {"build_for_cudagraph_capture": capture})
    return _LATE[base]
'''


def derive(installed: vv.Installed | None = None) -> dict[str, str]:
    """``{file name: text}`` for the folder that goes first on
    ``PYTHONPATH``: the cases' module, and the vendor runner."""
    src = installed or vv.Installed()
    head = (
        "# Derived at test time from the installed vLLM (tests/runtime/at_use.py)\n"
        "from __future__ import annotations\n\n"
        f"from {vv.ROCM_MODULE} import *  # noqa: F403\n"
        f"from {vv.ROCM_MODULE} import {vv.BACKEND}\n"
    )
    body = [_classes(src[vv.ROCM_ATTN], case) for case in CASES]
    out = {f"{MODULE}.py": head + _LATE + "\n\n" + "\n\n".join(body)}
    out[f"{RUNNER_MODULE}.py"] = vendor_runner(src["v1/worker/gpu_model_runner.py"])
    for name, code in out.items():
        compile(code, name, "exec")
    return out


def vendor_runner(text: str) -> str:
    """vLLM's ``gpu_model_runner.py`` as a vendor's fork: its relative imports
    made absolute, and the shared metadata given a host view of the query
    offsets under a neutral name, right after the runner makes it."""
    tree = ast.parse(text)
    ed = vv.Editor(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            line = ed.lines[node.lineno - 1]
            ed.replace(
                node.lineno - 1,
                node.lineno,
                line.replace("from .", "from vllm.v1.worker.", 1),
            )
    made = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and ast.unparse(n.value.func) == "CommonAttentionMetadata"
        and any(k.arg == vv.CPU_FIELD for k in n.value.keywords)
    ]
    if len(made) != 1:
        raise vv.VariantMismatch("the runner makes no one CommonAttentionMetadata")
    stmt = made[0]
    view = next(k.value for k in stmt.value.keywords if k.arg == vv.CPU_FIELD)
    target = ast.unparse(stmt.targets[0])
    pad = vv.indent_of(ed.lines[stmt.lineno - 1])
    ed.insert(
        stmt.end_lineno,
        f"{pad}{target}.{NEUTRAL} = {ast.get_source_segment(text, view)}\n",
    )
    return ed.text()


def write(dest: Path) -> Path:
    for name, text in derive().items():
        (dest / name).write_text(text)
    return dest


# --- in the process that runs the cases -------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "vllm-capture-guard" in message:
            self.lines.append(f"{record.levelname} {message}")


def _runner_class(kind: str) -> type:
    from vllm.v1.worker import gpu_model_runner

    base = gpu_model_runner.GPUModelRunner
    if kind == "fork":
        import importlib

        return importlib.import_module(RUNNER_MODULE).GPUModelRunner
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


def _on_device(runner) -> None:  # noqa: ANN001
    """Every device buffer of the runner reports a GPU (data stays on the
    CPU, tests.fake_device), as on a ROCm host."""
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    from tests.fake_device import DeviceTensor

    holders = [runner, getattr(runner, "input_batch", None)]
    block_table = getattr(holders[1], "block_table", None)
    holders += list(getattr(block_table, "block_tables", []) or [])
    for holder in holders:
        for name, value in list(vars(holder or object()).items()):
            if isinstance(value, CpuGpuBuffer) and value.gpu is not value.cpu:
                value.gpu = value.gpu.as_subclass(DeviceTensor)
            elif (
                isinstance(value, torch.Tensor)
                and not isinstance(value, DeviceTensor)
                and "cpu" not in name
                and holder is runner
                and name in ("seq_lens", "positions")
            ):
                setattr(holder, name, value.as_subclass(DeviceTensor))


#: What ``dataclass()`` makes, and ``copy``'s cache of slot names: left out
#: when a class is declared again.
MADE = frozenset({"__dict__", "__weakref__", "__init__", "__repr__", "__eq__",
                  "__hash__", "__match_args__", "__dataclass_fields__",
                  "__dataclass_params__", "__slotnames__"})  # fmt: skip


#: How many metadata objects the runner made of the slotted class.
SLOTTED = {"made": 0}


def slotted_metadata(kind: str) -> Callable[[], None]:
    """vLLM's ``CommonAttentionMetadata`` made slotted, where vLLM's attention
    package and the runner module name it: a ``@dataclass(slots=True)``
    subclass, or the class itself declared again from its own namespace with
    ``slots=True``. Returns the undo."""
    from vllm.v1.attention import backend
    from vllm.v1.worker import gpu_model_runner

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
    modules = [m for m in (backend, gpu_model_runner) if getattr(m, name) is common]
    for module in modules:
        setattr(module, name, made)

    def undo() -> None:
        for module in modules:
            setattr(module, name, common)

    return undo


def run_case(case: str, log: _Lines) -> dict:
    """One case on a runner of its own; slotted metadata only while it runs."""
    kind = CASES[case].metadata
    undo = slotted_metadata(kind) if kind else None
    try:
        return _run_case(case, log)
    finally:
        if undo is not None:
            undo()


def _run_case(case: str, log: _Lines) -> dict:
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from tests.runtime import cpu_runner

    spec = CASES[case]
    module = __import__(MODULE)
    builder = getattr(module, f"Case{_camel(case)}Builder")
    backend = getattr(module, f"Case{_camel(case)}Backend")
    register_backend(AttentionBackendEnum.CUSTOM, f"{MODULE}.{backend.__name__}")
    affected = getattr(module, f"{builder.__name__}Affected").__dict__[vv.CAPTURE]
    start = len(log.lines)
    from vllm_capture_guard.runtime import guard

    before = {n: s["calls"] for n, s in guard.SEEN.items()}
    config = cpu_runner.make_config("CUSTOM")
    runner = cpu_runner.make_runner(config, backend, _runner_class(spec.runner))

    def between(step: str) -> None:
        if spec.device:
            _on_device(runner)
        if step == spec.between:
            setattr(builder, vv.CAPTURE, affected)  # put back on the class

    if spec.device:
        initialize = runner.initialize_kv_cache

        def initialize_kv_cache(*args, **kwargs):  # noqa: ANN002, ANN003
            done = initialize(*args, **kwargs)
            _on_device(runner)
            return done

        runner.initialize_kv_cache = initialize_kv_cache
    steps = cpu_runner.start_up(runner, between)
    made = {
        type(b).__name__
        for groups in runner.attn_groups
        for g in groups
        for b in g.metadata_builders
    }
    return {
        "steps": [dataclasses.asdict(s) for s in steps],
        "builders": sorted(made),
        "calls": {
            n: s["calls"] - before.get(n, 0) for n, s in guard.SEEN.items() if n in made
        },
        "log": log.lines[start:],
        "device": spec.device and type(runner.query_start_loc.gpu).__name__,
        "slotted_made": SLOTTED["made"] if spec.metadata else None,
    }


def main() -> dict:
    import gc
    import os

    import vllm.plugins

    vllm.plugins.load_general_plugins()  # as every vLLM process does
    import vllm.v1.worker.gpu_model_runner  # noqa: F401  (a worker's first import)

    from tests.runtime import cpu_runner

    cpu_runner.stub_gpu_leaves()
    # vLLM runs a full garbage collection around every capture phase (0.5 s
    # each over torch's and vLLM's objects); what is imported by now is frozen
    # out of them, and vLLM's own switch keeps it so (it would unfreeze).
    gc.collect()
    gc.freeze()
    os.environ["VLLM_ENABLE_CUDAGRAPH_GC"] = "1"
    log = _Lines()
    logging.getLogger("vllm").addHandler(log)
    from vllm_capture_guard.tools.harness.sizes import capture_batches

    found = {case: run_case(case, log) for case in CASES}
    sizes = len(capture_batches(cpu_runner.make_config("CUSTOM")))
    return {"sizes": sizes, "cases": found}


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
