# SPDX-License-Identifier: Apache-2.0
"""The drift report of ``make newest``: what changed between the newest
release the version matrix pins and a new vLLM release, from the results of
the same four commands on each (``scripts/newest.py`` runs them).

Plain functions over plain data, so that they can be tested on small
hand-made inputs. A release's results are::

    {"release": "0.34.0",
     "commands": {"status": OUTCOME, "check": OUTCOME, "audit": OUTCOME,
                  "generic": OUTCOME}}

where an OUTCOME is ``{"rc": exit status, "json": what it printed (None if
nothing could be read), "reason": why it could not run (None if it ran),
"seconds": wall time}``. ``status``, ``check`` and ``audit`` hold the JSON
of ``vllm-capture-guard CMD --json``; ``generic`` holds the summary of
vLLM's generic capture test in the release's own ``tests/`` tree (per
backend: its outcome and the host fields it wrote).

Every difference is a :class:`Drift` of one of :data:`KINDS`; any drift
needs a maintainer (docs/newest.md says what each kind means).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

#: The commands, in the report's order, as a reader would type them.
COMMANDS = {
    "status": "vllm-capture-guard status --json",
    "check": "vllm-capture-guard check --json",
    "audit": "VLLM_CAPTURE_GUARD=off vllm-capture-guard audit --json",
    "generic": "vLLM's generic capture test, in the release's own tests/ tree",
}

#: The kinds of drift, in the report's order (each a section of docs/newest.md).
KINDS = (
    "could not run",
    "runs again",
    "newly registered",
    "no longer registered",
    "newly skipped",
    "no longer skipped",
    "newly hazardous",
    "no longer hazardous",
    "check's verdict",
    "check's runner",
    "status's verdict",
)

#: How far the audit got with a backend.
NOT_BUILT, NOT_CAPTURED, CAPTURED = 0, 1, 2
LEVELS = {
    NOT_BUILT: "not built",
    NOT_CAPTURED: "built, its capture cannot run here",
    CAPTURED: "captured",
}


@dataclasses.dataclass(frozen=True)
class Drift:
    kind: str
    text: str


def one_line(text: str | None, most: int = 200) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= most else text[: most - 3] + "..."


def ran(outcome: dict | None) -> dict | None:
    """The JSON of a command that ran, or None."""
    if not outcome or outcome.get("reason") is not None:
        return None
    return outcome.get("json")


# --- the commands that could not run ------------------------------------------


def command_drift(pinned: dict, newest: dict) -> list[Drift]:
    out = []
    for name in COMMANDS:
        p, n = pinned["commands"].get(name), newest["commands"].get(name)
        if ran(n) is None:
            also = " (also on the pinned release)" if ran(p) is None else ""
            why = one_line((n or {}).get("reason") or "not run")
            out.append(Drift("could not run", f"{name}: exit {_rc(n)}: {why}{also}"))
        elif ran(p) is None:
            why = one_line((p or {}).get("reason") or "not run")
            out.append(Drift("runs again", f"{name}: could not run there: {why}"))
    return out


def _rc(outcome: dict | None) -> str:
    rc = (outcome or {}).get("rc")
    return "none" if rc is None else str(rc)


# --- the audit: each backend -----------------------------------------------------


def backend_key(report: dict) -> str:
    """A backend's name, ``mamba-`` before those of the Mamba registry (as
    vLLM's generic test names them)."""
    mamba = "Mamba" in (report.get("registry") or "")
    return ("mamba-" if mamba else "") + report["name"]


def level(report: dict) -> int:
    if report.get("captured"):
        return CAPTURED
    return NOT_CAPTURED if report.get("status") == "built" else NOT_BUILT


def why_not(report: dict) -> str:
    """The cause, what it needs, and the error that told it."""
    error = report.get("reason")
    if not error:
        errors = [c.get("error") for c in report.get("captures") or []]
        error = next((e for e in errors if e), "")
    cause = report.get("cause") or "no cause given"
    needs = f" ({report['needs']})" if report.get("needs") else ""
    return f"{cause}{needs}" + (f": {one_line(error, 160)}" if error else "")


def hazard(report: dict) -> list[str]:
    """The shared CPU fields the backend's capture writes (the audit's
    ``cpu_writes``); where only its verdict says ``HAZARD`` (a later
    builder's host values differ after it), that."""
    fields = list(report.get("cpu_writes") or [])
    if not fields and report.get("verdict") == "HAZARD":
        fields = ["HAZARD (a later builder's host values differ)"]
    return fields


def audit_drift(pinned: dict, newest: dict) -> list[Drift]:
    p = {backend_key(b): b for b in pinned.get("backends", [])}
    n = {backend_key(b): b for b in newest.get("backends", [])}
    out = []
    for key in sorted(n.keys() - p.keys()):
        state = LEVELS[level(n[key])]
        more = "" if level(n[key]) == CAPTURED else f": {why_not(n[key])}"
        out.append(Drift("newly registered", f"{key}: {state}{more}"))
    out += [Drift("no longer registered", k) for k in sorted(p.keys() - n.keys())]
    for key in sorted(p.keys() & n.keys()):
        a, b = p[key], n[key]
        if level(b) < level(a):
            text = f"{key}: {LEVELS[level(a)]} -> {LEVELS[level(b)]}: {why_not(b)}"
            out.append(Drift("newly skipped", text))
        elif level(b) > level(a):
            text = f"{key}: {LEVELS[level(a)]} ({why_not(a)}) -> {LEVELS[level(b)]}"
            out.append(Drift("no longer skipped", text))
        was, now = set(hazard(a)), set(hazard(b))
        if now - was:  # a field it did not write before, even beside others
            new = ", ".join(sorted(now - was))
            text = f"{key}: the audit: its capture writes {new}"
            out.append(Drift("newly hazardous", text))
        if was - now:
            gone = ", ".join(sorted(was - now))
            text = f"{key}: the audit: its capture no longer writes {gone}"
            out.append(Drift("no longer hazardous", text))
    return out


def generic_drift(pinned: dict, newest: dict) -> list[Drift]:
    """vLLM's generic test: the backends it fails on (a capture that writes
    shared host values), and those it errors on."""
    p, n = pinned.get("backends", {}), newest.get("backends", {})
    out = []
    for key in sorted(p.keys() | n.keys()):
        a, b = p.get(key, {}), n.get(key, {})
        was, now = a.get("outcome") == "failed", b.get("outcome") == "failed"
        if now and not was:
            writes = b.get("host_writes") or "host values"
            text = f"{key}: vLLM's generic test fails: its capture writes {writes}"
            out.append(Drift("newly hazardous", text))
        elif was and not now:
            text = f"{key}: vLLM's generic test no longer fails ({b.get('outcome')})"
            out.append(Drift("no longer hazardous", text))
        if b.get("outcome") == "error" and a.get("outcome") != "error":
            text = f"generic: {key} errors: {one_line(b.get('text'))}"
            out.append(Drift("could not run", text))
        elif not (was or now) and a.get("outcome") != b.get("outcome"):
            old_, new_ = a.get("outcome", "not run"), b.get("outcome", "not run")
            skipped = new_ in ("skipped", "not run")
            kind = "newly skipped" if skipped else "no longer skipped"
            text = f"{key}: vLLM's generic test: {old_} -> {new_}"
            out.append(Drift(kind, text))
    return out


# --- check and status ---------------------------------------------------------------


def check_verdict(outcome: dict | None) -> str:
    found = ran(outcome)
    if found is None:
        return "could not run"
    failing = [c["name"] for c in found.get("checks", []) if c.get("ok") is False]
    if failing:
        return "fail: " + "; ".join(failing)
    return "pass" if outcome.get("rc") == 0 else f"exit {outcome.get('rc')}"


def check_item(item: dict | None) -> str:
    if item is None:
        return "not checked"
    ok = item.get("ok")
    state = {True: "PASS", False: "FAIL", None: "not run here"}.get(ok, str(ok))
    text = f"{state}, {item.get('passed')}/{item.get('total')} {item.get('unit')}"
    note = item.get("failure") or item.get("note")
    return text + (f" ({one_line(note, 160)})" if note else "")


def _item_state(item: dict | None) -> tuple:
    """What a check line says: its verdict, its counts and unit, its words."""
    if item is None:
        return (None,)
    keys = ("ok", "passed", "total", "unit", "failure", "note")
    return tuple(item.get(k) for k in keys)


def _sizes(found: dict) -> str:
    """``check --json``'s capture sizes, in one phrase."""
    sizes = found.get("capture_sizes") or {}
    count, largest = sizes.get("count"), sizes.get("largest")
    return f"{count} ({largest}..{sizes.get('smallest')})" if count else "none"


def runner(found: dict) -> tuple[str, str]:
    """(the runner and its file, why vLLM uses it), from ``check --json``'s
    ``runner`` line (``NAME (FILE): WHY``)."""
    line = found.get("runner") or "not said"
    name, _, why = line.partition(": ")
    return name, why


def check_drift(pinned: dict, newest: dict) -> list[Drift]:
    out = []
    p_items = {c["name"]: c for c in pinned["json"].get("checks", [])}
    n_items = {c["name"]: c for c in newest["json"].get("checks", [])}
    if check_verdict(pinned) != check_verdict(newest):
        text = f"{check_verdict(pinned)} -> {check_verdict(newest)}"
        out.append(Drift("check's verdict", text))
    for name in sorted(p_items.keys() | n_items.keys()):
        a, b = p_items.get(name), n_items.get(name)
        if _item_state(a) != _item_state(b):
            text = f"{name}: {check_item(a)} -> {check_item(b)}"
            out.append(Drift("check's verdict", text))
    if _sizes(pinned["json"]) != _sizes(newest["json"]):
        text = f"capture sizes: {_sizes(pinned['json'])} -> {_sizes(newest['json'])}"
        out.append(Drift("check's verdict", text))
    (a, _), (b, why) = runner(pinned["json"]), runner(newest["json"])
    if a != b:
        out.append(Drift("check's runner", f"{a} -> {b}: {why}"))
    return out


def status_drift(pinned: dict, newest: dict) -> list[Drift]:
    """The verdict (``protected``, ``affected``) and each fix as ``status``
    read it from the release's source (a fix ``not read here`` names a
    function the tools could not find)."""
    out = []
    for key in ("protected", "affected"):
        a, b = pinned.get(key), newest.get(key)
        if a != b:
            out.append(Drift("status's verdict", f"{key}: {a} -> {b}"))
    p = {x["name"]: x for x in pinned.get("patches", [])}
    n = {x["name"]: x for x in newest.get("patches", [])}
    for name in sorted(p.keys() | n.keys()):
        a, b = p.get(name, {}).get("status"), n.get(name, {}).get("status")
        if a != b:
            detail = one_line(n.get(name, {}).get("detail"), 160)
            text = f"{name}: {a} -> {b}" + (f" ({detail})" if detail else "")
            out.append(Drift("status's verdict", text))
    return out


# --- the whole comparison -----------------------------------------------------------


def compare(pinned: dict, newest: dict) -> list[Drift]:
    """Every drift from ``pinned``'s results to ``newest``'s, in :data:`KINDS`
    order. A command that could not run on either side is compared no
    further."""
    out = command_drift(pinned, newest)
    p, n = pinned["commands"], newest["commands"]
    if ran(p.get("audit")) and ran(n.get("audit")):
        out += audit_drift(ran(p["audit"]), ran(n["audit"]))
    if ran(p.get("generic")) and ran(n.get("generic")):
        out += generic_drift(ran(p["generic"]), ran(n["generic"]))
    if ran(p.get("check")) and ran(n.get("check")):
        out += check_drift(p["check"], n["check"])
    if ran(p.get("status")) and ran(n.get("status")):
        out += status_drift(ran(p["status"]), ran(n["status"]))
    return sorted(out, key=lambda d: KINDS.index(d.kind))


def exit_status(drifts: Iterable[Drift]) -> int:
    """0 when nothing needs a maintainer, 1 when something does."""
    return 1 if list(drifts) else 0


# --- figures, side by side ---------------------------------------------------------


def status_figures(found: dict) -> dict[str, object]:
    rows = {k: found.get(k) for k in ("protected", "affected")}
    return rows | {x["name"]: x.get("status") for x in found.get("patches", [])}


def check_figures(found: dict) -> dict[str, object]:
    rows = {"ok": found.get("ok"), "runner": runner(found)[0]}
    for item in found.get("checks", []):
        rows[item["name"]] = check_item(item).split(" (", 1)[0]
    return rows


def audit_figures(found: dict) -> dict[str, object]:
    rows = {k: found.get(k) for k in ("registered", "built", "captured")}
    rows["writers of shared CPU metadata"] = len(found.get("cpu_writers") or [])
    for cause, count in (found.get("skipped_by_cause") or {}).items():
        rows[f"not built: {cause}"] = count
    for cause, count in (found.get("not_captured_by_cause") or {}).items():
        rows[f"built, not captured: {cause}"] = count
    return rows


def generic_figures(found: dict) -> dict[str, object]:
    rows: dict[str, object] = {"ROCm instance test": found.get("instance")}
    for outcome in ("passed", "failed", "error", "skipped"):
        rows[outcome] = (found.get("outcomes") or {}).get(outcome, 0)
    for cause, count in (found.get("skips_by_cause") or {}).items():
        rows[f"skipped: {cause}"] = count
    return rows


#: Each command's figures, from the JSON of a command that ran.
FIGURES = {
    "status": status_figures,
    "check": check_figures,
    "audit": audit_figures,
    "generic": generic_figures,
}


def side_by_side(names: tuple[str, str], rows: tuple[dict, dict]) -> list[str]:
    """A small table: a header of the two names, then one row per key of
    either side, in first-seen order; rows that differ are marked."""
    keys = list(dict.fromkeys([*rows[0], *rows[1]]))
    width = max(len(k) for k in keys) + 4
    col = max([len(str(r.get(k, "-"))) for r in rows for k in keys] + [6]) + 2
    lines = [f"{'':<{width}}{names[0]:<{col}}{names[1]}"]
    for k in keys:
        a, b = (str(r.get(k, "-")) for r in rows)
        mark = "" if a == b or k == "seconds" else "   <- differs"
        lines.append(f"  {k:<{width - 2}}{a:<{col}}{b}{mark}")
    return lines


def render(pinned: dict, newest: dict, drifts: list[Drift]) -> list[str]:
    """The report's lines: each command's exit status and figures side by
    side, every kind of drift (``none`` or each item), the verdict last."""
    p, n = pinned["release"], newest["release"]
    names, sides = (p, n), (pinned["commands"], newest["commands"])
    same = " (the same release: one run serves both)" if p == n else ""
    lines = [f"== vLLM {n} against {p}, the newest release the matrix pins{same}"]
    for name, shown in COMMANDS.items():
        rows = []
        for outcome in (side.get(name) for side in sides):
            row = {
                "exit status": _rc(outcome),
                "seconds": (outcome or {}).get("seconds"),
            }
            rows.append(row | (FIGURES[name](ran(outcome)) if ran(outcome) else {}))
        lines.append(f"{name}: {shown}")
        lines += side_by_side(names, (rows[0], rows[1]))
    if ran(sides[1].get("check")):
        name, why = runner(ran(sides[1]["check"]))
        lines.append(f"check drove on {n}: {name}: {why}")
    for kind in KINDS:
        found = [d.text for d in drifts if d.kind == kind]
        lines.append(f"{kind}: {'none' if not found else len(found)}")
        lines += [f"  {text}" for text in found]
    if drifts:
        lines.append(
            f"newest: {len(drifts)} drift item(s) from vLLM {p} to {n}: a "
            "maintainer is needed (docs/newest.md says what each kind means)"
        )
    else:
        lines.append(
            f"newest: no drift: vLLM {n} runs as {p} does in status, check, the "
            "audit and vLLM's generic capture test; nothing needs a maintainer"
        )
    return lines
