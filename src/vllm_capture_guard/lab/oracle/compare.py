# SPDX-License-Identifier: Apache-2.0
"""``compare``: does a candidate record (patched 0.27.1 or 0.28.0) do what the
reference record (unpatched 0.29.0) does? Fields both releases have must be
equal (:func:`vllm_capture_guard.tools.contract.diff`); fields only one
release declares are listed, not compared."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_capture_guard.lab.oracle.record import SCHEMA, SECTIONS
from vllm_capture_guard.tools.contract import Change, diff


@dataclasses.dataclass
class Comparison:
    """What :func:`compare` found. ``ok`` when nothing differs."""

    reference: str
    candidate: str
    compared: int = 0  # leaf values compared
    differences: list[str] = dataclasses.field(default_factory=list)
    #: "group.section.field" -> the release that alone has that field
    one_sided: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differences

    def report(self, limit: int = 40) -> str:
        verdict = "MATCH" if self.ok else f"DIFFER ({len(self.differences)})"
        lines = [
            f"oracle: {self.candidate} vs reference {self.reference}: {verdict}; "
            f"{self.compared} values compared"
        ]
        lines += [f"  differs: {d}" for d in self.differences[:limit]]
        if len(self.differences) > limit:
            lines.append(f"  ... {len(self.differences) - limit} more")
        for path, only in sorted(self.one_sided.items()):
            lines.append(f"  not compared: {path} exists only in vLLM {only}")
        return "\n".join(lines)


def _label(rec: dict[str, Any]) -> str:
    return f"vLLM {rec.get('vllm')} (guard: {rec.get('guard_action')})"


def _leaves(value: Any) -> int:
    if isinstance(value, dict) and "fields" in value:
        return sum(_leaves(v) for v in value["fields"].values())
    if isinstance(value, list) and not (value and isinstance(value[0], int)):
        return sum(_leaves(v) for v in value) or 1
    return 1


def _section(
    out: Comparison, where: str, generic: str, ref: Any, cand: Any, names: tuple
) -> None:
    if not isinstance(ref, dict) or "kind" not in ref:  # a field -> value map
        ref, cand = ({"kind": "dict", "fields": v or {}} for v in (ref, cand))
    out.compared += _leaves(ref)
    for d in diff(ref, cand):
        path = "" if d.path == "." else "." + d.path
        if d.change is Change.MISSING:
            only = names[0] if d.b == "None" else names[1]
            out.one_sided[f"{generic}{path}"] = only
        else:
            out.differences.append(f"{where}{path}: {d.b} != {d.a} (reference)")


def _groups(out: Comparison, key: str, ref: list, cand: list, names: tuple) -> None:
    for i in range(max(len(ref), len(cand))):
        if i >= len(cand) or i >= len(ref):
            on_cand = i < len(cand)
            group = (cand if on_cand else ref)[i]["group"]
            only = names[1] if on_cand else names[0]
            out.differences.append(f"{key} {group}: ran on vLLM {only} only")
            continue
        rg, cg = ref[i], cand[i]
        where = f"{key} {rg['group']}"
        for item in ("group", "builder", "error"):
            out.compared += 1
            if rg.get(item) != cg.get(item):
                out.differences.append(
                    f"{where} {item}: {cg.get(item)!r} != {rg.get(item)!r} (reference)"
                )
        for section in SECTIONS:
            _section(
                out,
                f"{where} {section}",
                f"{rg['group']}.{section}",
                rg.get(section),
                cg.get(section),
                names,
            )


def compare(reference: dict[str, Any], candidate: dict[str, Any]) -> Comparison:
    """Field by field: does ``candidate`` do what ``reference`` does?"""
    out = Comparison(_label(reference), _label(candidate))
    names = (str(reference.get("vllm")), str(candidate.get("vllm")))
    if reference.get("schema") != SCHEMA or candidate.get("schema") != SCHEMA:
        out.differences.append(f"record schema is not {SCHEMA}")
        return out
    if reference.get("guard_action") == "patched":
        out.differences.append(
            f"the reference {out.reference} was patched; it must be upstream's own"
        )
    ref_cases, cand_cases = reference["cases"], candidate["cases"]
    for key in sorted(set(ref_cases) | set(cand_cases)):
        for cases, rec, name in (
            (cand_cases, candidate, names[1]),
            (ref_cases, reference, names[0]),
        ):
            if key not in cases:
                why = rec.get("unavailable", {}).get(key.split("/")[0], "")
                out.differences.append(f"{key}: not recorded on {name} {why}")
        if key in ref_cases and key in cand_cases:
            ref_groups = ref_cases[key]["groups"]
            _groups(out, key, ref_groups, cand_cases[key]["groups"], names)
    return out
