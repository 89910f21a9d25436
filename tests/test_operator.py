# SPDX-License-Identifier: Apache-2.0
"""What an operator sees in the first hour: one guard line across ``status``,
``check`` and ``audit``; quiet output; every exit 2 with a one-line reason on
stderr; a release outside the supported range named as such.

The commands run in fresh interpreters, as an operator runs them. Whether
startup fails is decided by running vLLM's own capture
(:func:`tests.test_cli._startup_fails_unguarded`), never by asking our tools.
"""

from __future__ import annotations

import re
import shutil
from importlib.metadata import version

import pytest

from tests import capture_sites as cs
from tests import variants as vv
from tests.conftest import needs_v1_runner, run_cli, run_fresh, run_snippet
from tests.test_cli import _startup_fails_unguarded

#: vLLM's log line format (``INFO 12-01 15:12:31 [file.py:368] ...``) and
#: torch's (``W1201 15:12:14.519000 7967 torch/...``).
VLLM_LOG = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:")
TORCH_LOG = re.compile(r"^[DIWE]\d{4} \d\d:\d\d:\d\d")
#: Whatever the caller's shell set for vLLM's or torch's logging is dropped:
#: the test is about the commands' own defaults.
DEFAULTS = dict(
    VLLM_LOGGING_LEVEL=None,
    VLLM_LOGGING_STREAM=None,
    VLLM_CONFIGURE_LOGGING=None,
    TORCH_LOGS=None,
    PYTHONWARNINGS=None,
    VLLM_PLUGINS=None,
)


def _cli(*args: str, fresh: bool = False, **env: str | None):
    return run_fresh(
        ["-m", "vllm_capture_guard", *args], fresh=fresh, **{**DEFAULTS, **env}
    )


def _guard_line(out: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.startswith("guard: ")]
    return line


#: Told by structure, not by release (an overlay of the venv's own vLLM):
#: the version matrix runs these once.
ONCE = pytest.mark.once


def _cached(*args: str, fresh: bool = False, **env: str | None):
    return run_cli(*args, fresh=fresh, **{**DEFAULTS, **env})


# --- one story ---------------------------------------------------------------


def test_status_and_check_tell_one_story_under_auto_on_a_cpu_host():
    status = _cached("status", VLLM_CAPTURE_GUARD=None)
    check = _cached("check", VLLM_CAPTURE_GUARD=None)
    assert status.returncode == 0, status.stderr[-2000:]
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    told = _guard_line(status.stdout)
    assert told.startswith("guard: loaded by vLLM's plugin loader; ")
    assert "VLLM_CAPTURE_GUARD=auto; does not act on this host" in told
    assert "not ROCm; auto acts on ROCm only" in told
    judged = _guard_line(check.stdout)
    # the same words, then what check itself did, said as a simulation; the
    # guard installs its fixes on every release (it guards at use)
    assert judged.startswith(told + "; check SIMULATES the ROCm path here")
    assert judged.endswith("(auto counts as on): patched"), judged
    # status's verdict: decided by running vLLM's own code unguarded, here
    verdict = "yes" if _startup_fails_unguarded() else "not affected"
    last = status.stdout.splitlines()[-1]
    assert last.startswith(f"protected:   {verdict} ("), last
    if verdict == "yes":  # off ROCm, auto: judged as check judges it
        assert "judged for the ROCm path, as check does" in last


def test_status_and_check_tell_one_story_under_on():
    status = _cached("status", VLLM_CAPTURE_GUARD="on")
    check = _cached("check", VLLM_CAPTURE_GUARD="on")
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    told = _guard_line(status.stdout)
    assert "VLLM_CAPTURE_GUARD=on; acts on any platform (on)" in told
    judged = _guard_line(check.stdout)
    assert judged.startswith(told + "; check SIMULATES the ROCm path here: ")
    assert "counts as on" not in judged


def test_check_says_why_the_guard_is_not_loaded_when_vllm_plugins_excludes_it():
    fails = _startup_fails_unguarded()
    status = _cached("status", VLLM_PLUGINS="foo")
    check = _cached("check", VLLM_PLUGINS="foo")
    reason = "NOT loaded: VLLM_PLUGINS='foo' does not list 'capture_guard'"
    told = _guard_line(status.stdout)
    assert told.startswith(f"guard: {reason}; "), told
    judged = _guard_line(check.stdout)
    assert judged.startswith(told), judged
    assert "guard absent, vLLM's capture as shipped" in judged
    # vLLM's loader really left it out: the release's own capture decides
    assert check.returncode == (1 if fails else 0), check.stdout[-2000:]
    # status says so in one verdict, and exits as check does
    assert status.returncode == (1 if fails else 0), status.stdout[-2000:]
    last = status.stdout.splitlines()[-1]
    if fails:
        why = "VLLM_PLUGINS='foo' does not list 'capture_guard'"
        assert last == f"protected:   no (the guard is not loaded: {why})", last
    else:
        assert last.startswith("protected:   not affected ("), last
    # it reads this shell's switches, and says the server's may differ
    (env,) = [ln for ln in status.stdout.splitlines() if ln.startswith("environ")]
    assert "VLLM_PLUGINS='foo'" in env and "may differ" in env, env


def _items(line: str) -> list[str]:
    """A line's items: what lies between its separators."""
    parts = re.split(r"[;,()]", line)
    return [p.strip() for p in parts if p.strip()]


def test_status_names_each_item_once_and_the_sites_patch_check_names():
    status = _cached("status", VLLM_CAPTURE_GUARD=None)
    lines = status.stdout.splitlines()
    assert len(lines) == len(set(lines)), lines
    for line in lines:
        items = _items(line)
        assert len(items) == len(set(items)), line
    from vllm_capture_guard.runtime.patches import PATCHES

    (tree,) = [ln for ln in lines if ln.startswith("in-tree fix: ")]
    for patch in PATCHES:
        assert tree.count(patch.name) <= 1, tree
    # the stream fix's line names the sites that patch --check names
    patch_check = _cached("patch", "--check").stdout
    (stream,) = [ln for ln in lines if ln.startswith("  graph-capture-stream: ")]
    sites = re.findall(r"needs the fix: (\w+\.\w+) calls", patch_check)
    if sites:  # the tree needs the fix
        assert len(sites) == len(cs.present()), patch_check
        for site in sites:
            assert site in stream, (site, stream)
    for site in cs.present():
        name = cs.where(site)[1]
        assert len(re.findall(rf"\b{name}\.", stream)) == 1, stream


def test_guard_line_names_a_missing_entry_point(monkeypatch):
    from vllm_capture_guard.tools import guard

    monkeypatch.setattr(guard, "entry_point", lambda: None)
    told = guard.story({})
    assert not told.loaded and not told.acts
    assert "no 'capture_guard' entry point in vllm.general_plugins" in told.line()


# --- quiet output ------------------------------------------------------------


def test_no_vllm_log_line_in_checks_default_output():
    # fresh: vLLM and torch log at import, which a warm child never repeats
    proc = _cached("check", fresh=True, VLLM_CAPTURE_GUARD=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for stream in (proc.stdout, proc.stderr):
        for line in stream.splitlines():
            assert not VLLM_LOG.match(line), line
            assert not TORCH_LOG.match(line), line
            assert "vllm._C" not in line and "speculative" not in line, line
    # stdout is the result: a title, the guard line, one line per check, verdict
    assert proc.stdout.splitlines()[0].startswith(f"vLLM {version('vllm')}: ")
    assert "Capturing CUDA graphs" not in proc.stderr  # vLLM's progress bar


ASK_RUNNER = """
import json
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.harness import runners
choice = runners.choose(harness.make_vllm_config(0, graphs=True))
print(json.dumps({"runner": choice.runner, "line": choice.line()}))
"""


def test_check_reports_the_capture_sizes_vllm_derives():
    """check runs vLLM's own capture sizes (512 down to 1 by default), and
    says how many and on which runner; the list is vLLM's, read from its own
    config (the V1 runner's dispatcher; Model Runner V2's CudaGraphManager,
    whose descriptors the V2 tests compare)."""
    from vllm_capture_guard.tools import harness
    from vllm_capture_guard.tools.harness import runners

    config = harness.make_vllm_config(0, graphs=True)
    derived = sorted(config.compilation_config.cudagraph_capture_sizes, reverse=True)
    # vLLM's choice, asked in a process set up as check's (Triton on: this
    # process keeps it off, and vLLM's answer can depend on it)
    choice, _ = run_snippet(ASK_RUNNER)
    if choice["runner"] == runners.V1:
        from vllm_capture_guard.tools.harness import sizes

        batches = sizes.capture_batches(config)
        assert [b.num_tokens for b in batches] == derived
    assert derived[0] == 512 and derived[-1] == 1
    proc = _cached("check", VLLM_CAPTURE_GUARD=None)
    assert f"runner: {choice['line']}" in proc.stdout.splitlines(), proc.stdout
    n = len(derived)
    passed = f"PASS, {n}/{n} capture sizes (512..1)"
    assert f"  MiniMax-M3 indexer after ROCM_ATTN: {passed}" in proc.stdout
    aiter = "  MiniMax-M3 indexer after ROCM_AITER_UNIFIED_ATTN: "
    # 0.33's AITER module asks for the GPU's architecture at import: check
    # answers an MI300X's, as the audit does, so that row runs on every release
    assert f"{aiter}{passed}" in proc.stdout, proc.stdout


# --- exit 2: one line on stderr ------------------------------------------------


def test_audit_with_an_unknown_backend_lists_the_valid_names():
    proc = _cli("audit", "--backend", "NOPE")
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("vllm-capture-guard audit could not run: unknown ")
    assert "'NOPE'" in line and "valid names: " in line
    assert "ROCM_ATTN" in line and "TRITON_ATTN" in line


def test_audit_backend_names_match_without_regard_to_case():
    from vllm_capture_guard.tools.audit.command import unknown_backends

    assert unknown_backends(["rocm_attn", "ROCM_ATTN", "Triton_Attn"]) is None
    why = unknown_backends(["rocm_attn", "nope"])
    assert why is not None and "'nope'" in why and "'rocm_attn'" not in why


def test_audit_skipped_list_shows_a_shared_name_once():
    from vllm_capture_guard.tools.audit import render, schema

    skipped = [
        schema.BackendReport(reg, "CUSTOM", schema.Built.SKIPPED, reason="why")
        for reg in ("AttentionBackendEnum", "MambaAttentionBackendEnum")
    ]
    lines = render.skipped_lines(skipped)
    assert lines == [
        "  CUSTOM (AttentionBackendEnum, MambaAttentionBackendEnum): skipped (why)"
    ]


# --- a release outside the supported range -------------------------------------


@pytest.fixture(scope="module")
def without_minimax_m3(tmp_path_factory):
    """The installed vLLM, less its MiniMax-M3 package (an overlay in front of
    it): a release older than the oldest supported one, by structure. Its
    version string stays the installed one, so only structure can tell."""
    rel = "models/__init__.py"
    text = (vv.installed_vllm_dir() / rel).read_text()
    dest = vv.make_overlay({rel: text}, tmp_path_factory.mktemp("no-minimax-m3"))
    gone = dest / "vllm" / "models" / "minimax_m3"
    assert gone.is_symlink()
    gone.unlink()
    shutil.rmtree(dest / "vllm" / "models" / "__pycache__", ignore_errors=True)
    return vv.overlay_env(dest)


def _in_overlay(env: dict, *args: str):
    """Fresh: these assert that nothing but one line is printed, and vLLM
    prints at import, which a warm child never repeats."""
    from tests import warm

    for key, value in DEFAULTS.items():
        if value is None:
            env.pop(key, None)
    return warm.python(
        ["-m", "vllm_capture_guard", *args], env, fresh=True, cwd=vv.ROOT
    )


@ONCE
def test_check_names_the_supported_releases_on_a_vllm_without_minimax_m3(
    without_minimax_m3,
):
    proc = _in_overlay(dict(without_minimax_m3), "check")
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("vllm-capture-guard check could not run: ")
    assert "no MiniMax-M3 indexer" in line
    assert "supported: vLLM 0.27.0 to 0.28.0" in line
    assert "still available: `vllm-capture-guard status`" in line
    audit = _in_overlay(dict(without_minimax_m3), "audit")
    assert audit.returncode == 2 and audit.stdout == "", audit.stderr[-3000:]
    assert "audit could not run: this vLLM has no MiniMax-M3" in audit.stderr
    status = _in_overlay(dict(without_minimax_m3), "status")
    assert status.returncode == 0, status.stderr[-2000:]
    assert "supported:   no: this vLLM has no MiniMax-M3 indexer" in status.stdout


@ONCE
def test_check_is_one_line_when_minimax_m3_cannot_be_set_up(tmp_path):
    """A stand-in for 0.26.0, whose MiniMax-M3 model class cannot even be
    inspected on a CPU host (it needs vLLM's compiled ops at import): the
    installed vLLM with that package made to fail on import. vLLM logs
    dozens of ERROR lines and raises a multi-line ValidationError; check
    prints one line, on stderr, with the supported range."""
    rel = "models/minimax_m3/__init__.py"
    text = (vv.installed_vllm_dir() / rel).read_text()
    broken = text + "\nraise ImportError('stand-in: needs vllm._C to import')\n"
    dest = vv.make_overlay({rel: broken}, tmp_path)
    proc = _in_overlay(vv.overlay_env(dest), "check")
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "vllm-capture-guard check could not run: could not set up MiniMax-M3"
    )
    assert "supported: vLLM 0.27.0 to 0.28.0" in line


# --- check runs what the runner runs ---------------------------------------------


@needs_v1_runner
def test_sizes_run_one_builder_per_group_in_the_runners_order():
    """At every size, largest first: each group's builder in turn (attention,
    then the indexer), the same two instances throughout, each on a copy of
    one shared metadata whose tensors are the same persistent buffers."""
    from vllm_capture_guard.tools import harness
    from vllm_capture_guard.tools.harness import sizes

    config = harness.make_vllm_config(0, graphs=True)
    batches = sizes.capture_batches(config)
    builders = [
        ("attention", harness.attention_builder("TRITON_ATTN", config)),
        ("indexer", harness.indexer_builder(config)),
    ]
    calls = []
    for group, builder in builders:
        real = builder.build_for_cudagraph_capture

        def seen(cm, group=group, builder=builder, real=real):
            storage = cm.query_start_loc_cpu.untyped_storage().data_ptr()
            calls.append((group, id(builder), cm.num_reqs, storage))
            return real(cm)

        builder.build_for_cudagraph_capture = seen
    done = sizes.run_sizes(builders, batches)
    assert all(r.failed is None for r in done.runs)
    reqs = [b.num_reqs for b in batches]
    assert reqs == sorted(reqs, reverse=True) and reqs[0] == 512
    assert [(g, n) for g, _, n, _ in calls] == [
        (g, n) for n in reqs for g in ("attention", "indexer")
    ]
    assert {g: {i for gg, i, _, _ in calls if gg == g} for g, _ in builders} == {
        g: {id(b)} for g, b in builders
    }
    assert len({s for *_, s in calls}) == 1  # one set of runner buffers


@ONCE
def test_a_requirement_of_model_runner_v2_is_never_called_an_old_release():
    """vLLM's own refusal to make a config for Model Runner V2 (Triton off) is
    said as the runner's requirement, with what check needs, not as a release
    outside the supported range; any other failure keeps that wording."""
    from vllm_capture_guard.tools import support

    line = support.cannot_set_up("ValueError: Model Runner V2 requires Triton.")
    assert "Model Runner V2 requires Triton" in line, line
    assert "supported range" not in line and "supported:" not in line, line
    assert "triton package" in line, line
    other = support.cannot_set_up("ImportError: stand-in: needs vllm._C")
    assert "releases outside the supported range" in other, other
