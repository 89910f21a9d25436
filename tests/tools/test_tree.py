# SPDX-License-Identifier: Apache-2.0
"""The in-tree patcher on the releases' own files and on variations of them,
in this process (no vLLM import): what it recognises, what it refuses, and
how it writes. Whether a patched tree then *behaves* as 0.29.0 is in
``test_tree_releases.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import variations as var
from tests.tools.overlay import release_base, source_checkout
from vllm_capture_guard.tools.cli import main
from vllm_capture_guard.tools.fixes import builder_capture_guard as cpu_offsets
from vllm_capture_guard.tools.fixes import rocm_aiter_unified_builder as aiter_builder
from vllm_capture_guard.tools.tree import files, model
from vllm_capture_guard.tools.tree.locate import find_tree
from vllm_capture_guard.tools.tree.plan import FILES, make_plan

AFFECTED = ("0.27.1", "0.28.0")
FIXED = ("0.29.0", "0.33.0")


def release_files(version: str) -> dict[str, bytes]:
    base = release_base(version)
    if base is None:
        pytest.skip(f"vLLM {version} is not installed here (make envs)")
    return {inside: (base / "vllm" / inside).read_bytes() for inside in FILES}


def make_tree(root: Path, data: dict[str, bytes]) -> Path:
    for inside, raw in data.items():
        path = root / "vllm" / inside
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    (root / "vllm" / "__init__.py").write_bytes(b"")
    return root


def state(root: Path) -> dict[str, bytes]:
    """Every file of the tree's package, by path inside it."""
    folder = root / "vllm"
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def patch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["patch", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def affected(tmp_path) -> Path:
    return make_tree(tmp_path / "tree", release_files("0.28.0"))


def test_names_are_the_runtime_patches_names():
    """Each in-tree fix is named as its patch, or (the capture guard's, which
    is exactly PR #51585) as its patch was up to 0.1.0; same PR."""
    from vllm_capture_guard.runtime.patches import PATCHES
    from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as rt
    from vllm_capture_guard.tools.fixes import module_of

    for patch in PATCHES:
        fix = module_of(patch)
        if fix.TREE_FILES:
            assert fix.FIX in (patch.name, *patch.former_names), fix.FIX
            assert patch.pr == fix.PR, fix.FIX
    assert cpu_offsets.FIX == "rocm-attn-cpu-offsets"  # trees patched by 0.1.0
    assert aiter_builder.BUILDER == rt.BUILDER  # upstream's class name


@pytest.mark.parametrize("version", AFFECTED + FIXED)
def test_releases_check_and_diff(version, tmp_path, capsys):
    root = make_tree(tmp_path, release_files(version))
    code, out, _ = patch(capsys, "--check", "--tree", str(root))
    code_diff, diff, _ = patch(capsys, "--diff", "--tree", str(root))
    assert code_diff == 0
    if version in FIXED:
        assert code == 0, out
        assert out.count(f": {model.UPSTREAM}: ") == len(FILES)
        assert diff == ""
        return
    assert code == 1, out
    assert out.count(f": {model.NEEDED}: ") == len(FILES)
    assert "-        common_attn_metadata.query_start_loc_cpu.zero_()" in diff
    assert "+        return RocmAiterUnifiedAttentionMetadataBuilder" in diff
    assert diff.count("+# vllm-capture-guard: backport of vllm PR #53821") == 1


def test_tree_forms(affected, tmp_path, capsys):
    """A checkout root and a package folder name the same tree; diff paths
    are relative to the folder that holds ``vllm/`` in both cases."""
    by_root = patch(capsys, "--diff", "--tree", str(affected))[1]
    by_package = patch(capsys, "--diff", "--tree", str(affected / "vllm"))[1]
    assert by_root == by_package
    assert "--- a/vllm/v1/attention/backends/rocm_attn.py" in by_root
    code, out, err = patch(capsys, "--check", "--tree", str(tmp_path))
    assert code == 2 and out == "", out  # the reason goes to stderr, one line
    (line,) = err.splitlines()
    assert "refused" in line and "neither a vLLM source checkout" in line


def test_default_tree_is_found_without_importing_vllm():
    """``--check`` on the installed vLLM imports no module of vLLM and not
    torch (find_spec of a top-level package executes nothing). What it costs
    is measured by ``make bench`` (benchmarks/bench_tree.py), not here."""
    code = (
        "import contextlib, io, json, sys\n"
        "from vllm_capture_guard.tools.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    rc = main(['patch', '--check'])\n"
        "mods = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "print(json.dumps([rc, mods, 'torch' in sys.modules, out.getvalue()]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    rc, mods, torch_loaded, out = json.loads(proc.stdout)
    assert rc in (0, 1), out
    assert "vLLM tree:" in out
    assert mods == [] and not torch_loaded
    spec = importlib.util.find_spec("vllm")
    assert find_tree().package == Path(spec.submodule_search_locations[0])


def test_apply_revert_round_trip(affected, capsys):
    before = state(affected)
    code, out, _ = patch(capsys, "--apply", "--tree", str(affected))
    assert code == 0, out
    after = state(affected)
    assert set(after) == set(before) | {n + files.SIDECAR for n in FILES}
    for name in FILES:
        assert after[name + files.SIDECAR] == before[name]
        assert after[name] != before[name]
        assert f"{name}{files.SIDECAR})" in out, out  # names the kept original
    # a second --apply changes nothing
    code, out, _ = patch(capsys, "--apply", "--tree", str(affected))
    assert code == 0 and "nothing to do" in out
    assert state(affected) == after
    code, out, _ = patch(capsys, "--check", "--tree", str(affected))
    assert code == 0 and out.count(model.APPLIED) == len(FILES), out
    assert patch(capsys, "--diff", "--tree", str(affected))[1] == ""
    code, out, _ = patch(capsys, "--revert", "--tree", str(affected))
    assert code == 0, out
    assert state(affected) == before
    code, out, _ = patch(capsys, "--revert", "--tree", str(affected))
    assert code == 0 and "nothing to revert" in out


def test_diff_applies_with_git_and_patch_and_equals_apply(tmp_path, capsys):
    data = release_files("0.28.0")
    applied = make_tree(tmp_path / "applied", data)
    assert patch(capsys, "--apply", "--tree", str(applied))[0] == 0
    for tool in ("git", "patch"):
        checkout = source_checkout(tmp_path / tool, data)
        code, diff, _ = patch(capsys, "--diff", "--tree", str(checkout))
        assert code == 0 and diff
        (tmp_path / "fix.diff").write_text(diff)
        cmd = {
            "git": [["git", "apply", "--check"], ["git", "apply"]],
            "patch": [["patch", "-p1", "--dry-run", "-i"], ["patch", "-p1", "-i"]],
        }[tool]
        for args in cmd:
            proc = subprocess.run(
                [*args, str(tmp_path / "fix.diff")],
                stdin=subprocess.DEVNULL,
                cwd=checkout,
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
        for inside in FILES:
            got = (checkout / "vllm" / inside).read_bytes()
            assert got == (applied / "vllm" / inside).read_bytes(), tool
        # the tree patched by the diff is recognised as carrying the fix
        assert patch(capsys, "--check", "--tree", str(checkout))[0] == 0
        # ... but --revert has no saved original there: it refuses
        code, out, err = patch(capsys, "--revert", "--tree", str(checkout))
        assert code == 2 and "git apply -R" in err and "patch: refused" not in out


@pytest.mark.parametrize("name", sorted(var.REFUSED))
def test_refused_variations_write_nothing(name, tmp_path, capsys):
    make, message = var.REFUSED[name]
    root = make_tree(tmp_path, make(release_files("0.28.0")))
    before = state(root)
    code, out, err = patch(capsys, "--check", "--tree", str(root))
    assert code == 2, out
    assert message in out
    assert model.UNRECOGNISED in out
    (line,) = err.splitlines()  # every exit 2: its reason, one line on stderr
    assert "not recognised" in line and message in line
    for mode in ("--apply", "--diff"):
        code, out, err = patch(capsys, mode, "--tree", str(root))
        assert code == 2
        (line,) = err.splitlines()[-1:]
        assert "refused" in line and message in line
        assert "patch: refused" not in out
        if mode == "--diff":
            assert out == ""
    assert state(root) == before


@pytest.mark.parametrize("name", sorted(var.ACCEPTED))
def test_accepted_variations_are_fixed(name, tmp_path, capsys):
    """Recognised and patched here; their behaviour with the guard off is
    checked in ``test_tree_releases.py``."""
    data = var.ACCEPTED[name](release_files("0.28.0"))
    root = make_tree(tmp_path, data)
    assert patch(capsys, "--check", "--tree", str(root))[0] == 1
    assert patch(capsys, "--apply", "--tree", str(root))[0] == 0
    assert patch(capsys, "--check", "--tree", str(root))[0] == 0
    for inside in FILES:
        new = (root / "vllm" / inside).read_bytes()
        compile(new, inside, "exec")
        if b"\r\n" in data[inside]:  # the file's own line endings are kept
            assert new.count(b"\n") == new.count(b"\r\n")
    assert patch(capsys, "--revert", "--tree", str(root))[0] == 0
    assert {i: (root / "vllm" / i).read_bytes() for i in FILES} == data


def test_edited_after_apply_is_refused(affected, capsys):
    assert patch(capsys, "--apply", "--tree", str(affected))[0] == 0
    path = affected / "vllm" / FILES[1]
    path.write_bytes(path.read_bytes().replace(b".fill_(1)", b".fill_(2)"))
    before = state(affected)
    code, out, _ = patch(capsys, "--check", "--tree", str(affected))
    assert code == 2 and "not what this fix writes" in out
    code, out, _ = patch(capsys, "--revert", "--tree", str(affected))
    assert code == 2
    assert state(affected) == before


def test_modes_and_owners_kept(affected, capsys):
    paths = [affected / "vllm" / inside for inside in FILES]
    paths[0].chmod(0o640)
    paths[1].chmod(0o604)
    assert patch(capsys, "--apply", "--tree", str(affected))[0] == 0
    assert stat.S_IMODE(paths[0].stat().st_mode) == 0o640
    assert stat.S_IMODE(paths[1].stat().st_mode) == 0o604
    assert stat.S_IMODE(files.sidecar(paths[0]).stat().st_mode) == 0o640
    assert patch(capsys, "--revert", "--tree", str(affected))[0] == 0
    assert stat.S_IMODE(paths[0].stat().st_mode) == 0o640


@pytest.mark.parametrize("what", ["file", "folder"])
def test_read_only_tree_is_refused_and_untouched(what, affected, capsys):
    before = state(affected)
    folder = affected / "vllm" / Path(FILES[0]).parent
    target = folder / Path(FILES[1]).name if what == "file" else folder
    mode = target.stat().st_mode
    target.chmod(0o444 if what == "file" else 0o555)
    try:
        code, out, err = patch(capsys, "--apply", "--tree", str(affected))
    finally:
        target.chmod(mode)
    assert code == 2
    assert "read-only" in err and "nothing was written" in err
    # rocm_attn.py was writable, but is untouched too: all or nothing
    assert state(affected) == before


def test_a_failed_replace_rolls_back_everything(affected, capsys, monkeypatch):
    before = state(affected)
    calls: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src, dst):
        calls.append((str(Path(src).parent), str(Path(dst).parent)))
        if len(calls) == 4:  # the second file, after its sidecar
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    code, out, err = patch(capsys, "--apply", "--tree", str(affected))
    assert code == 2 and "nothing changed" in err
    assert state(affected) == before  # no sidecar, no temporary file left
    assert all(src == dst for src, dst in calls[:4])  # temp files beside targets


def test_hash_based_bytecode_is_compiled_again(affected, capsys):
    folder = affected / "vllm" / Path(FILES[0]).parent
    mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
    for inside in FILES:
        source = affected / "vllm" / inside
        py_compile.compile(str(source), doraise=True, invalidation_mode=mode)
    foreign = folder / "__pycache__" / "rocm_attn.cpython-399.pyc"
    foreign.write_bytes(b"\0" * 16)  # another interpreter's: removed
    assert patch(capsys, "--apply", "--tree", str(affected))[0] == 0
    assert not foreign.exists()
    for inside in FILES:
        source = affected / "vllm" / inside
        pyc = Path(importlib.util.cache_from_source(str(source)))
        header = pyc.read_bytes()[:16]
        assert int.from_bytes(header[4:8], "little") == 1  # unchecked hash, kept
        assert header[8:16] == importlib.util.source_hash(source.read_bytes())


def test_python_trusts_stale_unchecked_hash_bytecode(tmp_path):
    """The hazard the bytecode handling is for, on a tiny module: Python runs
    an unchecked-hash .pyc of the old source until it is replaced."""
    module = tmp_path / "capture_guard_probe.py"
    module.write_text("X = 1\n")
    mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
    py_compile.compile(str(module), doraise=True, invalidation_mode=mode)
    module.write_text("X = 2\n")

    def imported() -> str:
        return subprocess.run(
            [sys.executable, "-c", "import capture_guard_probe as m; print(m.X)"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    assert imported() == "1"  # stale
    files.recompile(module, files.remove_stale_bytecode(module))
    assert imported() == "2"


def test_absent_aiter_file_is_nothing_to_fix(tmp_path, capsys):
    data = release_files("0.28.0")
    del data[aiter_builder.FILE]
    root = make_tree(tmp_path, data)
    plan = make_plan(find_tree(root))
    assert [f.state for f in plan.findings][:2] == [model.NEEDED, model.ABSENT]
    assert patch(capsys, "--apply", "--tree", str(root))[0] == 0
    assert patch(capsys, "--check", "--tree", str(root))[0] == 0


@pytest.mark.parametrize("where", ["beside", "__pycache__"])
def test_sourceless_aiter_file_is_refused(where, tmp_path, capsys):
    """A tree that ships the AITER module as bytecode only is refused and
    named, never judged absent; nothing is written, bytecode included, and
    ``status`` does not say that the tree carries the fix."""
    from vllm_capture_guard.tools.tree.command import status_line

    root = make_tree(tmp_path, release_files("0.28.0"))
    source = root / "vllm" / aiter_builder.FILE
    cfile = (
        source.with_suffix(".pyc")
        if where == "beside"
        else Path(importlib.util.cache_from_source(str(source)))
    )
    py_compile.compile(str(source), cfile=str(cfile), doraise=True)
    source.unlink()
    before = state(root)
    assert cfile.relative_to(root / "vllm").as_posix() in before
    code, out, _ = patch(capsys, "--check", "--tree", str(root))
    assert code == 2, out
    assert "rocm_aiter_unified_attn.py is missing but its bytecode is present" in out
    assert model.ABSENT not in out and "nothing to fix" not in out
    for mode in ("--apply", "--diff", "--revert"):
        code, out, err = patch(capsys, mode, "--tree", str(root))
        assert (code, mode) == (2 if mode != "--revert" else 0, mode), out + err
        if mode != "--revert":
            assert "refused" in out + err and cfile.name in out + err
    assert state(root) == before
    assert cfile.exists()
    line = status_line(find_tree(root))
    assert not line.startswith("yes") and model.UNRECOGNISED in line, line
    # and once the tree's rocm_attn.py carries the fix, still not "yes"
    (root / "vllm" / cpu_offsets.FILE).write_bytes(
        make_plan(find_tree(make_tree(tmp_path / "ok", release_files("0.28.0")))).new[
            cpu_offsets.FILE
        ]
    )
    line = status_line(find_tree(root))
    assert not line.startswith("yes") and model.UNRECOGNISED in line, line


def test_concurrent_applies_are_serialised(tmp_path):
    """Two ``patch --apply`` at once on one tree (an image build running steps
    in parallel), with bytecode present: both exit 0, neither refuses, and the
    tree ends patched, with its originals kept and nothing else left."""
    data = release_files("0.28.0")
    expected = make_plan(find_tree(make_tree(tmp_path / "expected", data))).new
    cmd = [sys.executable, "-m", "vllm_capture_guard", "patch", "--apply"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    for n in range(12):
        root = make_tree(tmp_path / f"round{n}", data)
        for inside in FILES:
            py_compile.compile(str(root / "vllm" / inside), doraise=True)
        procs = [
            subprocess.Popen(
                [*cmd, "--tree", str(root)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        codes = [p.returncode for p in procs]
        assert codes == [0, 0], f"round {n}: {codes}\n" + "\n---\n".join(outs)
        assert not any("refused" in o or "could not" in o for o in outs), outs
        assert sum("nothing to do" in o for o in outs) == 1, outs
        for inside in FILES:
            path = root / "vllm" / inside
            assert path.read_bytes() == expected[inside]
            assert files.sidecar(path).read_bytes() == data[inside]
        leftovers = {p.name for p in (root / "vllm").iterdir()} - {"v1", "__init__.py"}
        assert leftovers == set(), leftovers  # no lock file, no temporary file
