# SPDX-License-Identifier: Apache-2.0
"""``check`` claims only what ran: exit 0 only where every check ran whole
and passed; a check that could not run here (a backend whose module does not
import, a runner that stopped with nothing failing, a capture site whose
drive raised) makes it exit 2, "cannot judge", naming it, with no all-clear
line; a failure stays exit 1 and the verdict names what did not run too.

The first test is the case an operator met: one of vLLM's own imports
failing on the way to the ROCm builder (``llguidance``, which
``vllm.v1.structured_output`` imports), run through the command line. The
others judge hand-made results: they test check's own verdict, not vLLM.
"""

from __future__ import annotations

import os

import pytest

from tests import warm
from tests.conftest import fresh_env
from vllm_capture_guard.tools import check
from vllm_capture_guard.tools.check import SeedResult, SeedRun
from vllm_capture_guard.tools.verdict import ALL_CLEAR

#: A stand-in for a dependency of vLLM missing from the environment.
MISSING = (
    "raise ModuleNotFoundError(\"No module named 'llguidance'\", name='llguidance')\n"
)


@pytest.fixture(scope="module")
def no_llguidance(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("no-llguidance")
    (root / "llguidance").mkdir()
    (root / "llguidance" / "__init__.py").write_text(MISSING)
    return str(root)


@pytest.mark.once
def test_a_row_that_could_not_run_makes_check_exit_2_without_the_all_clear(
    no_llguidance,
):
    """On the venv's release (0.28.0, the V1 runner, as the operator met it).
    Model Runner V2's path does not import ``llguidance``: there every row
    runs, and check rightly passes."""
    path = [no_llguidance, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = fresh_env(PYTHONPATH=os.pathsep.join(path))
    proc = warm.python(["-m", "vllm_capture_guard", "check"], env)
    out = proc.stdout
    assert proc.returncode == 2, out[-3000:] + proc.stderr[-3000:]
    assert ALL_CLEAR not in out
    rows = [ln.strip() for ln in out.splitlines() if ln.startswith("  ")]
    unchecked = [r for r in rows if "not checked here" in r]
    assert unchecked and all("llguidance" in r for r in unchecked), rows
    assert any(
        r.startswith("MiniMax-M3 indexer after ROCM_ATTN: not checked")
        for r in unchecked
    ), rows
    (verdict,) = [ln for ln in out.splitlines() if ln.startswith("verdict: ")]
    assert verdict.startswith("verdict: cannot judge: not checked here: "), verdict
    assert "MiniMax-M3 indexer after ROCM_ATTN (ModuleNotFoundError" in verdict
    assert "every metadata builder" not in verdict
    (reason,) = proc.stderr.strip().splitlines()[-1:]
    assert reason.startswith("vllm-capture-guard check cannot judge: "), reason


def _run(backend: str, ok: bool, tokens: int) -> SeedRun:
    return SeedRun(
        backend, f"t{tokens}", ok, None if ok else "AssertionError",
        None, None, None, [0, tokens], [0, tokens], [0, tokens], [], tokens,
    )  # fmt: skip


def _result(runs: list[SeedRun], unavailable: dict[str, str], **more) -> SeedResult:
    return SeedResult("?", None, True, runs, unavailable, sizes=[2, 1], **more)


def _verdict(result: SeedResult) -> str:
    (line,) = [ln for ln in check.verdict_lines(result) if ln.startswith("verdict:")]
    return line


ROCM, AITER = "ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"


def test_every_check_run_and_passed_is_the_only_exit_0():
    runs = [_run(b, True, t) for b in (ROCM, AITER) for t in (2, 1)]
    judged = check.judge(_result(runs, {}))
    assert check.exit_code(judged) == 0 and check.passed(judged)
    assert _verdict(_result(runs, {})) == ALL_CLEAR


def test_an_unavailable_backend_is_exit_2_named_in_the_verdict():
    runs = [_run(AITER, True, t) for t in (2, 1)]
    result = _result(runs, {ROCM: "ModuleNotFoundError: stand-in"})
    judged = check.judge(result)
    assert check.exit_code(judged) == 2 and not check.passed(judged)
    assert check.not_judged(judged) == [
        f"MiniMax-M3 indexer after {ROCM} (ModuleNotFoundError: stand-in)"
    ]
    verdict = _verdict(result)
    assert verdict.startswith("verdict: cannot judge: ") and ROCM in verdict
    summary = check.summary(result)
    assert summary["exit"] == 2 and summary["cannot_judge"] is True
    assert ROCM in summary["error"]


def test_a_backend_with_no_capture_and_no_reason_is_not_checked():
    """A runner that captured nothing with a backend, and raised nothing
    (vLLM derived no FULL size for it): that row is "not checked here"."""
    runs = [_run(AITER, True, t) for t in (2, 1)]
    result = _result(runs, {})
    (row,) = [j for j in check.judge(result) if j.name.endswith(f"after {ROCM}")]
    assert row.ok is None and row.note == "no capture ran"
    assert check.exit_code(check.judge(result)) == 2
    assert _verdict(result) != ALL_CLEAR


def test_no_run_at_all_is_exit_2():
    result = _result([], {ROCM: "stand-in", AITER: "stand-in"})
    judged = check.judge(result)
    assert check.exit_code(judged) == 2
    assert _verdict(result) != ALL_CLEAR
    assert check.exit_code([]) == 2


def test_a_failure_stays_exit_1_and_names_what_did_not_run():
    runs = [_run(AITER, False, 2), _run(AITER, True, 1)]
    result = _result(runs, {ROCM: "stand-in"})
    assert check.exit_code(check.judge(result)) == 1
    verdict = _verdict(result)
    assert "would still fail" in verdict
    assert verdict.endswith(
        f"; not checked here: MiniMax-M3 indexer after {ROCM} (stand-in)"
    )


def test_a_runner_that_stopped_with_nothing_failing_cannot_be_judged():
    runs = [_run(ROCM, True, 2)]  # one of two sizes reached, none failed
    result = _result(runs, {}, stops=True)
    (indexer,) = [j for j in check.judge(result) if j.name.endswith(ROCM)]
    assert indexer.ok is None and "1 of 2 sizes not reached" in indexer.note
    assert check.exit_code([indexer]) == 2


# --- status -------------------------------------------------------------------


def test_status_cannot_judge_a_fix_it_could_not_read():
    """A fix whose code could not be read here is never "not affected" nor
    "yes" unless the guard installs it here."""
    from vllm_capture_guard.tools import status

    unread = status.Need("x-fix", "#1", status.NOT_READ, "", unread=["X (why)"])
    read = status.Need("y-fix", "#2", status.NOT_NEEDED, "")
    verdict, why, _ = status.protection(None, [read, unread])
    assert verdict == status.UNKNOWN and status.EXIT[verdict] == 2
    assert "x-fix (X (why))" in why
    assert status._unread([read, unread], {"x-fix"}) == []
    assert status._unread([read, unread], set()) == ["x-fix (X (why))"]
    verdict, _, _ = status.protection(None, [read])
    assert verdict == status.NOT_AFFECTED
