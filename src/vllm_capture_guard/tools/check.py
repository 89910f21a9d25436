# SPDX-License-Identifier: Apache-2.0
"""Every start-up failure the guard fixes, as a verdict on this vLLM.

``vllm-capture-guard check`` runs vLLM's own code on the CPU, with the
plugins loaded by vLLM's loader, and judges one line per failure:

* the MiniMax-M3 indexer after each ROCm backend (``assert decode_query_len
  > 0``; PR #51585), on the model runner vLLM uses for MiniMax-M3
  (:mod:`~vllm_capture_guard.tools.harness.runners` asks vLLM which):
  - the V1 runner: the capture sizes vLLM derives for the config (512 down
    to 1 by default), on one builder per KV-cache group reused for every
    size, in the runner's order (:func:`run_check`);
  - Model Runner V2: the runner itself, made as a worker makes it, and its
    own ``capture_model()`` (:mod:`~vllm_capture_guard.tools.harness.v2`),
    which stops at the first capture that raises, as vLLM does;
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
import sys

from vllm_capture_guard.runtime.plugin import PREFIX, report, vllm_version
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.contract import FieldWrite
from vllm_capture_guard.tools.harness import Batch
from vllm_capture_guard.tools.harness.streams import SiteRun
from vllm_capture_guard.tools.simulate import Simulation, rocm_platform_answered
from vllm_capture_guard.tools.verdict import (  # noqa: F401 (check's API)
    CANNOT_JUDGE,
    DOES_NOT_SHOW,
    INDEXER_CRASH,
    SHOWS,
    Judgement,
    cannot_judge_reason,
    exit_code,
    judge,
    not_judged,
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
    #: ``check``: the runner driven (:class:`.harness.runners.Choice`'s line)
    runner: str | None = None
    #: ``check``: Model Runner V2 stops at the first capture that raises
    stops: bool = False
    #: ``check``: what was set up for the runner on this host, one line each
    setup: list[str] = dataclasses.field(default_factory=list)
    #: ``check``: the capture stream each graph of the driven runner got
    drive_streams: list[str | None] = dataclasses.field(default_factory=list)
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
    answered = Simulation()
    for backend in backends or harness.seed_backends():
        try:
            import_backend(backend, answered)
        except Exception as e:  # e.g. a dependency of vLLM that is missing here
            unavailable[backend] = harness.error_text(e)
            continue
        runs += [seed_run(backend, batch) for batch in batches]
    return _result(runs, unavailable, setup=answered.lines())


def _result(runs: list[SeedRun], unavailable: dict[str, str], **more) -> SeedResult:
    """The runs on this vLLM, with what the guard did in this process so far."""
    guard = report()
    return SeedResult(
        vllm=vllm_version(),
        guard=None if guard is None else guard.message,
        ok=bool(runs) and all(r.ok for r in runs),
        runs=runs,
        unavailable=unavailable,
        **more,
    )


def import_backend(backend: str, answered: Simulation) -> type:
    """The backend's class, its module imported as the audit imports it on a
    host without a GPU: ``vllm.platforms.rocm``'s GPU architecture query
    answered as an MI300X's (0.33's AITER module asks it at import; nothing
    else of the device is simulated). ``answered`` collects what was
    answered, for the ``set up here:`` lines."""
    with rocm_platform_answered(answered):
        return harness.backend_class(backend)


def run_check(
    backends: tuple[str, ...] | None = None, num_speculative_tokens: int = 0
) -> SeedResult:
    """What vLLM runs at start-up, per backend, on the model runner vLLM uses
    for the tiny MiniMax-M3 (asked of vLLM, :func:`.harness.runners.choose`).

    On Model Runner V2 this changes the calling process for good, as vLLM's
    own CPU worker changes its own: vLLM's CPU shims patch torch's streams,
    events and pinned memory, the platform gets memory answers, and the
    harness's model stays registered with vLLM. The command line runs it in
    a process of its own; from Python, call it in one that does nothing
    else."""
    from vllm_capture_guard.tools.harness import runners

    config = harness.make_vllm_config(num_speculative_tokens, graphs=True)
    choice = runners.choose(config)
    if choice.runner == runners.V2:
        if num_speculative_tokens:
            raise RuntimeError("check drives Model Runner V2 without speculation")
        result = _run_v2(backends or harness.seed_backends())
    else:
        result = _run_v1(config, backends, num_speculative_tokens)
    result.runner = choice.line()
    return result


def _run_v1(
    config: object, backends: tuple[str, ...] | None, num_speculative_tokens: int
) -> SeedResult:
    """The V1 runner: every FULL capture size that vLLM derives for the
    config, largest first, on one attention builder and one MiniMax-M3
    indexer builder (one per KV-cache group), built once and reused for every
    size, each size on one shared metadata (recorded right after its
    capture)."""
    from vllm_capture_guard.tools.harness import sizes

    batches = sizes.capture_batches(config)
    if not batches:
        raise RuntimeError("vLLM derived no full-graph capture size for the config")
    runs: list[SeedRun] = []
    unavailable: dict[str, str] = {}
    answered = Simulation()
    for backend in backends or harness.seed_backends():
        try:
            import_backend(backend, answered)
            builders = [
                ("attention", harness.attention_builder(backend, config)),
                ("indexer", harness.indexer_builder(config)),
            ]
        except Exception as e:  # e.g. a dependency of vLLM that is missing here
            unavailable[backend] = harness.error_text(e)
            continue

        def keep(batch: Batch, run: harness.CaptureRun, backend=backend) -> None:
            runs.append(seed_record(backend, batch, run))

        sizes.run_sizes(builders, batches, on_run=keep)
    return _result(
        runs,
        unavailable,
        sizes=[b.num_tokens for b in batches],
        speculative_tokens=num_speculative_tokens,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        setup=answered.lines(),
    )


def v2_record(backend: str, desc: object, builds: list) -> SeedRun:
    """One FULL descriptor of Model Runner V2's capture (its warm-up and its
    capture build), as ``check`` reports it."""
    failed = next((b for b in builds if b.error), None)
    first, last = builds[0], builds[-1]
    return SeedRun(
        backend=backend,
        batch=f"reqs{first.num_reqs}",
        ok=failed is None,
        error=failed.error if failed else None,
        error_site=failed.error_site if failed else None,
        error_line=failed.error_line if failed else None,
        decode_query_len=last.decode_query_len,
        query_start_loc_cpu_before=first.offsets,
        query_start_loc_cpu_after=last.host_after,
        query_start_loc_after=last.device_after,
        groups=[],
        num_tokens=first.num_tokens,
    )


def _run_v2(backends: tuple[str, ...]) -> SeedResult:
    """Model Runner V2, per backend: the runner as a worker makes it, and its
    own ``capture_model()`` (:mod:`.harness.v2`)."""
    import torch

    from vllm_capture_guard.tools.harness import v2

    setup = v2.cpu_setup()
    runs: list[SeedRun] = []
    unavailable: dict[str, str] = {}
    sizes: list[int] = []
    drive_streams: list[str | None] = []
    max_num_seqs = None
    if torch.cuda.is_available():
        raise RuntimeError(
            "check drives Model Runner V2 on the CPU, and this process sees a GPU "
            "(the command line hides them: this is a call from Python)"
        )
    answered = Simulation()
    for backend in backends:
        try:
            import_backend(backend, answered)
        except Exception as e:  # e.g. a dependency of vLLM that is missing here
            unavailable[backend] = harness.error_text(e)
            continue
        config = v2.make_config(backend)  # failing here: check could not run
        runner = v2.make_runner(config)
        note = getattr(runner.model, "written_out", None)
        if note:
            setup.append(f"{backend}'s attention layer: written out ({note})")
        found = v2.capture(runner)
        reached = found.per_descriptor()
        runs += [v2_record(backend, desc, builds) for desc, builds in reached]
        if found.error and not any(b.error for _, bs in reached for b in bs):
            raise RuntimeError(
                f"Model Runner V2's capture_model raised outside the metadata "
                f"builders with {backend}: {found.error} (at {found.error_site})"
            )
        if not found.error and len(reached) < len(found.descriptors):
            raise RuntimeError(
                f"Model Runner V2's capture_model built the metadata of "
                f"{len(reached)} of its {len(found.descriptors)} FULL graphs where "
                "check reads them (the model state's prepare_attn) with "
                f"{backend}; the others cannot be judged"
            )
        sizes = sizes or [d.num_tokens for d in found.descriptors]
        drive_streams += found.streams
        max_num_seqs = config.scheduler_config.max_num_seqs
    return _result(
        runs,
        unavailable,
        sizes=sizes,
        max_num_seqs=max_num_seqs,
        stops=True,
        setup=setup + answered.lines(),
        drive_streams=drive_streams,
    )


def with_drive_streams(sites: list[SiteRun], result: SeedResult) -> list[SiteRun]:
    """``sites``, where the runner driven captured graphs, with the
    ``CudaGraphManager.capture`` site judged from those graphs (what vLLM's
    own ``capture_model`` handed ``torch.cuda.graph``) instead of its drive
    alone."""
    if not result.drive_streams:
        return sites
    found = []
    for site in sites:
        if site.site == "CudaGraphManager.capture":
            streams = result.drive_streams
            site = SiteRun(
                f"{site.site} (in the runner's capture_model)",
                site.module,
                streams,
                all(s == "current" for s in streams),
            )
        found.append(site)
    return found


# --- judging: one line per failure the guard fixes ------------------------------


def guard_warnings() -> list[str]:
    """The guard's warnings and failures in this process so far, with the
    switches' problems (:func:`.guard.warnings`)."""
    from vllm_capture_guard.tools.guard import warnings

    return warnings()


def main(as_json: bool = False, trace: bool = False) -> int:
    """``vllm-capture-guard check``: 0 every check ran and passed, 1 a
    failure would remain, 2 check could not run, or a check (or part of one)
    did not run here, so it cannot judge."""
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
        result.streams = with_drive_streams(streams.check_sites(), result)
    except Exception as e:
        return could_not_run("check", harness.error_text(e), as_json)
    done = report()  # again: the capture sites were imported after run_check
    result.guard = None if done is None else done.message
    result.guard_line = finish(told).line()
    result.guard_warnings = tool_warnings(told)
    judgements = judge(result)
    code = exit_code(judgements)
    result.ok = code == 0
    warn(result.guard_warnings)
    if as_json:
        out = summary(result)
        if trace:
            out.update(dataclasses.asdict(result))
        print(json.dumps(out, indent=None if trace else 2))
    else:
        print("\n".join(verdict_lines(result)))
        if code == CANNOT_JUDGE:  # every exit 2 says why on stderr
            reason = cannot_judge_reason(judgements)
            print(f"{PREFIX} check {reason}", file=sys.stderr)
    return code
