# SPDX-License-Identifier: Apache-2.0
"""Captures that only a guard at use catches, derived at test time, with
MiniMax-M3's indexer in the second KV-cache group after the case's attention
builder. They run through vLLM's own start-up on the CPU, on each GPU model
runner the installed vLLM has (:mod:`tests.runtime.at_use_run`).

Every case's builder is derived at test time from the installed
``rocm_attn.py`` (``tests.variants`` locates and splices; no vLLM source is
stored): the ROCm builder class, renamed, with the *fixed* capture (the
installed one less the ``query_start_loc_cpu.zero_()`` that 0.27/0.28 have)
plus the one hazard the case adds, so each case applies on every release.
Its backend subclasses vLLM's ROCm backend and is registered as ``CUSTOM``,
so the builder is made by vLLM's ``AttentionGroup`` inside its runner. It is
not a subclass of vLLM's ROCm builder (the last case asks exactly that).

A vendor's fork (the ``fork`` cases) is derived the same way, per runner,
from the installed file where that runner makes its
``CommonAttentionMetadata``: the V1 runner's ``gpu_model_runner.py``, Model
Runner V2's ``attn_utils.py`` (its model states build through it).
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from collections.abc import Callable
from pathlib import Path

from tests import variants as vv
from vllm_capture_guard.tools.harness import runners

MODULE = "capture_guard_cases"  # the derived builders and backends
NEUTRAL = "vendor_request_offsets"  # a host field whose name does not say so
#: Per runner: the installed file where it makes its CommonAttentionMetadata,
#: its package, and the module name of a vendor's fork of it.
FORKED = {
    runners.V1: ("v1/worker/gpu_model_runner.py", "vllm.v1.worker"),
    runners.V2: ("v1/worker/gpu/attn_utils.py", "vllm.v1.worker.gpu"),
}
FORK_MODULE = {
    runners.V1: "capture_guard_case_runner",
    runners.V2: "capture_guard_case_attn_utils",
}


@dataclasses.dataclass(frozen=True)
class Case:
    doc: str
    edit: Callable[[str, str], str]  # (class text, metadata arg) -> class text
    between: str | None = None  # the step before which the affected capture goes on
    #: vllm; subclass (of the runner, capture entries without super()); fork
    #: (a copy of the module that makes the metadata, see the module)
    runner: str = "vllm"
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
        "raises the host upper bound of the sequence lengths by one (a value "
        "no capture batch holds already: Model Runner V2's are all 1)",
        _lines(
            "{cm}.seq_lens_cpu_upper_bound.add_(1)\n{cm}.query_start_loc_cpu.zero_()\n"
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
        "first get_builder_cls() call (as the runner makes its attention groups, "
        "inside its start-up)",
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


def camel(case: str) -> str:
    return "".join(p.capitalize() for p in case.split("-"))


def _classes(src: str, case: str) -> str:
    """The case's builder, its affected twin (whose capture a put-back uses)
    and its backend."""
    cls = vv.find_class(ast.parse(src), vv.BUILDER)
    text = _fixed(vv.Editor(src).segment(cls))
    cm = _capture(text).args.args[1].arg
    if vv.DEVICE_FIELD not in vv.zeroing_in(_capture(text).body, cm):
        raise vv.VariantMismatch(f"{vv.BUILDER}'s capture no longer zeroes the offsets")
    name = f"Case{camel(case)}Builder"
    head = f"class {vv.BUILDER}("
    built = CASES[case].edit(text, cm).replace(head, f"class {name}(", 1)
    twin = AFFECTED(text, cm).replace(head, f"class {name}Affected(", 1)
    made = f"_late_builder({name}, {name}Affected)" if case == "made-late" else name
    backend = (
        f"class Case{camel(case)}Backend({vv.BACKEND}):\n"
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
    ``PYTHONPATH``: the cases' module, and a vendor's fork for each GPU model
    runner the installed vLLM has."""
    src = installed or vv.Installed()
    head = (
        "# Derived at test time from the installed vLLM (tests/runtime/at_use.py)\n"
        "from __future__ import annotations\n\n"
        f"from {vv.ROCM_MODULE} import *  # noqa: F403\n"
        f"from {vv.ROCM_MODULE} import {vv.BACKEND}\n"
    )
    body = [_classes(src[vv.ROCM_ATTN], case) for case in CASES]
    out = {f"{MODULE}.py": head + _LATE + "\n\n" + "\n\n".join(body)}
    for runner, (rel, package) in FORKED.items():
        if runners.present(runner):
            out[f"{FORK_MODULE[runner]}.py"] = vendor_fork(src[rel], package)
    for name, code in out.items():
        compile(code, name, "exec")
    return out


def vendor_fork(text: str, package: str) -> str:
    """A vendor's fork of the vLLM module ``text`` of ``package`` (where a
    runner makes its metadata): its relative imports made absolute, and the
    shared metadata given a host view of the query offsets under a neutral
    name (``[:]``: a tensor of its own over their memory), right after the
    module makes it."""
    tree = ast.parse(text)
    ed = vv.Editor(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1:
                raise vv.VariantMismatch(f"{package}: an import {node.level} up")
            line = ed.lines[node.lineno - 1]
            ed.replace(
                node.lineno - 1,
                node.lineno,
                line.replace("from .", f"from {package}.", 1),
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
        raise vv.VariantMismatch(f"{package}: no one CommonAttentionMetadata made")
    stmt = made[0]
    view = next(k.value for k in stmt.value.keywords if k.arg == vv.CPU_FIELD)
    target = ast.unparse(stmt.targets[0])
    pad = vv.indent_of(ed.lines[stmt.lineno - 1])
    ed.insert(
        stmt.end_lineno,
        f"{pad}{target}.{NEUTRAL} = ({ast.get_source_segment(text, view)})[:]\n",
    )
    return ed.text()


def write(dest: Path) -> Path:
    for name, text in derive().items():
        (dest / name).write_text(text)
    return dest
