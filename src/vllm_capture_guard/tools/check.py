# SPDX-License-Identifier: Apache-2.0
"""The seed scenario as a verdict: would full-graph capture of a MiniMax-M3 on
this vLLM get past the metadata builders, for each backend a patch fixes?

``vllm-capture-guard check`` runs what vLLM runs (:func:`run_check`): the
capture sizes vLLM derives for the config (512 down to 1 by default), on one
builder per KV-cache group reused for every size, in the runner's order. The
version matrix and the tests also run the small batch shapes of
:data:`~vllm_capture_guard.tools.harness.DEFAULT_BATCHES` (:func:`run_seed`),
in fresh interpreters with the guard switched on and off.
"""

from __future__ import annotations

import dataclasses
import json

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
    #: ``check``: tokens of each capture, in the runner's order (largest
    #: first), as vLLM derives them; empty for :func:`run_seed`'s batches.
    sizes: list[int] = dataclasses.field(default_factory=list)
    speculative_tokens: int = 0
    max_num_seqs: int | None = None
    #: The guard line (:meth:`vllm_capture_guard.tools.guard.Story.line`).
    guard_line: str | None = None
    #: What the guard warned about in this process (its fail-closed notes).
    guard_warnings: list[str] = dataclasses.field(default_factory=list)


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


def run_check(
    backends: tuple[str, ...] | None = None, num_speculative_tokens: int = 0
) -> SeedResult:
    """What vLLM runs at start-up, per backend: every FULL capture size that
    vLLM derives for the config, largest first, on one attention builder and
    one MiniMax-M3 indexer builder (one per KV-cache group), built once and
    reused for every size, each size on one shared metadata."""
    from vllm_capture_guard.tools.harness import sizes

    config = harness.make_vllm_config(num_speculative_tokens, graphs=True)
    batches = sizes.capture_batches(config)
    if not batches:
        raise RuntimeError("vLLM derived no full-graph capture size for the config")
    runs: list[SeedRun] = []
    unavailable: dict[str, str] = {}
    for backend in backends or harness.seed_backends():
        try:
            builders = [
                ("attention", harness.attention_builder(backend, config)),
                ("indexer", harness.indexer_builder(config)),
            ]
        except Exception as e:  # e.g. a backend module that needs a GPU to import
            unavailable[backend] = harness.error_text(e)
            continue
        done = sizes.run_sizes(builders, batches)
        pairs = zip(done.batches, done.runs, strict=True)
        runs += [seed_record(backend, b, r) for b, r in pairs]
    guard = report()
    return SeedResult(
        vllm=vllm_version(),
        guard=None if guard is None else guard.message,
        ok=bool(runs) and all(r.ok for r in runs),
        runs=runs,
        unavailable=unavailable,
        sizes=[b.num_tokens for b in batches],
        speculative_tokens=num_speculative_tokens,
        max_num_seqs=config.scheduler_config.max_num_seqs,
    )


def _span(result: SeedResult) -> str:
    if not result.sizes:
        return "capture sequences"
    return f"capture sizes ({result.sizes[0]}..{result.sizes[-1]})"


def verdict_lines(result: SeedResult) -> list[str]:
    lines = [f"vLLM {result.vllm}"]
    if result.sizes:
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
    lines.append(result.guard_line or f"guard: {result.guard or 'not loaded'}")
    lines += [f"guard warning: {w}" for w in result.guard_warnings]
    by_backend: dict[str, list[SeedRun]] = {}
    for run in result.runs:
        by_backend.setdefault(run.backend, []).append(run)
    span = _span(result)
    for backend, runs in by_backend.items():
        bad = [r for r in runs if not r.ok]
        if not bad:
            lines.append(f"  {backend}: PASS, {len(runs)}/{len(runs)} {span}")
            continue
        lines.append(
            f"  {backend}: FAIL, {len(bad)}/{len(runs)} {span} fail; "
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


def guard_warnings() -> list[str]:
    """The guard's warnings and failures in this process so far."""
    done = report()
    if done is None:
        return []
    found = [o.warning for o in done.outcomes.values() if getattr(o, "warning", None)]
    return found + list(done.failures)


def main(as_json: bool = False) -> int:
    """``vllm-capture-guard check``: 0 pass, 1 startup would fail, 2 not run."""
    from vllm_capture_guard.tools import support
    from vllm_capture_guard.tools.failure import could_not_run
    from vllm_capture_guard.tools.guard import finish, load_plugins_as_worker

    outside = support.problem()
    if outside:
        return could_not_run("check", outside, as_json)
    try:
        told = load_plugins_as_worker("check")
    except Exception as e:
        return could_not_run("check", harness.error_text(e), as_json)
    try:
        harness.make_vllm_config(0, graphs=True)
    except Exception as e:
        return could_not_run("check", support.cannot_set_up(str(e)), as_json)
    try:
        result = run_check()
    except Exception as e:
        return could_not_run("check", harness.error_text(e), as_json)
    result.guard_line = finish(told).line()
    result.guard_warnings = guard_warnings()
    if as_json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
    else:
        print("\n".join(verdict_lines(result)))
    if not result.runs:
        return 2
    return 0 if result.ok else 1
