# SPDX-License-Identifier: Apache-2.0
"""vLLM general plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts. It reads the switches
and sets post-import hooks; it imports no vLLM attention module and
initialises no CUDA/HIP. Then every patch applies

* the moment vLLM imports a module it fixes (a process that never imports a
  ROCm backend, such as the API server, pays nothing), and
* again right before capture, in the model runner's
  ``profile_cudagraph_memory`` and ``capture_model`` (V1's and Model Runner
  V2's): classes defined, methods put back and modules reloaded since the
  import are guarded before the first graph.

What a patch did is logged once, and again only when it changes: INFO, or a
WARNING when it fixed code it could not read as fixed, or could not act.
Nothing here ever raises into vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from types import ModuleType

from vllm_capture_guard.runtime import hooks, switch

PREFIX = "vllm-capture-guard"
#: Where vLLM captures: V1's model runner and Model Runner V2's.
ENTRIES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
#: The runner methods that capture: V1 profiles the graphs' memory by
#: capturing them, before ``capture_model``.
RUNNER, CAPTURES = "GPUModelRunner", ("profile_cudagraph_memory", "capture_model")


@dataclasses.dataclass
class Report:
    """What the plugin did in this process so far."""

    mode: str
    action: str  # armed, patched, not needed, disabled, skipped or failed
    message: str
    outcomes: dict = dataclasses.field(default_factory=dict)  # name -> Outcome
    failures: list = dataclasses.field(default_factory=list)
    entries: list = dataclasses.field(default_factory=list)  # guarded runners


_report: Report | None = None
_lock = threading.RLock()


def _patches():  # noqa: ANN202
    """The patches, imported only once the plugin acts."""
    from vllm_capture_guard.runtime import patches

    return patches


def _logger() -> logging.Logger:
    try:  # a child of vLLM's logger: vLLM's handler and format
        from vllm.logger import init_logger

        return init_logger("vllm.capture_guard")
    except Exception:
        return logging.getLogger("vllm.capture_guard")


def platform_name() -> tuple[bool, str]:
    """(is ROCm, name) of vLLM's current platform."""
    from vllm.platforms import current_platform

    cls = type(current_platform)  # the class: Platform.__getattr__ would import
    return bool(current_platform.is_rocm()), str(
        getattr(cls, "device_name", None) or cls.__name__
    )


def vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return "unknown"


def _summarise(report: Report) -> None:
    s = _patches().Status
    found = {o.status for o in report.outcomes.values()}
    if report.failures:
        report.action = "failed"
    elif found & {s.PATCHED, s.ALREADY}:
        report.action = "patched"
    elif found and found <= {s.NOT_NEEDED, s.DISABLED}:
        report.action = "not needed"
    parts = [str(o) for o in report.outcomes.values()] + report.failures
    report.message = f"{report.action} on vLLM {vllm_version()}: " + "; ".join(parts)


def _fail(log: logging.Logger, what: str, error: BaseException) -> None:
    failure = f"{what}: failed ({type(error).__name__}: {error})"
    with _lock:
        if _report is not None and failure in _report.failures:
            return  # said once already
        if _report is not None:
            _report.failures.append(failure)
            _summarise(_report)
    log.warning(f"{PREFIX}: {failure}; vLLM goes on without it.")


def apply_all(log: logging.Logger | None = None, when: str = "") -> None:
    """Apply every patch to what vLLM has imported; log what changed."""
    log, s = log or _logger(), _patches().Status
    for patch in _patches().PATCHES:
        with _lock:
            if patch.reverted or _report is None:
                continue
            try:
                outcome = patch.apply()
            except Exception as e:
                _fail(log, patch.name, e)
                continue
            before = _report.outcomes.get(patch.name)
            if outcome.status is s.UNAVAILABLE or (
                before is not None
                and (outcome.status is s.ALREADY or outcome == before)
            ):
                continue  # nothing imported yet, or nothing new
            _report.outcomes[patch.name] = outcome
            _summarise(_report)
        if outcome.warning:
            log.warning(f"{PREFIX}: {patch.name}: {outcome.warning}{when}")
        else:
            log.info(f"{PREFIX}: {outcome} on vLLM {vllm_version()}{when}")


def _rechecking(capture_model):  # noqa: ANN001, ANN202
    def capture_model_(self, *args, **kwargs):
        try:
            apply_all(when=" (checked again before capture)")
        except Exception as e:  # never stop vLLM's capture
            _fail(_logger(), "check before capture", e)
        return capture_model(self, *args, **kwargs)

    return capture_model_


def _guard_entry(log: logging.Logger):  # noqa: ANN202
    def hook(module: ModuleType) -> None:
        cls, patches = getattr(module, RUNNER, None), _patches()
        found = [n for n in CAPTURES if callable(getattr(cls, n, None))]
        with _lock:
            if "capture_model" not in found:
                log.warning(
                    f"{PREFIX}: {module.__name__} has no {RUNNER}.capture_model; "
                    "the guard set at import stands, but is not checked before "
                    "capture"
                )
            for name in found:
                if not patches.is_guarded(cls.__dict__.get(name)):
                    patches.wrap_method(cls, name, _rechecking)
            if found and _report is not None:
                _report.entries.append(module.__name__)

    return hook


def _arm(mode: switch.Mode, log: logging.Logger) -> Report:
    if mode is switch.Mode.OFF:
        return Report("off", "disabled", f"{switch.ENV}=off; vLLM is unchanged")
    if mode is switch.Mode.AUTO:
        is_rocm, name = platform_name()
        if not is_rocm:
            why = f"platform is {name}, not ROCm (set {switch.ENV}=on to act anyway)"
            return Report("auto", "skipped", why)
    patches = _patches()
    unknown = ", ".join(sorted(switch.disabled_patches() - patches.NAMES))
    if unknown:
        known = ", ".join(sorted(patches.NAMES))
        log.warning(
            f"{PREFIX}: {switch.DISABLE_ENV} names no patch: {unknown} "
            f"(the patches are {known})"
        )
    global _report
    _report = Report(mode.value, "armed", "waiting for vLLM to import a backend")
    for patch in patches.PATCHES:
        patch.reverted = False  # armed now: a revert() from before does not count
    on_error = lambda name, e: _fail(log, f"hook for {name}", e)  # noqa: E731
    for name in dict.fromkeys(m for p in patches.PATCHES for m in p.modules):
        hooks.when_imported(name, lambda _m: apply_all(log), on_error)
    for name in ENTRIES:
        hooks.when_imported(name, _guard_entry(log), on_error)
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
                log.warning(f"{PREFIX}: {problem}")
            report = _arm(mode, log)
            _report = _report or report
            if report.action in ("disabled", "skipped"):
                log.info(f"{PREFIX}: {report.message}")
        except Exception as e:
            _report = Report("?", "failed", f"{type(e).__name__}: {e}")
            log.warning(
                f"{PREFIX}: failed ({_report.message}); vLLM goes on unpatched."
            )


def report() -> Report | None:
    """What the plugin did in this process, or None if it has not run."""
    return _report
