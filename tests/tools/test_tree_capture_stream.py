# SPDX-License-Identifier: Apache-2.0
"""The in-tree form of PR #53818 (capture on the current stream): the edit on
copies of the installed 0.27.1/0.28.0 files, byte-exact revert, no-op on
0.29.0/0.33.0, refusals that write nothing, and what the patched files then
do: vLLM's three capture functions, imported from the patched copy with the
guard off, pass the current stream (``tests/capture_sites.py``)."""

from __future__ import annotations

import ast
import json

import pytest

from tests.tools.overlay import ROOT, make_overlay, overlay_env, release_base, run_in
from tests.tools.test_tree import make_tree, patch, release_files, state
from vllm_capture_guard.tools.fixes import graph_capture_stream as cs_fix
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.plan import FILES
from vllm_capture_guard.tools.tree.source import Source

AFFECTED = ("0.27.1", "0.28.0")
FIXED = ("0.29.0", "0.33.0")


def streams_passed(raw: bytes, cls: str, method: str) -> list[str | None]:
    """The stream argument of each torch.cuda.graph call in ``cls.method``."""
    module = ast.parse(raw)
    fn = next(
        f
        for c in module.body
        if isinstance(c, ast.ClassDef) and c.name == cls
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == method
    )
    calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.graph"
    ]
    return [
        next((ast.unparse(k.value) for k in c.keywords if k.arg == "stream"), None)
        for c in calls
    ]


@pytest.mark.parametrize("version", AFFECTED)
def test_apply_passes_the_current_stream_and_reverts_byte_exact(
    version, tmp_path, capsys
):
    root = make_tree(tmp_path, release_files(version))
    before = state(root)
    for inside, cls, method in cs_fix.SITES:
        assert None in streams_passed(before[inside], cls, method)
    code, out, _ = patch(capsys, "--apply", "--tree", str(root))
    assert code == 0, out
    after = state(root)
    for inside, cls, method in cs_fix.SITES:
        assert streams_passed(after[inside], cls, method) == ["current_stream()"]
        tree = ast.parse(after[inside])
        assert any(
            isinstance(s, ast.ImportFrom)
            and s.module == "vllm.utils.torch_utils"
            and [a.name for a in s.names] == ["current_stream"]
            for s in tree.body
        )
    code, out, _ = patch(capsys, "--check", "--tree", str(root))
    assert code == 0 and out.count(f"{cs_fix.FIX} (PR {cs_fix.PR})") == 3, out
    assert out.count(f": {model.APPLIED}: ") == len(FILES)
    assert patch(capsys, "--revert", "--tree", str(root))[0] == 0
    assert state(root) == before


@pytest.mark.parametrize("version", FIXED)
def test_fixed_releases_are_left_alone(version, tmp_path, capsys):
    root = make_tree(tmp_path, release_files(version))
    before = state(root)
    code, out, _ = patch(capsys, "--apply", "--tree", str(root))
    assert code == 0 and "nothing to do" in out, out
    assert out.count(f"{cs_fix.FIX} (PR {cs_fix.PR})") == 3
    assert state(root) == before


def _multiline(raw: bytes) -> bytes:
    old = b"torch.cuda.graph(graph, self.pool)"
    assert raw.count(old) == 1, "the installed file changed"
    return raw.replace(old, b"torch.cuda.graph(\n    graph, self.pool\n)")


def _name_taken(raw: bytes) -> bytes:
    return raw + b"\ncurrent_stream = None\n"


def _aliased_torch(raw: bytes) -> bytes:
    assert raw.count(b"\nimport torch\n") == 1, "the installed file changed"
    return raw.replace(b"\nimport torch\n", b"\nimport torch as torch\n")


def _stream_none(raw: bytes) -> bytes:
    old = b"torch.cuda.graph(graph, self.pool)"
    assert raw.count(old) == 1, "the installed file changed"
    return raw.replace(old, b"torch.cuda.graph(graph, self.pool, stream=None)")


VARIANTS = {
    "call over several lines": (_multiline, "the call spans several lines"),
    # still torch's side stream: 0.1.0 read it as fixed upstream
    "a stream of None": (_stream_none, "passes a stream of None"),
    "current_stream already bound": (_name_taken, "current_stream is already used"),
    "torch aliased": (_aliased_torch, "no `import torch` at module level"),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_unrecognised_variants_are_refused_untouched(name, tmp_path, capsys):
    make, message = VARIANTS[name]
    data = release_files("0.28.0")
    inside = cs_fix.FILES[0]
    data[inside] = make(data[inside])
    root = make_tree(tmp_path, data)
    before = state(root)
    for mode in ("--check", "--apply", "--diff"):
        code, out, err = patch(capsys, mode, "--tree", str(root))
        assert code == 2, (mode, out)
        assert message in out + err
    assert state(root) == before  # the other files were not patched either


def test_edited_after_apply_is_refused(tmp_path, capsys):
    root = make_tree(tmp_path, release_files("0.28.0"))
    assert patch(capsys, "--apply", "--tree", str(root))[0] == 0
    path = root / "vllm" / cs_fix.FILES[2]
    text = path.read_bytes()
    path.write_bytes(text.replace(b"stream=current_stream()", b"stream=None"))
    before = state(root)
    code, out, _ = patch(capsys, "--check", "--tree", str(root))
    assert code == 2 and "not what this fix writes" in out, out
    assert patch(capsys, "--revert", "--tree", str(root))[0] == 2
    assert state(root) == before


SNIPPET = """
import json
from tests import capture_sites as cs
cs.import_sites()
print(json.dumps({s: cs.summary(cs.record(s))["streams"] for s in cs.SITES}))
"""


@pytest.mark.oracle
@pytest.mark.parametrize("version", AFFECTED)
def test_patched_tree_captures_on_the_current_stream(version, tmp_path):
    """vLLM's own functions from the patched copy, guard off: every capture
    passes vLLM's current stream; from the unpatched copy, none does."""
    base = release_base(version)
    if base is None:
        pytest.skip(f"vLLM {version} is not installed here (make envs)")
    root = make_overlay(base, tmp_path / "overlay")
    env = overlay_env(root, base, VLLM_CAPTURE_GUARD="off")
    found = {}
    for step in ("before", "apply", "after"):
        if step == "apply":
            proc = run_in(env, "-m", "vllm_capture_guard", "patch", "--apply")
            assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
            continue
        proc = run_in(env, "-c", SNIPPET, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[step] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(None in s for s in found["before"].values()), found
    assert all(set(s) == {"current"} for s in found["after"].values()), found


def test_status_and_patch_read_a_call_with_the_same_reader(monkeypatch, tmp_path):
    """One reader of a ``torch.cuda.graph(...)`` call: ``status`` hands it the
    calls of the imported function's source, ``patch`` those of the file's
    bytes. A literal ``None`` stream is no stream for both."""
    calls = {
        "torch.cuda.graph(g, pool)": False,
        "torch.cuda.graph(g, pool, None)": False,
        "torch.cuda.graph(g, pool, stream=None)": False,
        "torch.cuda.graph(g, pool, stream=s)": True,
        "torch.cuda.graph(g, pool, s)": True,
        "torch.cuda.graph(g, stream=current_stream())": True,
    }
    for text, passes in calls.items():
        (call,) = cs_fix.graph_calls(ast.parse(text))
        assert cs_fix.passes_stream(call) is passes, text
    raw = SITE.encode()
    path = tmp_path / "site.py"
    path.write_bytes(raw)
    namespace: dict = {}
    exec(compile(raw, str(path), "exec"), namespace)
    function = namespace["Manager"].capture

    def readings() -> tuple[bool | None, model.State]:
        status = cs_fix._read_site("Manager.capture", function).needed
        src = Source.parse(path, "site.py", raw)
        return status, cs_fix.read_source(src, "site.py", "Manager", "capture").state

    assert readings() == (False, model.UPSTREAM)
    monkeypatch.setattr(cs_fix, "passes_stream", lambda call: False)
    # both follow the one reader: needed, and refused (the call names a stream)
    assert readings() == (True, model.UNRECOGNISED)


SITE = """
import torch


class Manager:
    def capture(self, graph, stream):
        with torch.cuda.graph(graph, stream=stream):
            pass
"""


def test_status_and_patch_check_agree_on_this_release():
    """On the installed vLLM (each release of the matrix): each capture site
    that ``status`` reads as needing the fix is one ``patch --check`` would
    edit, and each it reads as fixed is fixed upstream for ``patch`` too."""
    from vllm_capture_guard.tools.tree.locate import find_tree
    from vllm_capture_guard.tools.tree.plan import make_plan

    read = {r.where: r.needed for r in cs_fix.readings() if r.importable}
    assert read, "no capture site could be read here"
    found = [f for f in make_plan(find_tree()).findings if f.fix == cs_fix.FIX]
    in_tree = {f"{cls}.{method}": f.state for (_, cls, method), f in zip(
        cs_fix.SITES, found, strict=True)}  # fmt: skip
    for where, needed in read.items():
        expected = model.NEEDED if needed else model.UPSTREAM
        assert in_tree[where] == expected, (where, needed, in_tree[where])
