# SPDX-License-Identifier: Apache-2.0
"""What the audit finds, as data: the schema of ``audit --json``.

Plain dataclasses, written with :func:`dataclasses.asdict` and read back,
validated, with pydantic (:func:`from_json`), so that the docs generator
(``scripts/audit_docs.py``) and the tests read attributes, not string keys.
Every value the JSON carries is a field here; nothing is computed on output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_capture_guard.runtime.logs import Words
from vllm_capture_guard.tools.contract import FieldWrite


class Severity(Words):
    """How a later builder's metadata after a capture differs from alone."""

    #: it raises after this capture (and not alone): startup dies.
    FAILS = "fails"
    #: a host value differs (a Python scalar, a shape or dtype, a host
    #: tensor): baked into the captured graph.
    HOST = "host"
    #: only device tensor values differ: seen by kernels run during capture.
    DEVICE = "device"
    #: only the later builder's own persistent buffers differ.
    BUILDER = "builder"
    EQUAL = "equal"
    NOT_APPLICABLE = "n/a"


#: Worst first.
SEVERITY = tuple(Severity)


class Verdict(Words):
    """A backend's verdict, worst first."""

    HAZARD = "HAZARD"
    CAPTURE_TIME = "capture-time only"
    CONTAINED = "contained"
    CLEAN = "clean"
    NOT_RUN = "not run"


class Built(Words):
    BUILT = "built"
    SKIPPED = "skipped"


@dataclasses.dataclass
class Divergence:
    """One place where a later builder's metadata differs from alone."""

    path: str
    severity: Severity
    alone: str
    sequenced: str


@dataclasses.dataclass
class BatchCheck:
    """The sequenced check on one batch."""

    batch: str
    verdict: Severity
    differences: list[Divergence] = dataclasses.field(default_factory=list)
    note: str | None = None
    error: str | None = None


@dataclasses.dataclass
class Sequenced:
    """The sequenced check of one backend against one later builder."""

    later: str
    verdict: Severity
    per_batch: list[BatchCheck]


@dataclasses.dataclass
class CaptureOutcome:
    """One capture of the audited builder on fresh runner buffers."""

    batch: str
    writes: list[FieldWrite]
    rebinds: list[str]
    error: str | None = None


@dataclasses.dataclass
class BackendReport:
    registry: str
    name: str
    status: Built
    reason: str | None = None
    backend_class: str | None = None
    builder_class: str | None = None
    spec: str | None = None
    spec_source: str | None = None
    cudagraph_support: str | None = None
    #: The tiny model whose layer it was built from, and its KV-cache dtype.
    family: str | None = None
    kv_cache_dtype: str | None = None
    #: Why it was not built, or its capture could not run here: the cause
    #: (``causes.Cause``) and what it needs.
    cause: str | None = None
    needs: str | None = None
    captures: list[CaptureOutcome] = dataclasses.field(default_factory=list)
    sequenced: list[Sequenced] = dataclasses.field(default_factory=list)
    # Summaries of the above, set once by the run (``audit.run.summarise``).
    captured: bool = False
    cpu_writes: list[str] = dataclasses.field(default_factory=list)
    device_writes: list[str] = dataclasses.field(default_factory=list)
    rebinds: list[str] = dataclasses.field(default_factory=list)
    verdict: Verdict = Verdict.NOT_RUN

    @property
    def writes(self) -> list[tuple[str, FieldWrite]]:
        """(batch, write) for every write of every capture."""
        return [(c.batch, w) for c in self.captures for w in c.writes]


@dataclasses.dataclass
class LaterBuilder:
    name: str
    problem: str | None = None
    #: The family whose model puts it beside the audited backend.
    family: str | None = None


@dataclasses.dataclass
class AuditResult:
    vllm: str
    guard_mode: str
    guard: str | None
    registered: int
    built: int
    captured: int
    cpu_writers: list[str]  # backends whose capture writes shared CPU fields
    batches: list[str]
    later: list[LaterBuilder]
    timings: dict[str, float]
    vllm_cache_root: str | None
    backends: list[BackendReport]
    #: The guard line every command prints, and the guard's own warnings.
    guard_line: str | None = None
    guard_warnings: list[str] = dataclasses.field(default_factory=list)
    #: Why the audit's config enables speculative decoding, if it does.
    speculative_note: str | None = None
    #: What this host could not answer and the audit answered for an MI300X
    #: (``tools.simulate``), one line each.
    simulated: list[str] = dataclasses.field(default_factory=list)
    #: Backends not built here, counted by cause; built ones whose capture
    #: cannot run here, likewise.
    skipped_by_cause: dict[str, int] = dataclasses.field(default_factory=dict)
    not_captured_by_cause: dict[str, int] = dataclasses.field(default_factory=dict)
    #: A pure-Python package missing here -> the backends it would let build.
    packages: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def to_json(result: AuditResult) -> dict[str, Any]:
    return dataclasses.asdict(result)


def from_json(data: dict[str, Any] | str) -> AuditResult:
    """An :class:`AuditResult` from ``audit --json`` output, validated."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(AuditResult)
    if isinstance(data, str):
        return adapter.validate_json(data)
    return adapter.validate_python(data)
