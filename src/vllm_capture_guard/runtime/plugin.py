# SPDX-License-Identifier: Apache-2.0
"""vLLM general plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (front end, engine
core, each worker, the model-inspection subprocess). ``register`` reads the
switches (:mod:`.switch`) and sets post-import hooks (:mod:`.hooks`); it
imports no vLLM attention module and initialises no CUDA/HIP. Each patch
applies the moment vLLM imports the backend module it fixes (at once, if that
is already imported), so a process that never imports a ROCm backend, such as
the API server, pays nothing.

What a patch did is logged once, through vLLM's logger: INFO when it patched
or found nothing to do, one WARNING when it fixed capture without proof that
it had to (fail closed) or could not act. Nothing here ever raises into vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from vllm_capture_guard.runtime import switch

PREFIX = "vllm-capture-guard"


@dataclasses.dataclass
class Report:
    """What the plugin did in this process so far."""

    mode: str
    #: "armed" (waiting for vLLM to import a backend), "patched",
    #: "not needed", "disabled", "skipped" or "failed".
    action: str
    message: str
    outcomes: dict = dataclasses.field(default_factory=dict)
    failures: list = dataclasses.field(default_factory=list)


_report: Report | None = None
_lock = threading.RLock()


def _logger() -> logging.Logger:
    # A child of vLLM's "vllm" logger, so the line gets vLLM's handler/format.
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.capture_guard")
    except Exception:
        return logging.getLogger("vllm.capture_guard")


def platform_name() -> tuple[bool, str]:
    """(is ROCm, name) of vLLM's current platform."""
    from vllm.platforms import current_platform

    # Read the class, not the instance: Platform.__getattr__ warns and imports.
    cls = type(current_platform)
    name = getattr(cls, "device_name", None) or cls.__name__
    return bool(current_platform.is_rocm()), str(name)


def vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return "unknown"


def _summarise(report: Report) -> None:
    from vllm_capture_guard.runtime.patches import Status

    statuses = [o.status for o in report.outcomes.values()]
    if report.failures:
        action = "failed"
    elif Status.PATCHED in statuses or Status.ALREADY in statuses:
        action = "patched"
    elif statuses and all(
        s in (Status.NOT_NEEDED, Status.DISABLED, Status.UNAVAILABLE) for s in statuses
    ):
        action = "not needed"
    else:
        action = "armed"
    report.action = action
    parts = [str(o) for o in report.outcomes.values()] + report.failures
    report.message = f"{action} on vLLM {vllm_version()}: " + "; ".join(parts)


def _on_import(patch, log: logging.Logger):  # noqa: ANN001
    """The hook for one patch: apply, record, log once."""
    from vllm_capture_guard.runtime import hooks
    from vllm_capture_guard.runtime.patches import Status

    def hook(_module) -> None:  # noqa: ANN001
        with _lock:
            if patch.reverted:  # undone on purpose in this process
                return
            try:
                outcome = patch.apply()
            except Exception as e:
                failure = f"{patch.name}: failed ({type(e).__name__}: {e})"
                _report.failures.append(failure)
                _summarise(_report)
                log.warning(
                    "%s: %s; vLLM goes on without this patch. Please report "
                    "this with `vllm-capture-guard status`.",
                    PREFIX,
                    failure,
                )
                return
            seen = patch.name in _report.outcomes
            if seen and outcome.status is not Status.PATCHED and not outcome.warning:
                return  # a later module changed nothing: stay quiet
            _report.outcomes[patch.name] = outcome
            _summarise(_report)
            if outcome.warning:
                log.warning("%s: %s: %s", PREFIX, patch.name, outcome.warning)
            else:
                log.info("%s: %s on vLLM %s", PREFIX, outcome, vllm_version())
            for name in patch.follow():
                hooks.when_imported(name, _on_import(patch, log), _failed(log))

    return hook


def _notify(log: logging.Logger):  # noqa: ANN202
    """What a patch did on its own later (a class defined after its module)."""
    from vllm_capture_guard.runtime.patches import Status

    def notify(outcome) -> None:  # noqa: ANN001
        with _lock:
            if _report is None:
                return
            if outcome.status is Status.FAILED:
                _report.failures.append(str(outcome))
            else:
                _report.outcomes[outcome.patch] = outcome
            _summarise(_report)
        if outcome.status is Status.FAILED or outcome.warning:
            log.warning("%s: %s", PREFIX, outcome.warning or outcome)
        else:
            log.info("%s: %s on vLLM %s", PREFIX, outcome, vllm_version())

    return notify


def _failed(log: logging.Logger):  # noqa: ANN202
    def on_error(module: str, error: BaseException) -> None:
        with _lock:
            failure = f"hook for {module}: {type(error).__name__}: {error}"
            if _report is not None:
                _report.failures.append(failure)
                _summarise(_report)
        log.warning("%s: %s; vLLM goes on.", PREFIX, failure)

    return on_error


def _arm(mode: switch.Mode, log: logging.Logger) -> Report:
    if mode is switch.Mode.OFF:
        return Report(
            mode.value, "disabled", f"{switch.ENV}=off; vLLM's capture is unchanged"
        )
    if mode is switch.Mode.AUTO:
        is_rocm, name = platform_name()
        if not is_rocm:
            return Report(
                mode.value,
                "skipped",
                f"platform is {name}, not ROCm (set {switch.ENV}=on to act anyway)",
            )
    from vllm_capture_guard.runtime import hooks
    from vllm_capture_guard.runtime.patches import PATCHES

    global _report
    _report = Report(mode.value, "armed", "waiting for vLLM to import a backend")
    for patch in PATCHES:
        patch.reverted = False  # armed now: a revert() from before does not count
        patch.notify = _notify(log)
        hooks.when_imported(patch.modules[0], _on_import(patch, log), _failed(log))
    return _report


def register() -> None:
    """Entry point named in ``pyproject.toml``. Never raises."""
    global _report
    with _lock:
        if _report is not None:  # loaded twice in one process: nothing more
            return
        log = _logger()
        try:
            mode, problem = switch.read_mode()
            if problem:
                log.warning("%s: %s", PREFIX, problem)
            report = _arm(mode, log)
            if _report is None:
                _report = report
            if report.action in ("disabled", "skipped"):
                log.info("%s: %s", PREFIX, report.message)
            else:
                log.debug("%s: %s", PREFIX, report.message)
        except Exception as e:
            _report = Report("?", "failed", f"{type(e).__name__}: {e}")
            log.warning(
                "%s: failed (%s: %s); vLLM goes on unpatched.",
                PREFIX,
                type(e).__name__,
                e,
            )


def report() -> Report | None:
    """What the plugin did in this process, or None if it has not run."""
    return _report
