# SPDX-License-Identifier: Apache-2.0
"""vLLM general plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` once in every process it starts (front end, engine
core, each worker, the model-inspection subprocess) before any CUDA graph is
captured. It decides, applies the patches that this vLLM needs, and logs one
INFO line through vLLM's logger. It never raises: a failure becomes one
WARNING, and the patch concerned leaves vLLM as it was.

``VLLM_CAPTURE_GUARD`` switches it:

``auto`` (default)
    act on a ROCm platform only; elsewhere import no ROCm module at all.
``on``
    act on any platform (CPU tests, ``vllm-capture-guard check``).
``off``
    do nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os

ENV = "VLLM_CAPTURE_GUARD"
MODES = ("auto", "on", "off")
DEFAULT_MODE = "auto"
PREFIX = "vllm-capture-guard"


@dataclasses.dataclass
class Report:
    """What :func:`register` did in this process."""

    mode: str
    action: str  # "patched" | "not needed" | "disabled" | "skipped" | "failed"
    message: str
    outcomes: list = dataclasses.field(default_factory=list)
    failures: list = dataclasses.field(default_factory=list)


_report: Report | None = None


def _logger() -> logging.Logger:
    # A child of vLLM's "vllm" logger, so the line gets vLLM's handler/format.
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.capture_guard")
    except Exception:
        return logging.getLogger("vllm.capture_guard")


def read_mode(environ: dict | None = None) -> tuple[str, str | None]:
    """``(mode, problem)``: an invalid value falls back to ``auto`` and
    ``problem`` says so, naming the allowed values."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_MODE, None
    value = raw.strip().lower()
    if value in MODES:
        return value, None
    return DEFAULT_MODE, (
        f"{ENV}={raw!r} is not one of {', '.join(MODES)}; using {DEFAULT_MODE!r}"
    )


def _platform_name() -> tuple[bool, str]:
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


def decide_and_apply(mode: str) -> Report:
    """The plugin's work, without logging. Raises only on programming errors
    outside the patches; each patch's own failure is caught and recorded."""
    if mode == "off":
        return Report(mode, "disabled", f"{ENV}=off; vLLM's capture is unchanged")
    if mode == "auto":
        is_rocm, name = _platform_name()
        if not is_rocm:
            return Report(
                mode,
                "skipped",
                f"platform is {name}, not ROCm (set {ENV}=on to act anyway)",
            )
    from vllm_capture_guard.runtime.patches import PATCHED
    from vllm_capture_guard.runtime.patches.registry import PATCHES

    outcomes, failures = [], []
    for patch in PATCHES:
        try:
            outcomes.append(patch.apply())
        except Exception as e:  # the patch installs nothing unless it succeeds
            failures.append(f"{patch.NAME}: {type(e).__name__}: {e}")
    version = vllm_version()
    applied = [o for o in outcomes if o.status == PATCHED]
    parts = "; ".join(str(o) for o in outcomes)
    if applied:
        action = "patched"
    elif failures and not outcomes:
        action = "failed"
    else:
        action = "not needed"
    message = f"{action} on vLLM {version}: {parts}" if parts else action
    return Report(mode, action, message, outcomes, failures)


def register() -> None:
    """Entry point named in ``pyproject.toml``. Never raises."""
    global _report
    if _report is not None:  # loaded twice in one process: nothing more to do
        return
    log = _logger()
    try:
        mode, problem = read_mode()
        if problem:
            log.warning("%s: %s", PREFIX, problem)
        _report = decide_and_apply(mode)
        if _report.failures:
            log.warning(
                "%s: could not check or patch %s; vLLM goes on without that "
                "patch. Please report this with `vllm-capture-guard status`.",
                PREFIX,
                " | ".join(_report.failures),
            )
        log.info("%s: %s", PREFIX, _report.message)
    except Exception as e:
        _report = Report("?", "failed", f"{type(e).__name__}: {e}")
        log.warning(
            "%s: failed (%s: %s); vLLM goes on unpatched.",
            PREFIX,
            type(e).__name__,
            e,
        )


def report() -> Report | None:
    """What :func:`register` did in this process, or None if it has not run."""
    return _report
