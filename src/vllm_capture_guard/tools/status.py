# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard status``: is this vLLM affected, and is it protected?

One verdict, last: ``protected: yes``, ``no (why)``, ``not affected`` or
``cannot judge (why)``, and the exit code that goes with it (0, 1, 0, 2; 2
also when it could not run). "cannot judge": a fix's code could not be read
on this host (its module does not import here) and the guard does not
install that fix here, so whether this vLLM needs it is not known.

* *Affected* is read from vLLM's source (each fix's ``readings()`` in
  :mod:`.fixes`), never from its version: each fix is needed, may be
  needed (the reading is in doubt), or not needed. ``check`` runs the capture itself.
* *Protected*: the plugins are then loaded by vLLM's own loader, as ``check``
  loads them (off ROCm, ``auto`` counts as on: the ROCm path, simulated), and
  every fix this vLLM needs must come out installed. So a guard left out by
  ``VLLM_PLUGINS``, switched off, or with a needed patch disabled by name is
  "no", with the reason.

The guard line is :func:`.guard.story`'s as this host has it, the one that
``check`` and ``audit`` print too. All of it reads this shell's environment,
which may not be the server's, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from vllm_capture_guard import __version__
from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.plugin import PREFIX, vllm_version
from vllm_capture_guard.tools.guard import PLUGINS_ENV, story

NEEDED, MAYBE, NOT_NEEDED, NOT_READ = (
    "needed",
    "may be needed",
    "not needed",
    "not read here",
)


@dataclasses.dataclass
class Need:
    """What vLLM's source says one fix is needed for."""

    name: str
    pr: str
    state: str  # NEEDED, MAYBE, NOT_NEEDED or NOT_READ
    detail: str
    #: what could not be read on this host (its module does not import here)
    unread: list[str] = dataclasses.field(default_factory=list)

    @property
    def affects(self) -> bool:
        return self.state in (NEEDED, MAYBE)


def _need(name: str, pr: str, readings: list[Any], consequence: str) -> Need:
    """One fix's line: each distinct reading once, with what it names."""
    read = [r for r in readings if r.importable]
    if any(r.needed for r in read):
        state = NEEDED
    elif any(r.needed is None for r in read):
        state = MAYBE
    else:
        state = NOT_NEEDED if read else NOT_READ
    groups: dict[tuple[Any, str], list[str]] = {}
    for r in read:
        groups.setdefault((r.needed, r.why), []).append(r.where)
    parts = [f"{', '.join(where)}: {why}" for (_, why), where in groups.items()]
    text = "; ".join(parts)
    if state == NEEDED:
        text += f"; {consequence}"
    gone = [f"{r.where} ({r.why})" for r in readings if not r.importable]
    if gone:  # NOT_READ says so already
        said = "" if state == NOT_READ else "not read here: "
        text += ("; " if text else "") + said + "; ".join(gone)
    return Need(name, pr, state, text, [r.where for r in readings if not r.importable])


def needs() -> list[Need]:
    """Per patch, in the runtime's order: needed by this vLLM's source?"""
    from vllm_capture_guard.tools import fixes

    found = []
    for patch in fixes.all_patches():
        try:
            fix = fixes.module_of(patch)
            need = _need(patch.name, patch.pr, fix.readings(), fix.CONSEQUENCE)
            found.append(need)
        except Exception as e:
            why = f"could not read ({type(e).__name__}: {e})"
            found.append(Need(patch.name, patch.pr, MAYBE, why[:300]))
    return found


def _shell() -> str:
    """The switches as this shell has them."""
    names = (PLUGINS_ENV, switch.ENV, switch.DISABLE_ENV)
    shown = [
        f"{n}={os.environ[n]!r}" if n in os.environ else f"{n} unset" for n in names
    ]
    return (
        f"read from this shell ({', '.join(shown)}); a server started from "
        "another shell, unit or container reads its own, which may differ"
    )


#: The verdicts, and the exit code of each.
YES, NO, NOT_AFFECTED, UNKNOWN = "yes", "no", "not affected", "cannot judge"
EXIT = {YES: 0, NOT_AFFECTED: 0, NO: 1, UNKNOWN: 2}


def _unread(found: list[Need], installed: set[str]) -> list[str]:
    """What was not read on this host, of each fix the guard does not
    install here: whether this vLLM needs it is not known."""
    out = []
    for need in found:
        if need.unread and need.name not in installed:
            out.append(f"{need.name} ({', '.join(need.unread)})")
    return out


def _disabled(name: str) -> str:
    """Why a needed patch is off: its name, or a former one, in the switch."""
    from vllm_capture_guard.tools import fixes

    listed = switch.disabled_patches()
    if name in listed:
        return f"{name} is listed in {switch.DISABLE_ENV}"
    former = [old for old in fixes.by_name(name).former_names if old in listed]
    by = f" by its former name {former[0]}" if former else ""
    return f"{name} is listed in {switch.DISABLE_ENV}{by}"


def protection(host: Any, found: list[Need]) -> tuple[str, str, bool]:
    """``(verdict, why, simulated)``: load the plugins as ``check`` does and
    see whether every needed fix comes out installed. A fix whose code could
    not be read here, and that the guard does not install, leaves the
    verdict "cannot judge": neither "not affected" nor "yes" is known."""
    from vllm_capture_guard.runtime.patching import Status

    fixed = {Status.PATCHED, Status.ALREADY, Status.NOT_NEEDED}  # as upstream's
    from vllm_capture_guard.runtime.plugin import report
    from vllm_capture_guard.tools.guard import load_plugins_as_worker

    wanted = [n for n in found if n.affects]
    if not wanted:  # the plugins are not loaded here: nothing is installed
        unread = _unread(found, set())
        if unread:
            return (
                UNKNOWN,
                "this vLLM's source, as far as it was read, needs none of the "
                f"fixes; not read on this host: {'; '.join(unread)}",
                False,
            )
        return NOT_AFFECTED, "this vLLM's source needs none of the fixes", False
    judged = load_plugins_as_worker("status")
    done = report()
    if done is None:
        reasons = host.not_loaded_because or judged.not_loaded_because
        return NO, "the guard is not loaded: " + "; ".join(reasons), False
    if done.action == "disabled":
        return NO, f"{switch.ENV}=off: the guard does nothing", False
    problems = list(done.failures)
    for need in wanted:
        outcome = done.outcomes.get(need.name)
        if outcome is None:
            problems.append(f"{need.name} was not applied")
        elif outcome.status is Status.DISABLED:
            problems.append(_disabled(need.name))
        elif outcome.status is Status.INCOMPLETE:
            problems.append(f"{need.name} is incomplete ({outcome.warning})")
        elif outcome.status not in fixed:
            problems.append(f"{need.name}: {outcome.status} ({outcome.detail})")
    if problems:
        return NO, "; ".join(problems), False
    simulated = not host.rocm and host.mode == switch.Mode.AUTO.value
    why = "the guard applies " + ", ".join(n.name for n in wanted)
    if simulated:
        why += (
            "; judged for the ROCm path, as check does (on this host, not ROCm, "
            "auto leaves vLLM alone)"
        )
    installed = {n for n, o in done.outcomes.items() if o.status in fixed}
    unread = _unread(found, installed)
    if unread:
        why += f"; not read on this host, and not installed here: {'; '.join(unread)}"
        return UNKNOWN, why, simulated
    return YES, why, simulated


def facts() -> dict[str, Any]:
    """What ``status`` reports, as one JSON-able dict (``exit``: its code)."""
    from vllm_capture_guard.runtime.plugin import report
    from vllm_capture_guard.tools import support
    from vllm_capture_guard.tools.fixes import by_name, former_names
    from vllm_capture_guard.tools.guard import warnings
    from vllm_capture_guard.tools.tree.command import status_line

    told = story()  # this host, before anything is loaded here
    shell = _shell()  # before the tools' own "auto counts as on"
    found = needs()  # read before the plugin patches this process
    in_tree = status_line()
    verdict, why, simulated = protection(told, found)
    done = report()
    outcomes = {} if done is None else done.outcomes
    unsupported = support.problem()
    out = {
        "ok": True,
        "guard_version": __version__,
        "vllm": vllm_version(),
        "supported": unsupported is None,
        "unsupported_because": unsupported,
        "platform": told.platform,
        "rocm": told.rocm,
        "patches": [
            {
                "name": n.name,
                "former_names": list(by_name(n.name).former_names),
                "pr": n.pr,
                "status": n.state,
                "detail": n.detail,
                "guard": str(outcomes[n.name].status) if n.name in outcomes else None,
            }
            for n in found
        ],
        "former_names": former_names(),
        "affected": any(n.affects for n in found),
        "in_tree_fix": in_tree,
        "mode": told.mode,
        "mode_warning": told.mode_problem,
        "loaded": told.loaded,
        "not_loaded_because": told.not_loaded_because,
        "active": told.acts,
        "guard": told.line(),
        "environment": shell,
        "protected": verdict,
        "protected_because": why,
        "simulated": simulated,
        "warnings": warnings(told),
        "exit": EXIT[verdict],
        "cannot_judge": verdict == UNKNOWN,
    }
    if verdict == UNKNOWN:  # the reason, as every exit 2 gives one
        out["error"] = f"cannot judge: {why}"
    return out


def lines(found: dict[str, Any]) -> list[str]:
    out = [
        f"{PREFIX} {found['guard_version']}",
        f"vLLM:        {found['vllm']}",
        f"platform:    {found['platform']}{'' if found['rocm'] else ' (not ROCm)'}",
        "fixes, read from vLLM's source:",
    ]
    out += [f"  {p['name']}: {p['status']}: {p['detail']} (PR {p['pr']})"
            for p in found["patches"]]  # fmt: skip
    affected = "yes" if found["affected"] else "no"
    out.append(
        f"affected:    {affected} (by reading; `vllm-capture-guard check` runs "
        "the capture)"
    )
    if found["unsupported_because"]:
        out.append(f"supported:   no: {found['unsupported_because']}")
    out.append(f"in-tree fix: {found['in_tree_fix']}")
    out.append(found["guard"])
    out.append(f"environment: {found['environment']}")
    verdict = found["protected"]
    out.append(f"protected:   {verdict} ({found['protected_because']})")
    return out


def main(as_json: bool = False) -> int:
    """``vllm-capture-guard status``: 0 protected or not affected, 1 affected
    and not protected, 2 cannot judge or could not run."""
    from vllm_capture_guard.runtime.plugin import PREFIX
    from vllm_capture_guard.tools.failure import could_not_run, one_line, warn

    try:
        found = facts()
    except Exception as e:
        return could_not_run("status", one_line(e), as_json)
    warn(found["warnings"])
    if as_json:
        print(json.dumps(found, indent=2))
    else:
        print("\n".join(lines(found)))
        if found["cannot_judge"]:  # every exit 2 says why on stderr
            print(f"{PREFIX} status {found['error']}", file=sys.stderr)
    return found["exit"]
