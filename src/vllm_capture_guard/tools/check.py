# SPDX-License-Identifier: Apache-2.0
"""Every start-up failure the guard fixes, as a verdict on this vLLM.

``vllm-capture-guard check`` runs vLLM's own code on the CPU, with the
plugins loaded by vLLM's loader, and judges one line per failure:

* the MiniMax-M3 indexer after each ROCm backend (``assert decode_query_len
  > 0``; PR #51585): the capture sizes vLLM derives for the config (512 down
  to 1 by default), on one builder per KV-cache group reused for every size,
  in the runner's order (:func:`run_check`);
* ``ROCM_AITER_UNIFIED_ATTN``'s capture keeps the query offsets its kernel
  reads at replay (PR #53821), on the same runs;
* capture on vLLM's current stream (PR #53818): vLLM's three capture sites
  driven through a recording ``torch.cuda.graph``
  (:mod:`~vllm_capture_guard.tools.harness.streams`).

The version matrix and the tests also run the small batch shapes of
:data:`~vllm_capture_guard.tools.harness.DEFAULT_BATCHES` (:func:`run_seed`).
``check --json`` prints a summary per check and backend; ``--trace`` adds
every capture size's record.
"""

from __future__ import annotations

import dataclasses
import json

from vllm_capture_guard.runtime.plugin import report, vllm_version
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.contract import FieldWrite
from vllm_capture_guard.tools.harness import Batch
from vllm_capture_guard.tools.harness.streams import SiteRun
from vllm_capture_guard.tools.verdict import (  # noqa: F401 (check's API)
    DOES_NOT_SHOW,
    INDEXER_CRASH,
    SHOWS,
    Judgement,
    judge,
    passed,
    summary,
    verdict_lines,
)


@dataclasses.dataclass
class GroupRecord:
    group: str
    builder: str
    writes: list[FieldWrite]


@dataclasses.dataclass
class SeedRun:
    """One capture sequence (backend x batch), as ``check --trace`` prints it."""

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
    num_tokens: int | None = None


@dataclasses.dataclass
class SeedResult:
    vllm: str
    guard: str | None  # the plugin's report, None if it was not loaded
    #: ``check``: every check passed (the seed runs, and where run, the
    #: query offsets and the capture stream); :func:`run_seed`: the seed runs
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
    #: What the operator is warned about (:func:`.guard.warnings`).
    guard_warnings: list[str] = dataclasses.field(default_factory=list)
    #: ``check``: each capture site of PR #53818, driven.
    streams: list[SiteRun] = dataclasses.field(default_factory=list)


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
        num_tokens=batch.num_tokens,
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
    reused for every size, each size on one shared metadata (recorded right
    after its capture)."""
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

        def keep(batch: Batch, run: harness.CaptureRun, backend=backend) -> None:
            runs.append(seed_record(backend, batch, run))

        sizes.run_sizes(builders, batches, on_run=keep)
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


# --- judging: one line per failure the guard fixes ------------------------------


def guard_warnings() -> list[str]:
    """The guard's warnings and failures in this process so far, with the
    switches' problems (:func:`.guard.warnings`)."""
    from vllm_capture_guard.tools.guard import warnings

    return warnings()


def main(as_json: bool = False, trace: bool = False) -> int:
    """``vllm-capture-guard check``: 0 pass, 1 a failure would remain, 2 not
    run."""
    from vllm_capture_guard.tools import support
    from vllm_capture_guard.tools.failure import could_not_run, warn
    from vllm_capture_guard.tools.guard import finish, load_plugins_as_worker
    from vllm_capture_guard.tools.guard import warnings as tool_warnings
    from vllm_capture_guard.tools.harness import streams

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
        result.streams = streams.check_sites()
    except Exception as e:
        return could_not_run("check", harness.error_text(e), as_json)
    done = report()  # again: the capture sites were imported after run_check
    result.guard = None if done is None else done.message
    result.guard_line = finish(told).line()
    result.guard_warnings = tool_warnings(told)
    result.ok = bool(result.runs) and passed(judge(result))
    warn(result.guard_warnings)
    if as_json:
        out = summary(result)
        if trace:
            out.update(dataclasses.asdict(result))
        print(json.dumps(out, indent=None if trace else 2))
    else:
        print("\n".join(verdict_lines(result)))
    if not result.runs:
        return 2
    return 0 if result.ok else 1
