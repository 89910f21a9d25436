# SPDX-License-Identifier: Apache-2.0
"""``status`` and ``check`` as an operator runs them, in new processes. Whether
a release is affected is decided by running vLLM's own code in this process,
where the guard is never loaded: its capture sequence (the MiniMax-M3
indexer) and its three capture sites (the stream), never our tools."""

from __future__ import annotations

import functools
import re

from tests import capture_sites as cs
from tests.conftest import run_cli, run_fresh
from vllm_capture_guard.tools import harness

STREAM_LINE = "capture on the current stream (PR #53818)"
#: The capture sites this vLLM has (0.34.0 has no Gemma4 proposer there).
SITES = len(cs.present())
STREAM_CRASH = "splitk workspace not initialized for the current CUDA stream"
#: The traceback line an operator searches for.
INDEXER_CRASH = re.compile(
    r"at vllm/models/minimax_m3/common/indexer\.py:\d+: assert decode_query_len > 0"
)


def test_status_reports_version_platform_affected_and_activity(vllm_version):
    proc = run_fresh(["-m", "vllm_capture_guard", "status"], VLLM_CAPTURE_GUARD=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f"vLLM:        {vllm_version}" in out
    assert "platform:" in out and "affected:" in out
    # on this CPU host, auto mode does not act
    assert "VLLM_CAPTURE_GUARD=auto; does not act on this host" in out
    assert "auto acts on ROCm only" in out
    assert out.splitlines()[-1].startswith("protected:   ")


@functools.cache
def _indexer_fails_unguarded() -> bool:
    """vLLM's own capture sequence, unguarded: does the indexer fail?"""
    return any(
        harness.run_capture(backend, harness.Batch(4)).failed is not None
        for backend in ("ROCM_ATTN",)
    )


@functools.cache
def _streams_fail_unguarded() -> bool:
    """vLLM's own three capture sites, unguarded: does one pass no stream?"""
    cs.import_sites()
    found = {site: cs.summary(cs.record(site))["streams"] for site in cs.present()}
    assert all(found.values()), found  # every site made its graph call
    return any(None in streams for streams in found.values())


def _startup_fails_unguarded() -> bool:
    """Would either start-up failure happen without the guard?"""
    return _indexer_fails_unguarded() or _streams_fail_unguarded()


def _check(**env: str | None):
    return run_cli("check", **env)


def test_check_exit_code_says_startup_would_fail_when_off():
    proc = _check(VLLM_CAPTURE_GUARD="off")
    out = proc.stdout
    assert "verdict:" in out, proc.stderr[-2000:]
    assert proc.returncode == (1 if _startup_fails_unguarded() else 0), out
    if _indexer_fails_unguarded():  # 0.27.x / 0.28.0: the guard is off
        assert "MiniMax-M3 indexer after ROCM_ATTN: FAIL" in out
        assert INDEXER_CRASH.search(out), out
        assert "verdict: startup would still fail" in out
    else:  # a fixed release passes on its own
        assert "MiniMax-M3 indexer after ROCM_ATTN: PASS" in out
    if _streams_fail_unguarded():
        assert f"{STREAM_LINE}: FAIL, {SITES}/{SITES} sites fail" in out, out
        assert STREAM_CRASH in out
    else:
        assert f"{STREAM_LINE}: PASS, {SITES}/{SITES} sites" in out, out
    if not _startup_fails_unguarded():
        assert "verdict: capture gets past every metadata builder" in out


def test_check_passes_with_the_guard_on():
    proc = _check(VLLM_CAPTURE_GUARD="on")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "MiniMax-M3 indexer after ROCM_ATTN: PASS" in out
    assert f"{STREAM_LINE}: PASS, {SITES}/{SITES} sites" in out
    assert "FAIL" not in out
    # what a PASS shows, and what it does not
    assert "\na PASS shows: vLLM's own metadata builders" in out
    assert "AITER's kernels are satisfied on a GPU" in out
    assert "a vendor runner's extra host field" in out


def test_check_and_status_without_the_stream_patch():
    """The second failure on its own: the guard loaded, only its stream patch
    switched off by name (and a name that is no patch, which the tools say
    without -v)."""
    env = dict(
        VLLM_CAPTURE_GUARD=None,
        VLLM_PLUGINS=None,
        VLLM_CAPTURE_GUARD_DISABLE="graph-capture-stream,no-such-patch",
    )
    check = _check(**env)
    status = run_fresh(["-m", "vllm_capture_guard", "status"], **env)
    out = check.stdout
    fails = _streams_fail_unguarded()
    assert check.returncode == (1 if fails else 0), out + check.stderr[-2000:]
    assert "MiniMax-M3 indexer after ROCM_ATTN: PASS" in out  # the other fixes
    if fails:
        (line,) = [ln for ln in out.splitlines() if STREAM_LINE in ln]
        assert line.strip().startswith(
            f"{STREAM_LINE}: FAIL, {SITES}/{SITES} sites fail"
        ), line
        assert STREAM_CRASH in line and "Gemma4Proposer" in line
        assert f"verdict: startup would still fail: AITER ({STREAM_CRASH}" in out
        assert status.returncode == 1, status.stdout + status.stderr[-2000:]
        assert status.stdout.splitlines()[-1] == (
            "protected:   no (graph-capture-stream is listed in "
            "VLLM_CAPTURE_GUARD_DISABLE)"
        )
    else:  # 0.29.0 and later pass the stream themselves
        assert f"{STREAM_LINE}: PASS, {SITES}/{SITES} sites" in out
        assert status.returncode == 0, status.stdout + status.stderr[-2000:]
    unknown = (
        "vllm-capture-guard warning: VLLM_CAPTURE_GUARD_DISABLE names no patch: "
        "no-such-patch (the patches are "
    )
    for proc in (check, status):
        assert unknown in proc.stderr, proc.stderr[-2000:]
        assert "names no patch" not in proc.stdout  # warnings: stderr only


def test_tools_judge_the_rocm_path_under_auto_only():
    from vllm_capture_guard.tools.guard import judge_rocm_path

    env: dict[str, str] = {}
    assert judge_rocm_path(env).startswith("auto")
    assert env == {"VLLM_CAPTURE_GUARD": "on"}
    for mode in ("off", "on"):
        env = {"VLLM_CAPTURE_GUARD": mode}
        assert judge_rocm_path(env) == mode
        assert env == {"VLLM_CAPTURE_GUARD": mode}
