# SPDX-License-Identifier: Apache-2.0
"""The capture-stream backport on vendor-shaped copies of Model Runner V2's
``CudaGraphManager.capture``, derived at test time from the installed
``vllm/v1/worker/gpu/cudagraph_utils.py`` (its ``torch.cuda.graph(...)`` call
rewritten, nothing else): an alias of ``torch.cuda.graph`` bound at module
level, a stream that is ``None`` at run time behind a switch, and a
positional ``None`` stream.

vLLM's own ``CudaGraphManager.capture`` runs with a recording
``torch.cuda.graph`` (``tests/capture_sites.py``), in a process loaded
through vLLM's plugin loader with the overlay first on ``PYTHONPATH``: with
the backport off the capture gets no stream, with it on vLLM's current one.
"""

from __future__ import annotations

import ast
import json

import pytest

from tests import variants as vv
from tests import warm
from tests.conftest import fresh_env

REL = "v1/worker/gpu/cudagraph_utils.py"
MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
SWITCH = "VENDOR_CAPTURE_ON_CURRENT_STREAM"


def _graph_call(text: str) -> tuple[ast.Call, ast.stmt]:
    """The one ``torch.cuda.graph`` call of ``CudaGraphManager.capture``, and
    the innermost statement that holds it (a ``with`` whose items may span
    several lines, as in 0.33)."""
    cls = vv.find_class(ast.parse(text), "CudaGraphManager", REL)
    method = vv.find_method(cls, "capture")
    calls = [
        n
        for n in ast.walk(method)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.graph"
    ]
    if len(calls) != 1:
        raise vv.VariantMismatch(f"{len(calls)} torch.cuda.graph calls in capture")
    (call,) = calls
    holders = [
        n
        for n in ast.walk(method)
        if isinstance(n, ast.stmt)
        and n is not method
        and n.lineno <= call.lineno
        and call in ast.walk(n)
    ]
    return call, max(holders, key=lambda n: n.lineno)


def _rewrite(text: str, call_text: str, before: str = "", top: str = "") -> str:
    """The call replaced by ``call_text`` (``{g}``, ``{pool}``: its first two
    arguments); ``before`` put on a line of its own before the statement."""
    call, stmt = _graph_call(text)
    g = ast.get_source_segment(text, call.args[0])
    pool = (
        ast.get_source_segment(text, call.args[1])
        if len(call.args) > 1
        else next(ast.unparse(k.value) for k in call.keywords if k.arg == "pool")
    )
    lines = text.splitlines(keepends=True)
    first, last = lines[call.lineno - 1], lines[call.end_lineno - 1]
    new = first[: call.col_offset] + call_text.format(g=g, pool=pool)
    new += last[call.end_col_offset :]
    lines[call.lineno - 1 : call.end_lineno] = [new]
    if before:  # on a line of its own, before the statement that holds it
        pad = vv.indent_of(lines[stmt.lineno - 1])
        lines.insert(stmt.lineno - 1, f"{pad}{before}\n")
    out = "".join(lines)
    return top + out if top else out


VARIANTS = {
    "module-level-alias": lambda t: _rewrite(
        t, "cuda_graph({g}, {pool})", top="from torch.cuda import graph as cuda_graph\n"
    ),
    "none-behind-a-switch": lambda t: _rewrite(
        t,
        "torch.cuda.graph({g}, {pool}, stream=capture_stream)",
        before=(
            "capture_stream = (torch.cuda.current_stream() if "
            f"__import__('os').environ.get('{SWITCH}') else None)"
        ),
    ),
    "positional-none": lambda t: _rewrite(t, "torch.cuda.graph({g}, {pool}, None)"),
}

#: Loads plugins as a worker does, imports the variant, and records what
#: stream vLLM's capture passes. A module-level alias was bound at import to
#: torch's graph; during the CPU capture torch's graph is the recorder, so the
#: alias is bound to it too, as the import would have bound it.
RECORD = f"""
import json, sys
import vllm.plugins
vllm.plugins.load_general_plugins()
from tests import capture_sites as cs
import {MODULE} as m
rec = cs.Recorder()
with cs.cpu_capture(rec):
    if hasattr(m, "cuda_graph"):
        m.cuda_graph = sys.modules["torch"].cuda.graph
    cs.drive_capture(rec)
from vllm_capture_guard.runtime.plugin import report
r = report()
print(json.dumps({{
    "streams": cs.summary(rec)["streams"],
    "marker": m._VLLM_CAPTURE_GUARD_TEST_VARIANT,
    "status": r and {{k: o.status.value for k, o in r.outcomes.items()}},
}}))
"""


@pytest.fixture(scope="module")
def overlays(tmp_path_factory) -> dict:
    text = vv.read_installed(REL)
    found = {}
    for name, make in VARIANTS.items():
        files = {REL: vv._marked(make(text), name)}
        dest = tmp_path_factory.mktemp(name)
        vv.make_overlay(files, dest)
        found[name] = dest
    return found


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_backport_fills_in_the_stream_at_run_time(variant, overlays):
    runs = {}
    for mode in ("off", "on"):
        env = fresh_env(VLLM_CAPTURE_GUARD="on", **{SWITCH: None})
        env = vv.overlay_env(overlays[variant], env)
        if mode == "off":
            env["VLLM_CAPTURE_GUARD_DISABLE"] = "graph-capture-stream"
        proc = warm.python(["-c", RECORD], env, cwd=vv.ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert runs[mode]["marker"] == variant
    assert runs["off"]["streams"] == [None], runs["off"]  # torch's side stream
    assert runs["on"]["streams"] == ["current"], runs["on"]
    assert runs["on"]["status"]["graph-capture-stream"] == "patched"
