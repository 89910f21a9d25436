# SPDX-License-Identifier: Apache-2.0
"""The seed scenario as a verdict: would full-graph capture of a MiniMax-M3 on
this vLLM get past the metadata builders, for each backend a patch fixes?

Used by ``vllm-capture-guard check``, the version matrix and the tests, which
run it in fresh interpreters with the guard switched on and off.
"""

from __future__ import annotations

import dataclasses
import json
import os

from vllm_capture_guard.runtime.plugin import report, vllm_version
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.contract import FieldWrite
from vllm_capture_guard.tools.harness import Batch


@dataclasses.dataclass
class GroupRecord:
    group: str
    builder: str
    writes: list[FieldWrite]


@dataclasses.dataclass
class SeedRun:
    """One capture sequence (backend x batch), as ``check --json`` prints it."""

    backend: str
    batch: str
    ok: bool
    error: str | None
    error_site: str | None
    error_line: str | None
    decode_query_len: int | None
    query_start_loc_cpu_before: list[int]
    query_start_loc_cpu_after: list[int]
    query_start_loc_after: list[int]
    groups: list[GroupRecord]


@dataclasses.dataclass
class SeedResult:
    vllm: str
    guard: str | None  # the plugin's report, None if it was not loaded
    ok: bool
    runs: list[SeedRun]
    unavailable: dict[str, str]  # backend -> why it cannot be imported here


def seed_run(backend: str, batch: Batch) -> SeedRun:
    return seed_record(backend, batch, harness.run_capture(backend, batch))


def seed_record(backend: str, batch: Batch, run: harness.CaptureRun) -> SeedRun:
    """One harness run of ``backend`` on ``batch``, as ``check`` reports it."""
    failed = run.failed
    return SeedRun(
        backend=backend,
        batch=batch.label(),
        ok=failed is None,
        error=failed.error if failed else None,
        error_site=failed.error_site if failed else None,
        error_line=failed.error_line if failed else None,
        decode_query_len=harness.decode_query_len(run),
        query_start_loc_cpu_before=batch.offsets(),
        query_start_loc_cpu_after=run.values("query_start_loc_cpu"),
        query_start_loc_after=run.values("query_start_loc"),
        groups=[GroupRecord(g.group, g.builder, g.writes) for g in run.groups],
    )


def run_seed(
    backends: tuple[str, ...] | None = None,
    batches: tuple[Batch, ...] = harness.DEFAULT_BATCHES,
) -> SeedResult:
    """Every backend x batch of the seed scenario, on the CPU."""
    runs: list[SeedRun] = []
    unavailable: dict[str, str] = {}
    for backend in backends or harness.seed_backends():
        try:
            harness.backend_class(backend)
        except Exception as e:  # e.g. a backend module that needs a GPU to import
            unavailable[backend] = harness.error_text(e)
            continue
        runs += [seed_run(backend, batch) for batch in batches]
    guard = report()
    return SeedResult(
        vllm=vllm_version(),
        guard=None if guard is None else guard.message,
        ok=bool(runs) and all(r.ok for r in runs),
        runs=runs,
        unavailable=unavailable,
    )


def verdict_lines(result: SeedResult) -> list[str]:
    lines = [f"vLLM {result.vllm}; guard: {result.guard or 'not loaded'}"]
    by_backend: dict[str, list[SeedRun]] = {}
    for run in result.runs:
        by_backend.setdefault(run.backend, []).append(run)
    for backend, runs in by_backend.items():
        bad = [r for r in runs if not r.ok]
        if not bad:
            lines.append(
                f"  {backend}: PASS, {len(runs)}/{len(runs)} capture sequences"
            )
            continue
        lines.append(
            f"  {backend}: FAIL, {len(bad)}/{len(runs)} capture sequences fail; "
            f"first: {bad[0].error} at {bad[0].error_site} (batch {bad[0].batch})"
        )
    for backend, why in result.unavailable.items():
        lines.append(f"  {backend}: not checked here ({why})")
    if result.ok:
        lines.append(
            "verdict: capture gets past every metadata builder; startup is not "
            "blocked by this bug"
        )
    else:
        lines.append("verdict: startup would still fail (EngineCore failed to start)")
    return lines


def main(as_json: bool = False) -> int:
    """``vllm-capture-guard check``: 0 pass, 1 startup would fail, 2 not run."""
    from vllm_capture_guard.tools.failure import could_not_run
    from vllm_capture_guard.tools.guard import load_plugins_as_worker

    if as_json:  # keep stdout for the JSON: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        load_plugins_as_worker()
        result = run_seed()
    except Exception as e:
        return could_not_run("check", harness.error_text(e), as_json)
    if as_json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
    else:
        print("\n".join(verdict_lines(result)))
    if not result.runs:
        return 2
    return 0 if result.ok else 1
