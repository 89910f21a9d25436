# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from tests.conftest import run_fresh


def test_status_reports_version_platform_affected_and_activity(vllm_version):
    proc = run_fresh(["-m", "vllm_capture_guard", "status"], VLLM_CAPTURE_GUARD=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f"vLLM:        {vllm_version}" in out
    assert "platform:" in out and "affected:" in out
    # on this CPU host, auto mode does not act
    assert "inactive here: VLLM_CAPTURE_GUARD=auto acts on ROCm only" in out


def test_check_exit_code_says_startup_would_fail_when_off():
    proc = run_fresh(["-m", "vllm_capture_guard", "check"], VLLM_CAPTURE_GUARD="off")
    assert "verdict:" in proc.stdout, proc.stderr[-2000:]
    # 1 where the installed vLLM is affected, 0 where it is already fixed
    if "FAIL" in proc.stdout:
        assert proc.returncode == 1
        assert "startup would still fail" in proc.stdout
    else:
        assert proc.returncode == 0
