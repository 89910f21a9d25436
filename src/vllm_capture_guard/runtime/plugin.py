# SPDX-License-Identifier: Apache-2.0
"""The vLLM general plugin: :func:`register`, in every process, reads the switches
and sets post-import hooks; each patch applies when vLLM imports what it changes
(and all again before vLLM makes its builders). Nothing here raises into vLLM."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging

from vllm_capture_guard.runtime import hooks, logs, patching, switch
from vllm_capture_guard.runtime.logs import PREFIX

#: The list of patches, imported only once the plugin acts.
PATCHES_MODULE = "vllm_capture_guard.runtime.patches"


@dataclasses.dataclass
class Report:  # what the plugin did in this process so far
    mode: str
    action: str  # armed, patched, incomplete, not needed, disabled, skipped, failed
    message: str
    outcomes: dict = dataclasses.field(default_factory=dict)  # name -> Outcome
    failures: list = dataclasses.field(default_factory=list)


_report: Report | None = None
_lock = patching.LOCK
_warned: set[str] = set()


def platform_name() -> tuple[bool, str]:
    """(is ROCm, name) of vLLM's current platform."""
    from vllm.platforms import current_platform

    cls = type(current_platform)  # the class: Platform.__getattr__ would import
    name = getattr(cls, "device_name", None) or cls.__name__
    return bool(current_platform.is_rocm()), str(name)


def vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except Exception:
        return "unknown"


def _summarise(report: Report) -> None:
    s, found = patching.Status, {o.status for o in report.outcomes.values()}
    if report.failures or s.FAILED in found:
        report.action = "failed"
    elif s.INCOMPLETE in found:
        report.action = "incomplete"
    elif found & {s.PATCHED, s.ALREADY}:
        report.action = "patched"
    elif found and found <= {s.NOT_NEEDED, s.DISABLED}:
        report.action = "not needed"
    parts = [str(o) for o in report.outcomes.values()] + report.failures
    report.message = f"{report.action} on vLLM {vllm_version()}: " + "; ".join(parts)


def _fail(log: logging.Logger, what: str, error: BaseException) -> None:
    failure = f"{what}: failed ({type(error).__name__}: {error})"
    with _lock:
        if _report is not None:
            if failure in _report.failures:
                return  # said once already
            _report.failures.append(failure)
            _summarise(_report)
    log.warning(f"{PREFIX}: {failure}; vLLM goes on without it.")


def apply_all(log: logging.Logger | None = None, when: str = "") -> None:
    """Apply every patch to what vLLM has imported; log what is new."""
    log, s = log or logs.LOG, patching.Status
    for patch in importlib.import_module(PATCHES_MODULE).PATCHES:
        with _lock:
            if patch.reverted or _report is None:
                continue
            try:
                outcome = patch.apply()
            except Exception as e:
                _fail(log, patch.name, e)
                continue
            if outcome.status is s.UNAVAILABLE:
                continue  # nothing imported yet
            old = _report.outcomes.get(patch.name)
            new = old is None or (outcome != old and outcome.status is not s.ALREADY)
            if new:
                _report.outcomes[patch.name] = outcome
                _summarise(_report)
            warn = bool(outcome.warning) and outcome.warning not in _warned
            if warn:
                _warned.add(outcome.warning)
        if warn:  # a new warning is logged, whatever the status
            log.warning(f"{PREFIX}: {patch.name}: {outcome.warning}{when}")
        elif new:
            log.info(f"{PREFIX}: {outcome} on vLLM {vllm_version()}{when}")


def _arm(mode: switch.Mode, log: logging.Logger) -> Report:
    if mode is switch.Mode.OFF:
        return Report("off", "disabled", f"{switch.ENV}=off; vLLM is unchanged")
    if mode is switch.Mode.AUTO:
        is_rocm, name = platform_name()
        if not is_rocm:
            why = f"platform is {name}, not ROCm (set {switch.ENV}=on to act anyway)"
            return Report("auto", "skipped", why)
    patches = importlib.import_module(PATCHES_MODULE)
    for problem in patches.switch_problems():
        log.warning(f"{PREFIX}: {problem}")
    global _report
    _report = Report(mode.value, "armed", "waiting for vLLM to import what it fixes")
    for patch in patches.PATCHES:
        patch.reverted = False  # armed now: a revert() from before does not count

    def apply_on_import(_module: object) -> None:
        apply_all(log)

    def on_error(name: str, error: BaseException) -> None:
        _fail(log, f"hook for {name}", error)

    for name in sorted({m for p in patches.PATCHES for m in p.modules}):
        hooks.when_imported(name, apply_on_import, on_error)
    return _report


def register() -> None:
    """Entry point named in ``pyproject.toml``. Never raises."""
    global _report
    with _lock:
        if _report is not None:  # loaded twice in one process: nothing more
            return
        log = logs.LOG
        try:
            mode, problem = switch.read_mode()
            if problem:
                log.warning(f"{PREFIX}: {problem}")
            report = _arm(mode, log)
            _report = _report or report
            if report.action in ("disabled", "skipped"):
                log.info(f"{PREFIX}: {report.message}")
        except Exception as e:
            _report = Report("?", "failed", f"{type(e).__name__}: {e}")
            why = _report.message
            log.warning(f"{PREFIX}: failed ({why}); vLLM goes on unpatched.")


def report() -> Report | None:
    """What the plugin did in this process, or None if it has not run."""
    return _report
