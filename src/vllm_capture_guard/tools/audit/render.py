# SPDX-License-Identifier: Apache-2.0
"""The audit as plain text: the one renderer.

Why plain text and not rich: the audit runs in CI logs, pipes and vendor
images where rich may be missing (it is no dependency of this package), and
its lines are what tests and readers grep for. One renderer that prints the
same lines everywhere beats a pretty table with a fallback that drifts. The
Markdown pages in ``docs/`` are written from the JSON by
``scripts/audit_docs.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.tools.audit.schema import (
    AuditResult,
    BackendReport,
    Built,
    Sequenced,
    Severity,
)
from vllm_capture_guard.tools.contract import DEVICE, FieldWrite


def coverage_line(result: AuditResult) -> str:
    return (
        f"coverage: built {result.built} of {result.registered} registered "
        f"backends on this machine; {result.captured} of them ran their capture"
    )


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{cause} {n}" for cause, n in counts.items()) or "none"


def cause_lines(result: AuditResult) -> list[str]:
    """The skips counted by cause, the captures that cannot run here, the
    packages that would add backends, and what was simulated."""
    out = [f"skipped by cause: {_counts(result.skipped_by_cause)}"]
    if result.not_captured_by_cause:
        out.append(
            "built, capture cannot run here, by cause: "
            + _counts(result.not_captured_by_cause)
        )
    for package, names in result.packages.items():
        out.append(
            f"missing package: installing {package} would let "
            f"{', '.join(names)} be built here"
        )
    if result.simulated:
        out.append("simulated (no GPU here): " + "; ".join(result.simulated))
    return out


def guard_line(result: AuditResult) -> str:
    """The guard line every command prints (``tools.guard.Story.line``)."""
    if result.guard_line:
        return result.guard_line
    guard = result.guard or "not loaded"
    return f"guard: {switch.ENV}={result.guard_mode}; {guard}"


def batches_line(result: AuditResult) -> str:
    later = ", ".join(
        s.name + (f" (unavailable: {s.problem})" if s.problem else "")
        for s in result.later
    )
    text = f"capture batches: {', '.join(result.batches)}; later builders: {later}"
    if result.speculative_note:
        text += f"\n{result.speculative_note}"
    return text


def no_verdict(result: AuditResult) -> str | None:
    """Why the audit has no verdict (no backend asked for ran its capture
    here), in one line; None where one did."""
    if result.captured:
        return None
    if not result.built:
        return (
            f"none of the {result.registered} backends asked for can be built on "
            "this machine (see skipped)"
        )
    return (
        f"none of the {result.built} backends built here could run its capture "
        "(see the lines above)"
    )


def verdict_line(result: AuditResult) -> str:
    by = {b.name: b for b in result.backends}
    if result.cpu_writers:
        return "FAIL: capture writes shared CPU metadata: " + "; ".join(
            f"{n} ({', '.join(by[n].cpu_writes)})" for n in result.cpu_writers
        )
    why = no_verdict(result)
    if why:
        return f"CANNOT JUDGE: {why}"
    unchecked = result.registered - result.captured
    text = "OK: no built backend's capture writes shared CPU metadata"
    if unchecked:
        text += (
            f"; not checked here: the {unchecked} of {result.registered} backends "
            "that were not built or whose capture cannot run here (see skipped)"
        )
    return text


#: Said once under the findings: why device-side ones are no hazard.
EXPECTED = (
    "capture-time only: a capture's writes to device buffers (seq_lens set to "
    "1; ROCM_ATTN zeroes query_start_loc against a kernel fault, vLLM #25985) "
    "and what later builders derive from them while graphs are captured; the "
    "runner fills these buffers again before every replay, so no graph replays "
    "them"
)
_DEVICE_ONLY = (Severity.DEVICE, Severity.BUILDER)


def _sequenced_lines(name: str, s: Sequenced) -> list[tuple[str, bool]]:
    lines = []
    failed = [r for r in s.per_batch if r.verdict is Severity.FAILS]
    if failed:
        lines.append((
            f"{name} -> {s.later}: FAILS after this capture in {len(failed)}/"
            f"{len(s.per_batch)} batches: {failed[0].error}", False,
        ))  # fmt: skip
    paths: dict[str, tuple[str, Any]] = {}
    for row in s.per_batch:
        for d in row.differences:
            paths.setdefault(d.path, (row.batch, d))
    for path, (batch, d) in paths.items():
        lines.append((
            f"{name} -> {s.later}: {path} ({d.severity}) differs; {batch}: "
            f"alone {d.alone}, after {d.sequenced}", d.severity in _DEVICE_ONLY,
        ))  # fmt: skip
    return lines


def _findings(result: AuditResult) -> list[tuple[str, bool]]:
    """(line, device-side only) for each finding."""
    lines = []
    for b in result.backends:
        by_field: dict[str, list[tuple[str, FieldWrite]]] = {}
        for batch, w in b.writes:
            by_field.setdefault(w.field, []).append((batch, w))
        for field, hits in by_field.items():
            batch, w = hits[0]
            lines.append((
                f"{b.name} wrote {field} ({w.side}) in {len(hits)}/"
                f"{len(b.captures)} batches; {batch}: {w.before} -> {w.after}",
                w.side == DEVICE,
            ))  # fmt: skip
        for s in b.sequenced:
            lines += _sequenced_lines(b.name, s)
    return lines


def findings(result: AuditResult) -> list[str]:
    """Each shared field a capture wrote (values from the first batch that
    wrote it) and, per later builder, each place where its metadata after
    this capture differs from its metadata alone."""
    return [line for line, _ in _findings(result)]


def expected_line(result: AuditResult) -> str | None:
    """One line on the device-side findings: expected, and why."""
    found = _findings(result)
    device = sum(only for _, only in found)
    if not device:
        return None
    if device == len(found):
        return f"expected: all {device} findings above are device-side, " + EXPECTED
    return (
        f"expected: {device} of the {len(found)} findings above are device-side, "
        + EXPECTED
        + "; the others are not"
    )


def skipped_lines(skipped: list[BackendReport]) -> list[str]:
    """One line per skipped name and reason: a name that two registries
    share (``CUSTOM``) is shown once, with the registries it stands for."""
    grouped: dict[tuple[str, str | None], list[str]] = {}
    for b in skipped:
        grouped.setdefault((b.name, _needs(b) + (b.reason or "")), []).append(
            b.registry
        )
    names = [name for name, _ in grouped]
    out = []
    for (name, reason), registries in grouped.items():
        label = name
        if len(registries) > 1 or names.count(name) > 1:
            label += f" ({', '.join(registries)})"
        out.append(f"  {label}: skipped ({reason})")
    return out


def _needs(b: BackendReport) -> str:
    return f"[{b.cause}: {b.needs}] " if b.cause else ""


def _backend_line(b: BackendReport) -> str:
    if b.status is not Built.BUILT:
        return skipped_lines([b])[0]
    builder = (b.builder_class or "?").rsplit(".", 1)[-1]
    seq = ", ".join(f"then {s.later}: {s.verdict}" for s in b.sequenced)
    raised = next((c.error for c in b.captures if c.error), None)
    text = (
        f"  {b.name} [{builder}, {b.cudagraph_support}]: {b.verdict}; "
        f"cpu writes {', '.join(b.cpu_writes) or '-'}; "
        f"device writes {', '.join(b.device_writes) or '-'}"
    )
    if b.rebinds:
        text += f"; rebinds {', '.join(b.rebinds)}"
    if seq:
        text += f"; {seq}"
    if raised and not b.captured:
        text += f"; capture raised: {_needs(b)}{raised}"
    return text


def lines(result: AuditResult) -> list[str]:
    out = [
        f"vllm-capture-guard audit of vLLM {result.vllm}",
        guard_line(result),
        *batches_line(result).splitlines(),
    ]
    built = [b for b in result.backends if b.status is Built.BUILT]
    skipped = [b for b in result.backends if b.status is not Built.BUILT]
    out += [_backend_line(b) for b in built]
    if skipped:
        shown = skipped_lines(skipped)
        out.append(f"skipped: cannot be built on this machine ({len(shown)})")
        out += shown
    found = findings(result)
    if found:
        out.append("findings:")
        out += ["  " + line for line in found]
    expected = expected_line(result)
    if expected:
        out.append(expected)
    out += [coverage_line(result), *cause_lines(result), verdict_line(result)]
    return out


def print_report(result: AuditResult, say: Callable[[str], None] = print) -> None:
    for line in lines(result):
        say(line)
