# SPDX-License-Identifier: Apache-2.0
"""Capture on the current stream (PR #53818): vLLM's own three capture
functions, driven on the CPU through their ``torch.cuda.graph`` call with a
recording fake of it (``tests/capture_sites.py``). Whether a release is
affected is decided by running its capture unguarded, never by the patch.
Each test covers the sites the installed vLLM has (0.34.0 has no Gemma4
proposer in ``vllm/v1/spec_decode/``)."""

from __future__ import annotations

import pytest
import torch

from tests import capture_sites as cs
from tests.conftest import guard_lines, run_snippet
from vllm_capture_guard.runtime.patches import graph_capture_stream as mod
from vllm_capture_guard.runtime.patching import MARKER, Status
from vllm_capture_guard.tools.fixes import by_name
from vllm_capture_guard.tools.guard import inspect
from vllm_capture_guard.tools.revert import revert

PATCH = by_name("graph-capture-stream")
#: The sites this vLLM has, and the patch's (module, class, function) of each.
PRESENT = cs.present()
WHERE = [
    where for site, where in zip(cs.SITES, mod.SITES, strict=True) if site in PRESENT
]


@pytest.fixture(scope="module")
def unguarded() -> dict:
    """What each site passes with no guard (this process never loads it)."""
    cs.import_sites()
    return {site: cs.summary(cs.record(site)) for site in PRESENT}


@pytest.fixture(scope="module")
def affected(unguarded) -> bool:
    return any(None in found["streams"] for found in unguarded.values())


def _functions() -> dict:
    return {f"{c}.{n}": vars(getattr(__import__(m, fromlist=[c]), c))[n]
            for m, c, n in WHERE}  # fmt: skip


def test_unguarded_release_as_read_by_the_tools(unguarded, affected):
    """Each site passes the current stream (fixed) or none at all (the bug);
    the tools' reading of the source says the same; the patch itself goes on
    every site, whatever the reading."""
    from vllm_capture_guard.tools.fixes import graph_capture_stream as fix

    for site, found in unguarded.items():
        assert set(found["streams"]) in ({"current"}, {None}), (site, found)
    read = fix.readings()
    assert len(read) == len(PRESENT) and all(r.needed is affected for r in read), read
    assert inspect(PATCH).status is Status.NEEDED


@pytest.mark.parametrize("site", PRESENT)
def test_guarded_capture_is_on_the_current_stream(site, unguarded, unpatched):
    outcome = PATCH.apply()
    assert outcome.status is Status.PATCHED and outcome.warning is None, outcome
    found = cs.summary(cs.record(site))
    assert found["streams"] and set(found["streams"]) == {"current"}, found
    # code called from inside the capture, and another thread meanwhile, see
    # torch's own torch.cuda.graph; decorators still apply (inference mode)
    assert found["others_see_torch_graph"], found
    assert found["inference_mode"] == unguarded[site]["inference_mode"]


def test_a_fixed_release_captures_as_it_does_unguarded(unguarded, unpatched):
    """The copy goes on every release; where vLLM passes its stream (0.29.0
    and later) the guarded capture passes the very same."""
    PATCH.apply()
    for site in PRESENT:
        found = cs.summary(cs.record(site))
        assert found["streams"] == ["current"] * len(unguarded[site]["streams"])


def test_apply_is_idempotent_and_revert_restores(unpatched):
    before = _functions()
    assert PATCH.apply().status is Status.PATCHED
    patched = _functions()
    assert all(getattr(f, MARKER) is before[k] for k, f in patched.items())
    assert PATCH.apply().status is Status.ALREADY
    assert _functions() == patched
    assert revert(PATCH)
    assert all(f is before[k] for k, f in _functions().items())


def test_a_given_stream_is_kept():
    recorder = cs.Recorder()
    other = cs.Stream("other")
    with cs.cpu_capture(recorder):
        mod.graph("g", stream=other)
        mod.graph("g", None, other)
        mod.graph("g", "pool")
        mod.graph("g", pool="pool", stream=None)
    assert recorder.streams == [other, other, cs.STREAM, cs.STREAM]


def test_unreadable_source_is_patched_and_incomplete(unguarded, unpatched, monkeypatch):
    """What it cannot read it cannot vouch for: patched anyway, and the status
    says incomplete, with a WARNING."""

    def unreadable(fn):
        raise OSError("could not get source code")

    monkeypatch.setattr(mod.inspect, "getsource", unreadable)
    outcome = PATCH.apply()
    assert outcome.status is Status.INCOMPLETE
    assert "CudaGraphManager.capture: its source cannot be read" in outcome.warning
    found = cs.summary(cs.record("capture"))
    assert set(found["streams"]) == {"current"}


SNIPPET = """
import json, os, sys
from tests import capture_sites as cs
from vllm_capture_guard.runtime.patching import MARKER
from vllm_capture_guard.runtime.patches import graph_capture_stream as mod
def functions():
    return [vars(getattr(sys.modules[m], c))[n] for m, c, n in mod.SITES
            if m in sys.modules]
import vllm.plugins
first = os.environ["ORDER"] == "vllm-first"
if first:  # the modules are there when the plugin loads: hooks run at once
    cs.import_sites()
    before = functions()
    vllm.plugins.load_general_plugins()
    same = [a is b for a, b in zip(before, functions())]
else:  # the plugin loads first, as in a worker: hooks at import
    vllm.plugins.load_general_plugins()
    cs.import_sites()
    same = [not hasattr(f, MARKER) for f in functions()]
found = {site: cs.summary(cs.record(site)) for site in cs.present()}
print(json.dumps({"same": same, "found": found}))
"""


@pytest.mark.parametrize("order", ["vllm-first", "plugin-first"])
def test_loaded_by_vllm_plugin_loader(order, affected):
    out, logs = run_snippet(SNIPPET, VLLM_CAPTURE_GUARD="on", ORDER=order)
    for site, found in out["found"].items():
        assert set(found["streams"]) == {"current"}, (site, found)
    lines = [line for line in guard_lines(logs) if PATCH.name in line]
    assert lines, logs[-3000:]
    assert out["same"] == [False] * len(PRESENT)  # every release: the copy goes on
    text = " ".join(lines)
    assert "patched" in text and "WARNING" not in text and "not needed" not in text
    for _, _, name in WHERE:
        assert f".{name}" in text, text


def test_switched_off_by_name(affected):
    out, logs = run_snippet(
        SNIPPET,
        VLLM_CAPTURE_GUARD="on",
        VLLM_CAPTURE_GUARD_DISABLE=PATCH.name,
        ORDER="vllm-first",
    )
    assert out["same"] == [True] * len(PRESENT)
    lines = [line for line in guard_lines(logs) if PATCH.name in line]
    assert lines and "disabled" in lines[0], logs[-3000:]
    if affected:
        assert all(None in f["streams"] for f in out["found"].values()), out


def _direct(self):  # our own small functions: what the copy reaches
    with torch.cuda.graph(self.g, self.pool, None):
        pass


_ALIAS = None


def _through_an_attribute(self):
    with self.capture_graph(self.g):
        pass
    with torch.cuda.graphs.graph(self.g):
        pass


def _global(self):
    global _ALIAS
    with torch.cuda.graph(self.g):
        _ALIAS = 1


def test_what_the_copy_cannot_reach_is_named():
    assert mod.unreached(_direct) == []
    found = mod.unreached(_through_an_attribute)
    assert [f.split(" at ")[0] for f in found] == [
        "self.capture_graph(...)",
        "torch.cuda.graphs.graph(...)",
    ]
    assert mod.unreached(_global) == [
        "a global statement (the copy has its own globals)"
    ]
