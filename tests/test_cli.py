# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from tests.conftest import run_fresh
from vllm_capture_guard.tools import harness


def test_status_reports_version_platform_affected_and_activity(vllm_version):
    proc = run_fresh(["-m", "vllm_capture_guard", "status"], VLLM_CAPTURE_GUARD=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f"vLLM:        {vllm_version}" in out
    assert "platform:" in out and "affected:" in out
    # on this CPU host, auto mode does not act
    assert "VLLM_CAPTURE_GUARD=auto; does not act on this host" in out
    assert "auto acts on ROCm only" in out


def _startup_fails_unguarded() -> bool:
    """Decided by running vLLM's own capture sequence in this process, where
    the guard is never loaded, not by the command under test."""
    return any(
        harness.run_capture(backend, harness.Batch(4)).failed is not None
        for backend in ("ROCM_ATTN",)
    )


def test_check_exit_code_says_startup_would_fail_when_off():
    fails = _startup_fails_unguarded()
    proc = run_fresh(["-m", "vllm_capture_guard", "check"], VLLM_CAPTURE_GUARD="off")
    out = proc.stdout
    assert "verdict:" in out, proc.stderr[-2000:]
    if fails:  # 0.27.x / 0.28.0: the guard is off, so startup still dies
        assert proc.returncode == 1, out
        assert "ROCM_ATTN: FAIL" in out
        assert "verdict: startup would still fail" in out
    else:  # a fixed release passes on its own
        assert proc.returncode == 0, out
        assert "ROCM_ATTN: PASS" in out
        assert "verdict: capture gets past every metadata builder" in out


def test_check_passes_with_the_guard_on():
    proc = run_fresh(["-m", "vllm_capture_guard", "check"], VLLM_CAPTURE_GUARD="on")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ROCM_ATTN: PASS" in proc.stdout
    assert "FAIL" not in proc.stdout


def test_tools_judge_the_rocm_path_under_auto_only():
    from vllm_capture_guard.tools.guard import judge_rocm_path

    env: dict[str, str] = {}
    assert judge_rocm_path(env).startswith("auto")
    assert env == {"VLLM_CAPTURE_GUARD": "on"}
    for mode in ("off", "on"):
        env = {"VLLM_CAPTURE_GUARD": mode}
        assert judge_rocm_path(env) == mode
        assert env == {"VLLM_CAPTURE_GUARD": mode}
