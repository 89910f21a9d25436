# SPDX-License-Identifier: Apache-2.0
"""Running the audit: each backend's capture on shared runner buffers, then
the *sequenced check*: for each later builder that the backend's family puts
beside it (:mod:`.later`), what it builds *after* this backend's capture must
equal what it builds *alone* on the same batch. The whole run answers for an
MI300X where this host has no device (:mod:`vllm_capture_guard.tools.simulate`).

Every capture goes through the harness
(:func:`vllm_capture_guard.tools.harness.capture`); what a later builder
built is encoded and compared by :mod:`vllm_capture_guard.tools.contract`.
A difference is classed (:class:`~.schema.Severity`) as ``fails`` (it raises
after this capture only), ``host`` (a host value differs: a Python scalar, a
shape or dtype, or a host tensor, all baked into the captured graph),
``device`` (only device tensor values: the graph reads them by address and
the runner rewrites them before every replay), ``builder`` (only the later
builder's own persistent buffers) or ``equal``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.audit.build import Configs, Skip, build_subject
from vllm_capture_guard.tools.audit.causes import Cause
from vllm_capture_guard.tools.audit.causes import classify as cause_of
from vllm_capture_guard.tools.audit.later import BY_FAMILY, Later, applies, build_later
from vllm_capture_guard.tools.audit.registry import Registered, registered_backends
from vllm_capture_guard.tools.audit.schema import (
    SEVERITY,
    AuditResult,
    BackendReport,
    BatchCheck,
    Built,
    CaptureOutcome,
    Divergence,
    LaterBuilder,
    Sequenced,
    Severity,
    Verdict,
)
from vllm_capture_guard.tools.contract import CPU, DEVICE, Change, diff, encode
from vllm_capture_guard.tools.harness import Batch

#: Builders run after each audited capture, in their own KV-cache group,
#: whatever the family (``run_audit(later=...)``); by default each family's.
DEFAULT_LATER = None

#: Capture batches: uniform decode, a padded tail of empty queries, and a
#: speculative-decode verify batch (needs a config with one draft token).
AUDIT_BATCHES = (Batch(4), Batch(3, padded_reqs=4), Batch(2, query_len=2))

LaterBuilt = tuple[Any, str | None]  # (encoded metadata + buffers, or None; error)


def capture_once(builder: Any, batch: Batch) -> CaptureOutcome:
    """``builder``'s capture on fresh runner buffers holding ``batch``."""
    run = harness.capture([("audited", builder)], batch)
    g = run.groups[0]
    error = f"{g.error} (at {g.error_site})" if g.error else None
    return CaptureOutcome(batch.label(), g.writes, g.rebinds, error)


def encode_built(metadata: Any, builder: Any) -> Any:
    """What a builder built, plus its own tensor buffers (``builder.<attr>``):
    a builder may write a value derived from the shared metadata into a
    persistent buffer that its kernels read later."""
    buffers = {k: v for k, v in vars(builder).items() if isinstance(v, torch.Tensor)}
    return encode({"metadata": metadata, "builder": buffers})


def later_after(first: Any | None, later: Any, batch: Batch) -> LaterBuilt:
    """What ``later`` builds on ``batch`` after ``first``'s capture (or alone
    when ``first`` is None), each on its own copy of one shared metadata."""
    builders = [("audited", first)] if first is not None else []
    run = harness.capture([*builders, ("later", later)], batch)
    failed = run.failed
    if failed is not None:
        error = f"{failed.error} (at {failed.error_site})"
        if failed.group == "audited":
            return None, f"the first capture raised: {error}"
        return None, error
    return encode_built(run.groups[-1].returned, later), None


def compare_built(alone: Any, sequenced: Any) -> list[Divergence]:
    out = []
    for d in diff(alone, sequenced):
        if d.path.startswith("builder."):
            severity = Severity.BUILDER
        elif d.change is Change.VALUES and d.side == DEVICE:
            severity = Severity.DEVICE
        else:  # host values, shapes, dtypes, types, fields one side lacks
            severity = Severity.HOST
        out.append(Divergence(d.path, severity, d.a, d.b))
    return out


def classify(diffs: Sequence[Divergence]) -> Severity:
    """The worst severity among ``diffs`` (``equal`` if none)."""
    return min((d.severity for d in diffs), key=SEVERITY.index, default=Severity.EQUAL)


def _qualname(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _batches_for(support: str, batches: Sequence[Batch]) -> list[Batch]:
    """A builder that captures single-token decodes only is never captured
    for speculative batches: the runner does not ask it to."""
    if support == "UNIFORM_SINGLE_TOKEN_DECODE":
        return [b for b in batches if b.query_len == 1]
    return list(batches)


def _check_batch(
    first: Any, later: Any, batch: Batch, error: str | None, alone: LaterBuilt
) -> BatchCheck:
    label = batch.label()
    base, base_error = alone
    if error:
        return BatchCheck(label, Severity.NOT_APPLICABLE, note="this capture raised")
    if base is None:
        note = f"the later builder fails alone: {base_error}"
        return BatchCheck(label, Severity.NOT_APPLICABLE, note=note)
    after, after_error = later_after(first, later, batch)
    if after is None:
        return BatchCheck(label, Severity.FAILS, error=after_error)
    diffs = compare_built(base, after)
    return BatchCheck(label, classify(diffs), diffs)


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def summarise(report: BackendReport) -> BackendReport:
    """Fill in the report's summary fields from its captures and checks."""
    writes = [w for _, w in report.writes]
    report.cpu_writes = _unique([w.field for w in writes if w.side == CPU])
    report.device_writes = _unique([w.field for w in writes if w.side == DEVICE])
    report.rebinds = _unique([r for c in report.captures for r in c.rebinds])
    report.captured = report.status is Built.BUILT and any(
        c.error is None for c in report.captures
    )
    levels = {s.verdict for s in report.sequenced}
    why = report.reason
    if why is None and report.status is Built.BUILT and not report.captured:
        why = next((c.error for c in report.captures if c.error), None)
    if why is not None:
        cause, report.needs = cause_of(why)
        report.cause = cause.value
    if not report.captured:
        report.verdict = Verdict.NOT_RUN
    elif levels & {Severity.FAILS, Severity.HOST}:
        report.verdict = Verdict.HAZARD
    elif Severity.DEVICE in levels:
        report.verdict = Verdict.CAPTURE_TIME
    elif writes:
        report.verdict = Verdict.CONTAINED
    else:
        report.verdict = Verdict.CLEAN
    return report


def audit_backend(
    entry: Registered,
    configs: Configs,
    later: Sequence[Later],
    alone: dict[tuple[str, str], LaterBuilt],
    batches: Sequence[Batch] = AUDIT_BATCHES,
    explicit: bool = False,
) -> BackendReport:
    report = BackendReport(entry.registry, entry.name, Built.BUILT)
    try:
        subject = build_subject(
            entry, configs, [b.speculative_tokens for b in batches], companions(later)
        )
    except Skip as e:
        report.status, report.reason = Built.SKIPPED, str(e)
        return summarise(report)
    report.family = subject.family
    report.kv_cache_dtype = subject.kv_cache_dtype
    report.backend_class = _qualname(subject.backend)
    report.builder_class = _qualname(subject.builder_cls)
    report.spec = type(subject.spec).__name__
    report.spec_source = subject.spec_source
    report.cudagraph_support = subject.cudagraph_support
    run_batches = _batches_for(subject.cudagraph_support, batches)
    errors: dict[str, str | None] = {}
    for batch in run_batches:
        outcome = capture_once(subject.builders[batch.speculative_tokens], batch)
        report.captures.append(outcome)
        errors[batch.label()] = outcome.error
    for other in later:
        if other.problem or not _beside(other, subject.family, explicit):
            continue
        rows = [
            _check_batch(
                subject.builders[b.speculative_tokens],
                other.builders[b.speculative_tokens],
                b,
                errors[b.label()],
                alone[(other.name, b.label())],
            )
            for b in run_batches
        ]
        worst = min(
            (r.verdict for r in rows),
            key=SEVERITY.index,
            default=Severity.NOT_APPLICABLE,
        )
        report.sequenced.append(Sequenced(other.name, worst, rows))
    return summarise(report)


def _count(reports: Iterable[BackendReport]) -> dict[str, int]:
    found = [r.cause for r in reports if r.cause]
    return {c.value: found.count(c.value) for c in Cause if c.value in found}


def _packages(reports: Sequence[BackendReport]) -> dict[str, list[str]]:
    """A missing pure-Python package -> the backends it stops here."""
    out: dict[str, list[str]] = {}
    for r in reports:
        if r.cause == Cause.PACKAGE.value and r.needs:
            out.setdefault(r.needs, []).append(r.name)
    return out


def _beside(other: Later, family: str, explicit: bool) -> bool:
    """Is ``other`` run after a backend of ``family``? Every later builder
    asked for by name is; by default, those its family puts beside it."""
    return explicit or other.name in BY_FAMILY.get(family, ())


def companions(later: Sequence[Later]) -> dict[str, list[Any]]:
    """Per family, the backends of its later builders (their KV-cache groups
    share the block size the runner picks)."""
    found: dict[str, list[Any]] = {}
    for other in later:
        if other.backend is not None and other.name in BY_FAMILY.get(other.family, ()):
            found.setdefault(other.family, []).append(other.backend)
    return found


def later_names(later: Sequence[str] | None) -> list[str]:
    if later is not None:
        return list(later)
    names = [n for family in BY_FAMILY.values() for n in family]
    return [n for n in dict.fromkeys(names) if applies(n)]


def run_audit(
    names: Sequence[str] | None = None,
    later: Sequence[str] | None = DEFAULT_LATER,
    batches: Sequence[Batch] = AUDIT_BATCHES,
    guard_mode: str = "?",
    progress: Callable[[str], None] | None = None,
) -> AuditResult:
    """Audit vLLM as this process sees it (patched or not): every registered
    backend, or those in ``names``, with the device simulated where this host
    has none."""
    from vllm_capture_guard.tools.simulate import simulated_device

    with simulated_device() as sim:
        result = _run_audit(names, later, batches, guard_mode, progress)
    result.simulated = sim.lines()
    return result


def _run_audit(
    names: Sequence[str] | None,
    later: Sequence[str] | None,
    batches: Sequence[Batch],
    guard_mode: str,
    progress: Callable[[str], None] | None,
) -> AuditResult:
    from vllm_capture_guard.runtime.plugin import report, vllm_version

    t0 = time.perf_counter()
    configs = Configs()
    spec_tokens = [b.speculative_tokens for b in batches]
    entries = registered_backends()
    if names:
        wanted = {n.upper() for n in names}
        entries = [e for e in entries if e.name.upper() in wanted]
    explicit = later is not None
    built_later = [build_later(n, configs, spec_tokens) for n in later_names(later)]
    alone: dict[tuple[str, str], LaterBuilt] = {}
    for other in built_later:
        if other.problem:
            continue
        for batch in batches:
            lb = other.builders[batch.speculative_tokens]
            alone[(other.name, batch.label())] = later_after(None, lb, batch)
    t1 = time.perf_counter()
    reports = []
    for entry in entries:
        if progress:
            progress(entry.name)
        reports.append(
            audit_backend(entry, configs, built_later, alone, batches, explicit)
        )
    t2 = time.perf_counter()
    guard = report()
    spec = max(spec_tokens, default=0)
    note = None
    if spec:
        with_spec = [b.label() for b in batches if b.speculative_tokens]
        note = (
            f"speculative decoding: on in the audit's config only for "
            f"{', '.join(with_spec)} (n-gram proposer, {spec} draft token"
            f"{'s' if spec > 1 else ''}), to capture a speculative verify batch"
        )
    return AuditResult(
        skipped_by_cause=_count(r for r in reports if r.status is Built.SKIPPED),
        not_captured_by_cause=_count(
            r for r in reports if r.status is Built.BUILT and not r.captured
        ),
        packages=_packages(reports),
        vllm=vllm_version(),
        guard_mode=guard_mode,
        guard=None if guard is None else guard.message,
        registered=len(reports),
        built=sum(b.status is Built.BUILT for b in reports),
        captured=sum(b.captured for b in reports),
        cpu_writers=[b.name for b in reports if b.cpu_writes],
        batches=[b.label() for b in batches],
        later=[LaterBuilder(s.name, s.problem, s.family) for s in built_later],
        timings={
            "configs_s": round(configs.time_spent, 3),
            "setup_s": round(t1 - t0, 3),
            "backends_s": round(t2 - t1, 3),
        },
        vllm_cache_root=os.environ.get("VLLM_CACHE_ROOT"),
        backends=reports,
        speculative_note=note,
    )
