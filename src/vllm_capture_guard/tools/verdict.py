# SPDX-License-Identifier: Apache-2.0
"""``check``'s verdict: one judgement per start-up failure the guard fixes,
from the runs of :mod:`~vllm_capture_guard.tools.check`, as lines or as
``check --json``'s summary. Each fix's judgements, and the words the verdict
gives its failure, are in its tools module (``judgements()``,
``fails_as()``); here is what they share."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm_capture_guard.tools import fixes
from vllm_capture_guard.tools.failure import CANNOT_JUDGE

if TYPE_CHECKING:
    from vllm_capture_guard.tools.check import SeedResult, SeedRun

#: The MiniMax-M3 start-up failure, as its traceback shows it.
INDEXER_CRASH = (
    'File "vllm/models/minimax_m3/common/indexer.py", in build: '
    "assert decode_query_len > 0"
)
#: What a PASS shows, and what it does not (printed by ``check``).
SHOWS = (
    "a PASS shows: vLLM's own metadata builders and capture functions, run on "
    "the CPU in the model runner's order with the guard loaded by vLLM's plugin "
    "loader, keep what later builders read and hand vLLM's current stream to "
    "torch.cuda.graph; only GPU-only pieces (graphs, streams, device kernels) "
    "are stood in for"
)
DOES_NOT_SHOW = (
    "it does not show: that AITER's kernels are satisfied on a GPU (no kernel "
    "runs here), nor that a vendor runner's extra host field or capture site "
    "is covered (check builds vLLM's own runner fields and drives vLLM's own "
    "capture sites)"
)


@dataclasses.dataclass
class Judgement:
    """One failure the guard fixes, judged on this vLLM."""

    name: str  # the line's title
    fix: str  # the runtime patch that fixes it
    pr: str
    #: True pass, False fail, None not checked here (``note`` says why)
    ok: bool | None
    passed: int
    total: int
    unit: str  # "capture sizes (512..1)", "sites"
    #: what fails, naming the error an operator would search for
    failure: str | None = None
    note: str | None = None
    #: tokens of each capture size that failed (seed checks)
    failed_sizes: list[int] = dataclasses.field(default_factory=list)
    #: "start-up" (the engine dies) or "replay" (graphs replay wrong offsets)
    kind: str = "start-up"
    #: the runner stops at the first capture size that fails (Model Runner
    #: V2): the tokens of that size
    stopped_at: int | None = None
    #: the parts of this check that could not run here, each with why (a
    #: capture site whose drive raised); a check with any is not judged
    not_run: list[str] = dataclasses.field(default_factory=list)

    @property
    def judged(self) -> bool:
        """Did every part of this check run?"""
        return self.ok is not None and not self.not_run

    def unjudged(self) -> str | None:
        """What of this check did not run, and why; None if all of it ran."""
        if self.ok is None:
            return f"{self.name} ({self.note})"
        if self.not_run:
            return f"{self.name}: {'; '.join(self.not_run)}"
        return None

    def line(self) -> str:
        if self.ok is None:
            return f"{self.name}: not checked here ({self.note})"
        if self.ok is False and self.stopped_at is not None:
            text = (
                f"{self.name}: FAIL, capture stops at size {self.stopped_at} "
                f"({self.passed} of {self.total} {self.unit} captured before it): "
            )
            return text + (self.failure or "?")
        if self.ok:
            text = f"{self.name}: PASS, {self.passed}/{self.total} {self.unit}"
        else:
            bad = self.total - self.passed
            text = f"{self.name}: FAIL, {bad}/{self.total} {self.unit} fail: "
            text += self.failure or "?"
        if self.not_run:
            text += f"; not checked here: {'; '.join(self.not_run)}"
        return text + (f"; {self.note}" if self.note else "")


def _span(result: SeedResult) -> str:
    if not result.sizes:
        return "capture sequences"
    return f"capture sizes ({result.sizes[0]}..{result.sizes[-1]})"


def size_words(run: SeedRun) -> str:
    """One capture of the seed scenario, by what it captured."""
    return f"{run.num_tokens} tokens" if run.num_tokens else f"batch {run.batch}"


@dataclasses.dataclass(frozen=True)
class Checked:
    """What ``check`` ran, as each fix's ``judgements()`` takes it."""

    result: SeedResult
    #: the seed scenario's runs, by attention backend
    by_backend: dict[str, list[SeedRun]]
    unit: str  # "capture sizes (512..1)"

    def total(self, runs: list[SeedRun]) -> int:
        """Capture sizes in all: those a stopping runner never reached count."""
        if self.result.stops:
            return max(len(self.result.sizes), len(runs))
        return len(runs)


def judge(result: SeedResult) -> list[Judgement]:
    """Every check of ``result``, in the order ``check`` prints them: each
    fix's own (its tools module's ``judgements()``), in the runtime's order."""
    by_backend: dict[str, list[SeedRun]] = {}
    for run in result.runs:
        by_backend.setdefault(run.backend, []).append(run)
    checked = Checked(result, by_backend, _span(result))
    found = []
    for module in fixes.modules():
        found += module.judgements(checked)
    return found


def _fails_as(judgement: Judgement) -> str:
    """What the verdict names when this check fails, in its fix's words."""
    return fixes.module_of(fixes.by_name(judgement.fix)).fails_as(judgement)


def passed(judgements: list[Judgement]) -> bool:
    """Every check ran whole and passed (and there is at least one)."""
    return bool(judgements) and all(j.ok and j.judged for j in judgements)


def not_judged(judgements: list[Judgement]) -> list[str]:
    """What did not run, one entry per check, each with why."""
    return [text for j in judgements if (text := j.unjudged())]


#: ``check``'s exit codes (2, :data:`.failure.CANNOT_JUDGE`, as every command's).
PASS, FAILS = 0, 1


def exit_code(judgements: list[Judgement]) -> int:
    """1 where a check fails (whatever else did not run: that failure stays);
    else 2 where a check, or part of one, did not run, or none did; else 0."""
    if any(j.ok is False for j in judgements):
        return FAILS
    return PASS if passed(judgements) else CANNOT_JUDGE


#: The all-clear, printed only where every check ran and passed.
ALL_CLEAR = (
    "verdict: capture gets past every metadata builder and runs on vLLM's "
    "current stream; neither start-up failure happens in what check runs"
)


def cannot_judge_reason(judgements: list[Judgement]) -> str:
    """Why check cannot judge, in one line: its verdict after "verdict: ",
    its line on stderr after "vllm-capture-guard check ", and its JSON's
    ``error``."""
    missing = not_judged(judgements) or ["no check ran"]
    return (
        "cannot judge: not checked here: " + "; ".join(missing) + "; check "
        "passes only where every check runs (the failures these checks look for "
        "may still happen)"
    )


def _verdict(judgements: list[Judgement]) -> str:
    failed = [j for j in judgements if j.ok is False]
    if not failed:
        if passed(judgements):
            return ALL_CLEAR
        return "verdict: " + cannot_judge_reason(judgements)
    crashes: list[str] = []
    replay: list[str] = []
    for j in failed:
        words = _fails_as(j)
        if j.kind == "replay":
            replay.append(words)
        elif words not in crashes:
            crashes.append(words)
    parts = []
    if crashes:
        parts.append("startup would still fail: " + "; ".join(crashes))
    if replay:
        parts.append(
            f"{', '.join(replay)} would capture its graphs over zeroed query offsets"
        )
    text = "verdict: " + "; and ".join(parts)
    missing = not_judged(judgements)
    if missing:
        text += "; not checked here: " + "; ".join(missing)
    return text


def verdict_lines(result: SeedResult) -> list[str]:
    lines = [f"vLLM {result.vllm}"]
    if result.sizes and result.stops:
        lines[0] += (
            f": {len(result.sizes)} full-graph capture sizes, "
            f"{result.sizes[0]} down to {result.sizes[-1]}, from the runner's "
            f"CudaGraphManager (max_num_seqs={result.max_num_seqs}); the "
            "runner's own capture_model, every attention group's builder in "
            "its order"
        )
    elif result.sizes:
        spec = (
            f", {result.speculative_tokens} speculative tokens"
            if result.speculative_tokens
            else ""
        )
        lines[0] += (
            f": {len(result.sizes)} full-graph capture sizes, "
            f"{result.sizes[0]} down to {result.sizes[-1]}, as vLLM derives them "
            f"(max_num_seqs={result.max_num_seqs}{spec}); one builder per "
            "KV-cache group, in the model runner's order"
        )
    if result.runner:
        lines.append(f"runner: {result.runner}")
    lines += [f"set up here: {line}" for line in result.setup]
    lines.append(result.guard_line or f"guard: {result.guard or 'not loaded'}")
    judgements = judge(result)
    lines += ["  " + j.line() for j in judgements]
    lines.append(_verdict(judgements))
    lines += [SHOWS, DOES_NOT_SHOW]
    return lines


def summary(result: SeedResult) -> dict[str, Any]:
    """``check --json``: the verdict per check and per backend, small."""
    backends: dict[str, Any] = {}
    for run in result.runs:
        entry = backends.setdefault(
            run.backend, {"runs": 0, "passed": 0, "first_failure": None}
        )
        entry["runs"] += 1
        entry["passed"] += run.ok
        if not run.ok and entry["first_failure"] is None:
            entry["first_failure"] = {
                "num_tokens": run.num_tokens,
                "batch": run.batch,
                "error": run.error,
                "error_site": run.error_site,
                "error_line": run.error_line,
            }
    sizes = result.sizes
    judgements = judge(result)
    code = exit_code(judgements)
    out = {
        "ok": result.ok,
        "exit": code,
        "cannot_judge": code == CANNOT_JUDGE,
        "vllm": result.vllm,
        "guard": result.guard,
        "guard_line": result.guard_line,
        "guard_warnings": result.guard_warnings,
        "former_names": fixes.former_names(),
        "capture_sizes": {
            "count": len(sizes),
            "largest": sizes[0] if sizes else None,
            "smallest": sizes[-1] if sizes else None,
        },
        "max_num_seqs": result.max_num_seqs,
        "speculative_tokens": result.speculative_tokens,
        "runner": result.runner,
        "stops_at_first_failure": result.stops,
        "set_up": result.setup,
        "checks": [dataclasses.asdict(j) for j in judgements],
        "not_checked": not_judged(judgements),
        "backends": backends,
        "sites": [dataclasses.asdict(s) for s in result.streams],
        "unavailable": result.unavailable,
        "shows": SHOWS,
        "does_not_show": DOES_NOT_SHOW,
    }
    if code == CANNOT_JUDGE:
        out["error"] = cannot_judge_reason(judgements)
    return out
