# SPDX-License-Identifier: Apache-2.0
"""``record``: this vLLM's capture, as JSON.

Load the plugins as a worker does (``VLLM_CAPTURE_GUARD`` decides whether the
guard acts; ``auto`` counts as ``on``), then for each backend a patch fixes x
batch run the seed scenario through the harness with ``record=True``: for
each builder every field of the shared metadata (CPU and device) before and
after its capture, the fields it rebound on its own copy, its error, and
every field of the metadata it returned, all encoded by
:func:`vllm_capture_guard.tools.contract.encode`.
"""

from __future__ import annotations

from typing import Any

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.tools import harness

#: Bumped when the record's layout changes.
SCHEMA = 2
#: Sections of a group record whose fields are compared.
SECTIONS = ("before", "after", "rebound", "returned")


def record_case(backend: str, batch: harness.Batch) -> dict[str, Any]:
    """One backend x batch: every builder's capture, recorded."""
    run = harness.run_capture(backend, batch, record=True)
    groups = [
        {
            "group": g.group,
            "builder": g.builder,
            "error": g.error,
            "error_site": g.error_site,
            **(g.record or {}),
        }
        for g in run.groups
    ]
    return {"backend": backend, "batch": batch.label(), "groups": groups}


def record() -> dict[str, Any]:
    """Load the plugins as a worker does, then record every case."""
    from vllm_capture_guard.runtime import plugin
    from vllm_capture_guard.tools.guard import load_plugins_as_worker

    load_plugins_as_worker()
    guard = plugin.report()
    cases: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for backend in harness.seed_backends():
        try:
            harness.backend_class(backend)
        except Exception as e:  # 0.33 asks the GPU for its arch at import
            unavailable[backend] = harness.error_text(e)
            continue
        for batch in harness.DEFAULT_BATCHES:
            cases[f"{backend}/{batch.label()}"] = record_case(backend, batch)
    mode, _ = switch.read_mode()
    return {
        "schema": SCHEMA,
        "vllm": plugin.vllm_version(),
        "mode": mode.value,
        "guard_action": None if guard is None else guard.action,
        "guard": None if guard is None else guard.message,
        "unavailable": unavailable,
        "cases": cases,
    }


def record_backends() -> dict[str, Any]:
    """Every registered backend the audit builds on this host: its capture at
    the audit's batches, recorded as :func:`record_case` records (one group
    each), with the plugins loaded as a worker loads them. Two such records,
    guard off and on, compared by :func:`..compare.compare`, show whether the
    guard changes what any capture does. The device is simulated as the
    audit simulates it."""
    from vllm_capture_guard.tools.guard import load_plugins_as_worker
    from vllm_capture_guard.tools.simulate import simulated_device

    load_plugins_as_worker()
    with simulated_device():
        return _record_backends()


def _record_backends() -> dict[str, Any]:
    import torch

    from vllm_capture_guard.runtime import plugin
    from vllm_capture_guard.tools.audit.build import Configs, Skip, build_subject
    from vllm_capture_guard.tools.audit.registry import registered_backends
    from vllm_capture_guard.tools.audit.run import AUDIT_BATCHES, _batches_for

    # Workspaces a builder allocates and never writes hold whatever the memory
    # held; torch fills them (NaN, or the largest integer) so that two runs
    # compare. warn_only: an op without a deterministic kernel still runs.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    configs, cases, skipped = Configs(), {}, {}
    spec_tokens = [b.speculative_tokens for b in AUDIT_BATCHES]
    for entry in registered_backends():
        key = f"{entry.registry}.{entry.name}"
        try:
            subject = build_subject(entry, configs, spec_tokens)
        except Skip as e:
            skipped[key] = str(e)
            continue
        for batch in _batches_for(subject.cudagraph_support, AUDIT_BATCHES):
            builder = subject.builders[batch.speculative_tokens]
            run = harness.capture([("audited", builder)], batch, record=True)
            g = run.groups[0]
            group = {"group": g.group, "builder": g.builder, "error": g.error,
                     "error_site": g.error_site, **(g.record or {})}  # fmt: skip
            cases[f"{key}/{batch.label()}"] = {
                "backend": key, "batch": batch.label(), "groups": [group]
            }  # fmt: skip
    guard = plugin.report()
    return {
        "schema": SCHEMA,
        "vllm": plugin.vllm_version(),
        "guard_action": None if guard is None else guard.action,
        "unavailable": skipped,
        "cases": cases,
    }
