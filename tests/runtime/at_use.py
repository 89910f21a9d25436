# SPDX-License-Identifier: Apache-2.0
"""Modified vLLM captures that only a guard at use can catch, and the capture
they must survive: vLLM's real capture sizes, largest first, one builder
instance per group, the runner's persistent buffers, MiniMax-M3's indexer
after the attention builder at every size.

Every capture here is derived at test time from the installed
``rocm_attn.py`` (``tests.variants`` does the reading and splicing). Each one
starts from the *fixed* capture (the installed one, less the
``query_start_loc_cpu.zero_()`` that 0.27/0.28 have), so the only hazard in
it is the one the case adds, and it applies on every release.

Run in a fresh interpreter (``python -m tests.runtime.at_use CASE``) with the
overlay first on ``PYTHONPATH``; it prints one JSON line.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
import textwrap
import types
from collections.abc import Mapping

from tests import variants as vv

CPU_ZERO = f"{vv.CPU_FIELD}.zero_()"
VENDOR = "capture_guard_test_vendor"  # a top-level module in the overlay


def _capture(text: str) -> tuple[ast.FunctionDef, str, vv.Editor]:
    tree = ast.parse(text)
    fn = vv.find_method(vv.find_class(tree, vv.BUILDER), vv.CAPTURE)
    return fn, fn.args.args[1].arg, vv.Editor(text)


def fixed(text: str) -> str:
    """The installed file with the capture's CPU zeroing removed (0.29.0's
    shape); unchanged where it is already so."""
    fn, arg, ed = _capture(text)
    stmt = vv.zeroing_in(fn.body, arg).get(vv.CPU_FIELD)
    if stmt is None:
        return text
    ed.replace(stmt.lineno - 1, stmt.end_lineno, "")
    return ed.text()


def _after_device_zeroing(text: str, lines: str, top: str = "") -> str:
    """``lines`` (with ``{cm}`` for the metadata argument) inserted after the
    fixed capture's device zeroing; ``top`` at the module's top level."""
    text = fixed(text)
    fn, arg, ed = _capture(text)
    stmt = vv.zeroing_in(fn.body, arg)[vv.DEVICE_FIELD]
    pad = vv.indent_of(ed.lines[stmt.lineno - 1])
    body = textwrap.indent(textwrap.dedent(lines).format(cm=arg), pad)
    ed.insert(stmt.end_lineno, body)
    if top:
        ed.insert(vv.span(vv.find_class(ast.parse(text), vv.BUILDER))[0], top)
    return ed.text()


def batch_dependent(text: str) -> str:
    """Writes the host offsets only for large batches."""
    return _after_device_zeroing(
        text, "if {cm}.num_reqs >= 256:\n    {cm}.query_start_loc_cpu.zero_()\n"
    )


def stateful(text: str) -> str:
    """Writes the host offsets from its second call on one builder on."""
    return _after_device_zeroing(
        text,
        'self._vendor_calls = getattr(self, "_vendor_calls", 0) + 1\n'
        "if self._vendor_calls > 1:\n    {cm}.query_start_loc_cpu.zero_()\n",
    )


def first_call_workspace(text: str) -> str:
    """Sizes a module-level workspace on its first call (fine when the first
    call is vLLM's largest size; a made-up small first call breaks it)."""
    text = _after_device_zeroing(
        text,
        "if _VENDOR_WORKSPACE is None:\n"
        "    _VENDOR_WORKSPACE = {cm}.query_start_loc.new_zeros({cm}.num_reqs + 1)\n"
        "_VENDOR_WORKSPACE.narrow(0, 0, {cm}.num_reqs + 1).copy_(\n"
        "    {cm}.query_start_loc[: {cm}.num_reqs + 1]\n)\n",
        top="_VENDOR_WORKSPACE = None\n\n\n",
    )
    fn, _, ed = _capture(text)  # a global statement comes first in the body
    first = fn.body[0]
    pad = vv.indent_of(ed.lines[first.lineno - 1])
    ed.insert(first.lineno - 1, f"{pad}global _VENDOR_WORKSPACE\n")
    return ed.text()


def other_host_field(text: str) -> str:
    """Sets the host upper bound of the sequence lengths to 1, as the capture
    does to the device ``seq_lens``."""
    return _after_device_zeroing(text, "{cm}.seq_lens_cpu_upper_bound.fill_(1)\n")


def affected(text: str) -> str:
    """The capture as 0.27/0.28 have it: device and host offsets zeroed."""
    return _after_device_zeroing(text, "{cm}.query_start_loc_cpu.zero_()\n")


def in_tree(text: str) -> str:
    """The file as ``vllm-capture-guard patch --apply`` writes it (the
    installed one where there is nothing to do)."""
    from vllm_capture_guard.tools.tree.locate import find_tree
    from vllm_capture_guard.tools.tree.plan import make_plan

    plan = make_plan(find_tree(vv.installed_vllm_dir()))
    assert not plan.refused, plan.refused
    new = plan.new.get(vv.ROCM_ATTN)
    return text if new is None else new.decode()


def vendor_module(text: str, how: str) -> str:
    """A vendor module, derived from ``text``'s capture made affected:
    ``put-back`` sets it on vLLM's ROCm builder; ``custom`` defines a
    subclass of the builder and a backend, registered as ``CUSTOM``."""
    fn, _, ed = _capture(affected(text))
    method = textwrap.dedent(ed.segment(fn))
    head = (
        "from __future__ import annotations\n\n"
        f"from {vv.ROCM_MODULE} import *  # noqa: F403\n"
        f"from {vv.ROCM_MODULE} import {vv.BUILDER}, {vv.BACKEND}\n\n\n"
    )
    if how == "put-back":
        return head + method + f"\n\n{vv.BUILDER}.{vv.CAPTURE} = {vv.CAPTURE}\n"
    return (
        head
        + f"class VendorBuilder({vv.BUILDER}):\n"
        + textwrap.indent(method, "    ")
        + f"\n\nclass VendorBackend({vv.BACKEND}):\n"
        + "    @staticmethod\n"
        + "    def get_builder_cls():\n        return VendorBuilder\n\n\n"
        + "from vllm.v1.attention.backends.registry import (  # noqa: E402\n"
        + "    AttentionBackendEnum,\n    register_backend,\n)\n\n"
        + f"register_backend(AttentionBackendEnum.CUSTOM, '{VENDOR}.VendorBackend')\n"
    )


#: case -> (what happens to rocm_attn.py, the vendor module if any, the
#: backend that captures, what happens between import and capture)
CASES = {
    "batch-dependent": (batch_dependent, None, "ROCM_ATTN", None),
    "stateful": (stateful, None, "ROCM_ATTN", None),
    "first-call-workspace": (first_call_workspace, None, "ROCM_ATTN", None),
    "other-host-field": (other_host_field, None, "ROCM_ATTN", None),
    "put-back": (fixed, "put-back", "ROCM_ATTN", "import-vendor"),
    "late-reload": (affected, None, "ROCM_ATTN", "reload"),
    "custom-subclass": (in_tree, "custom", "CUSTOM", "import-vendor"),
}


def derive(case: str, installed: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{path under the overlay: text}``: a changed ``vllm/...`` file and, for
    some cases, the vendor module beside the ``vllm`` package."""
    src = vv.Installed() if installed is None else installed
    change, vendor, _, _ = CASES[case]
    text = src[vv.ROCM_ATTN]
    vv.rocm_capture(affected(text))  # the installed file is shaped as expected
    out = {vv.ROCM_ATTN: vv._marked(change(text), case)}
    if vendor:
        out[f"../{VENDOR}.py"] = vendor_module(text, vendor)
    return out


# --- in the fresh interpreter -------------------------------------------------


def enter_capture() -> None:
    """Call vLLM's own capture entry, V1's ``GPUModelRunner.capture_model``, on
    a runner whose graphs are off: vLLM returns at once, after whatever the
    guard does at that entry."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    compilation = types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE)
    runner = types.SimpleNamespace(compilation_config=compilation)
    assert GPUModelRunner.capture_model(runner) == 0


def run(case: str, entry: bool = True) -> dict:
    import vllm.plugins

    from vllm_capture_guard.tools import harness
    from vllm_capture_guard.tools.contract import CPU

    vllm.plugins.load_general_plugins()  # as every vLLM process does
    # A worker imports its model runner before the model's backends: every
    # hooked import happens before what the case changes, so only the capture
    # entry can see that change.
    import vllm.v1.worker.gpu_model_runner  # noqa: F401

    from vllm_capture_guard.tools.harness.sizes import capture_batches, run_sizes

    config = harness.make_vllm_config(0, graphs=True)  # vLLM's own sizes
    batches = capture_batches(config)
    _, _, backend, between = CASES[case]
    harness.backend_class("ROCM_ATTN")  # vLLM imports the backend module
    if between == "reload":
        importlib.reload(sys.modules[vv.ROCM_MODULE])
    elif between == "import-vendor":
        importlib.import_module(VENDOR)
    builders = [
        ("attention", harness.attention_builder(backend, config)),
        ("indexer", harness.indexer_builder(config)),
    ]
    if entry:
        enter_capture()
    failures = []
    for batch, run in zip(batches, run_sizes(builders, batches).runs, strict=True):
        host = [w.field for g in run.groups for w in g.writes if w.side == CPU]
        if run.failed or host:
            error = run.failed.error if run.failed else None
            failures.append(
                {"size": batch.num_reqs, "error": error, "host_writes": host}
            )
    sizes = [b.num_reqs for b in batches]
    return {
        "sizes": len(sizes),
        "largest": sizes[0],
        "builder": type(builders[0][1]).__name__,
        "failures": failures,
    }


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], entry="no-entry" not in sys.argv[2:])))
