# SPDX-License-Identifier: Apache-2.0
"""Write docs/audit-<vLLM version>.md from two runs of ``vllm-capture-guard
audit --json``: vLLM as released (``VLLM_CAPTURE_GUARD=off``) and with the
guard (``on``). Every statement in the page is derived from those runs.

    python scripts/audit_docs.py                    # the venv's own vLLM
    python scripts/audit_docs.py --release 0.33.0   # .envs/vllm-0.33.0

The page names only repository-relative paths and commands a reader can type:
no interpreter path, no PYTHONPATH of this machine. The JSON is read through
the audit's schema (``vllm_capture_guard.tools.audit.schema``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vllm_capture_guard.lab.oracle import releases  # noqa: E402
from vllm_capture_guard.runtime import switch  # noqa: E402
from vllm_capture_guard.tools.audit.schema import (  # noqa: E402
    AuditResult,
    BackendReport,
    Built,
    Severity,
    from_json,
)

WORDS = {
    Severity.FAILS: "**fails**",
    Severity.HOST: "**host values differ**",
    Severity.DEVICE: "device values differ",
    Severity.BUILDER: "own buffer differs",
    Severity.EQUAL: "equal",
    Severity.NOT_APPLICABLE: "n/a",
}

Run = tuple[int, AuditResult, float, str]


def run(guard: str, release: str | None) -> Run:
    """``audit --json`` with the guard ``off`` or ``on``, in the venv or in
    another release's environment; returns (exit, result, seconds, the
    command as a reader would type it)."""
    args = ["-m", "vllm_capture_guard", "audit", "--json"]
    t0 = time.perf_counter()
    proc = releases.run_in(release, args, {switch.ENV: guard})
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        sys.exit(f"audit failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    shown = f"{switch.ENV}={guard} .venv/bin/vllm-capture-guard audit --json"
    if release:
        shown = f"PYTHONPATH=.envs/vllm-{release} {shown}"
    return proc.returncode, from_json(proc.stdout), wall, shown


def code(items: list[str]) -> str:
    return ", ".join(f"`{i}`" for i in items) or "-"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main_table(out: AuditResult) -> list[str]:
    later = [s.name for s in out.later if not s.problem]
    head = ["backend", "model", "builder", "CG support", "CPU writes", "device writes"]
    head += [f"then {s}" for s in later] + ["verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in out.backends:
        if b.status != "built":
            continue
        builder = (b.builder_class or "").rsplit(".", 1)[-1]
        if not b.captured:
            err = next((c.error for c in b.captures if c.error), "")
            builder += f" (capture raised: {err})"
        by = {s.later: s.verdict for s in b.sequenced}
        row = [
            f"`{b.name}`",
            b.family or "-",
            builder,
            b.cudagraph_support or "?",
            code(b.cpu_writes),
            code(b.device_writes),
        ]
        row += [WORDS[by.get(s, Severity.NOT_APPLICABLE)] for s in later]
        row.append(f"**{b.verdict}**" if b.verdict == "HAZARD" else b.verdict)
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    return lines


def evidence(b: BackendReport) -> list[str]:
    """One bullet per later builder: what the sequenced check showed."""
    lines = []
    for s in b.sequenced:
        rows = s.per_batch
        failed = [r for r in rows if r.verdict == "fails"]
        text = f"then `{s.later}`: {WORDS[s.verdict]}"
        if failed:
            text += f" in {len(failed)}/{len(rows)} batches: `{failed[0].error}`"
        paths: dict[str, tuple[Any, str]] = {}
        for r in rows:
            for d in r.differences:
                paths.setdefault(d.path, (d, r.batch))
        if paths:
            text += "; " + "; ".join(
                f"`{p}` ({d.severity}) {d.alone} alone, {d.sequenced} after"
                f" [{batch}]"
                + (
                    " (its own buffer, computed from the shared fields; no field "
                    "of its capture metadata references that part)"
                    if d.severity == "builder"
                    else ""
                )
                for p, (d, batch) in paths.items()
            )
        lines.append(f"  - {text}")
    return lines


def assessment(off: AuditResult, on: AuditResult) -> list[str]:
    """Which writes are real hazards and which are harmless, with evidence."""
    on_by = {(b.registry, b.name): b for b in on.backends}
    empty = BackendReport("", "", Built.SKIPPED)
    lines = []
    for b in off.backends:
        if not (b.cpu_writes or b.device_writes):
            continue
        g = on_by.get((b.registry, b.name), empty)
        writes = []
        if b.cpu_writes:
            writes.append(f"CPU {code(b.cpu_writes)}")
        if b.device_writes:
            writes.append(f"device {code(b.device_writes)}")
        lines.append(f"- **`{b.name}`** writes {' and '.join(writes)}.")
        lines += evidence(b)
        removed = [f for f in b.cpu_writes if f not in g.cpu_writes]
        if b.verdict == "HAZARD" and removed and g.verdict != "HAZARD":
            lines.append(
                f"  - With the guard the capture leaves {code(removed)} alone and "
                f"the verdict is *{g.verdict}*: the failure comes from the "
                f"CPU write. **Real hazard: {code(removed)}.** "
                + (
                    f"The device writes {code(g.device_writes)} that "
                    "remain are capture-time only."
                    if g.device_writes
                    else ""
                )
            )
        elif b.verdict == "HAZARD":
            lines.append(
                "  - **Real hazard**: a later builder fails or bakes different "
                "host values into its graph."
            )
        elif b.verdict == "capture-time only":
            lines.append(
                "  - Harmless at replay: only device values differ for later "
                "builders; the graph reads them by address and the runner "
                "rewrites these buffers before every replay. Kernels run during "
                "capture see them (not run here: needs a GPU)."
            )
        elif b.verdict == "contained":
            lines.append(
                "  - Harmless for the builders tested: none of them builds "
                "different metadata after this capture."
            )
    return lines or ["- No built backend writes shared metadata during capture."]


def summary(off: AuditResult, on: AuditResult) -> list[str]:
    """The plain answer: which writes are real hazards, which are harmless."""
    on_by = {(b.registry, b.name): b for b in on.backends}
    empty = BackendReport("", "", Built.SKIPPED)
    hazards, capture_time, contained = [], [], []
    for b in off.backends:
        fields = b.cpu_writes + b.device_writes
        if not fields:
            continue
        g = on_by.get((b.registry, b.name), empty)
        if b.verdict == "HAZARD":
            fixed = g.verdict != "HAZARD"
            hazards.append(
                f"`{b.name}` ({code(b.cpu_writes or fields)}"
                + ("; the guard removes it" if fixed else "; the guard does not fix it")
                + ")"
            )
            if fixed and g.device_writes:
                capture_time.append(
                    f"`{b.name}` ({code(g.device_writes)}, with the guard)"
                )
        elif b.verdict == "capture-time only":
            capture_time.append(f"`{b.name}` ({code(b.device_writes)})")
        elif b.verdict == "contained":
            contained.append(f"`{b.name}` ({code(fields)})")
    return [
        "- **Real hazards** (a later builder fails, or builds other host values, "
        "after this capture): " + ("; ".join(hazards) or "none") + ".",
        "- **Harmless at replay, capture-time only** (later builders see other "
        "device values during capture; nothing host-side changes): "
        + ("; ".join(capture_time) or "none")
        + ".",
        "- **Harmless for every tested builder** (written, but no later builder's "
        "metadata changes): " + ("; ".join(contained) or "none") + ".",
    ]


def guard_table(off: AuditResult, on: AuditResult) -> list[str]:
    on_by = {(b.registry, b.name): b for b in on.backends}
    rows = []
    for b in off.backends:
        g = on_by.get((b.registry, b.name))
        if g is None:
            continue
        keys = ("status", "builder_class", "cpu_writes", "device_writes", "verdict")
        if any(getattr(b, k) != getattr(g, k) for k in keys):
            rows.append(
                f"| `{b.name}` | {code(b.cpu_writes)} / {b.verdict} | "
                f"{(g.builder_class or '').rsplit('.', 1)[-1]} | "
                f"{code(g.cpu_writes)} | {code(g.device_writes)} | "
                f"{g.verdict} |"
            )
    if not rows:
        return ["The guard changes no backend's capture on this vLLM."]
    return [
        "| backend | guard off: CPU writes / verdict | guard on: builder | "
        "CPU writes | device writes | verdict |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def render(runs: dict[str, Run]) -> str:
    rc_off, off, wall_off, cmd_off = runs["off"]
    rc_on, on, wall_on, cmd_on = runs["on"]
    regs: dict[str, list[int]] = {}
    for b in off.backends:
        n = regs.setdefault(b.registry, [0, 0])
        n[0] += 1
        n[1] += b.status == "built"
    per_registry = "; ".join(f"{r}: {n[1]}/{n[0]}" for r, n in regs.items())
    later = ", ".join(
        f"`{s.name}`" + (f" (unavailable: {s.problem})" if s.problem else "")
        for s in off.later
    )
    out = [
        f"# Capture audit of vLLM {off.vllm}",
        "",
        "Generated by `scripts/audit_docs.py` from two runs of "
        "`vllm-capture-guard audit --json`; do not edit by hand.",
        "",
        f"- `{cmd_off}`: exit {rc_off}, {wall_off:.1f} s wall",
        f"- `{cmd_on}`: exit {rc_on}, {wall_on:.1f} s wall",
        "",
        f"**Coverage: built {off.built} of {off.registered} registered "
        f"backends on a CPU-only machine** ({per_registry}); "
        f"{off.captured} ran their capture. Skipped, by cause: "
        + (", ".join(f"{c} {n}" for c, n in off.skipped_by_cause.items()) or "none")
        + "; built, capture cannot run here, by cause: "
        + (
            ", ".join(f"{c} {n}" for c, n in off.not_captured_by_cause.items())
            or "none"
        )
        + ".",
        "",
        "Simulated on this host (no GPU; see [audit.md](audit.md)): "
        + ("; ".join(off.simulated) or "nothing")
        + ".",
        "",
        f"Capture batches: {', '.join(off.batches)}. Later builders (each in "
        f"its own KV-cache group, run after the audited capture on the same "
        f"shared metadata): {later}.",
        "",
        "## Summary",
        "",
        *summary(off, on),
        "",
        "## vLLM as released (`VLLM_CAPTURE_GUARD=off`)",
        "",
        f"Guard: {off.guard}. Backends whose capture writes shared CPU "
        f"metadata: {code(off.cpu_writers)}.",
        "",
        *main_table(off),
        "",
        "## Which writes are real hazards",
        "",
        *assessment(off, on),
        "",
        "## With the guard (`VLLM_CAPTURE_GUARD=on`)",
        "",
        f"Guard: {on.guard}. Backends whose capture writes shared CPU "
        f"metadata: {code(on.cpu_writers)}.",
        "",
        *guard_table(off, on),
        "",
        "## Skipped: cannot be built on this machine",
        "",
        "| registry | backend | cause | needs | reason |",
        "|---|---|---|---|---|",
    ]
    for b in off.backends:
        if b.status != "built":
            out.append(
                f"| {b.registry} | `{b.name}` | {b.cause} | {cell(b.needs or '')} "
                f"| {cell(b.reason or '')} |"
            )
    out += [
        "",
        "## How to read this",
        "",
        "- *CPU writes* / *device writes*: fields of the shared "
        "`CommonAttentionMetadata` whose tensors the capture changed in place "
        "(host fields by `contract.field_side`: `*_cpu`, `*_cpu_*`, `*_np`, "
        "`is_prefilling`...). *Rebinding* a field on the group's own copy "
        "is not a write.",
        "- *then X*: the sequenced check. X's metadata built after this capture "
        "is compared, field by field, with X's metadata built alone on the same "
        "batch. Nested dataclasses compare field by field; tensors by dtype, "
        "shape and values (NaN equals NaN). **fails**: X raises after this "
        "capture only. **host values differ**: a Python value, a shape, or a "
        "host tensor differs; these are baked into the captured graph. *device values "
        "differ*: only device tensor values; the graph reads them by address and "
        "the runner rewrites them before every replay. *own buffer differs*: "
        "only X's persistent buffers, in parts its capture metadata does not "
        "reference.",
        "- Verdicts: **HAZARD** (a later builder fails or gets other host "
        "values), *capture-time only* (device values only), *contained* (writes "
        "that no tested builder's metadata shows), *clean*, *not run* (the "
        "capture itself needs a GPU here).",
        "",
    ]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="default: docs/audit-<vLLM version>.md")
    parser.add_argument(
        "--release", help="audit .envs/vllm-RELEASE instead of the venv's vLLM"
    )
    args = parser.parse_args()
    runs = {guard: run(guard, args.release) for guard in ("off", "on")}
    text = render(runs)
    path = Path(args.out or ROOT / "docs" / f"audit-{runs['off'][1].vllm}.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path.resolve().relative_to(ROOT) if path.is_absolute() else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
