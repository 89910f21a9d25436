# SPDX-License-Identifier: Apache-2.0
"""The guard's state as one story, and loading it the way a vLLM worker does.

:func:`story` is the one place that says whether the guard is loaded by
vLLM's plugin loader (and if not, why), its mode, and whether on this host it
acts or only simulates the ROCm path (and why). ``status``, ``check`` and
``audit`` all print its :meth:`Story.line`, so they cannot contradict each
other.

Every tool that judges vLLM's capture (``check``, ``audit``, the oracle's
``record``, the version matrix) loads the plugins through vLLM's own loader
(:func:`load_plugins_as_worker`), so ``VLLM_CAPTURE_GUARD`` and
``VLLM_PLUGINS`` decide exactly as in ``vllm serve``. The switch is read by
:mod:`vllm_capture_guard.runtime.switch` only; ``auto`` counts as ``on`` in
the tools, because they judge the ROCm code path on any host, and the line
says so.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from vllm_capture_guard.runtime import switch

PLUGINS_ENV = "VLLM_PLUGINS"
#: Our name in ``vllm.general_plugins`` (``pyproject.toml``).
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "capture_guard"


def loaded_by_vllm(environ: Mapping[str, str] | None = None) -> bool:
    """Would vLLM's plugin loader load us, as far as ``VLLM_PLUGINS`` goes?

    vLLM reads the variable as ``value.split(",")`` and compares names exactly,
    so ``"foo, capture_guard"`` does *not* load us, and ``""`` loads nothing."""
    env = os.environ if environ is None else environ
    raw = env.get(PLUGINS_ENV)
    if raw is None:
        return True
    return ENTRY_POINT_NAME in raw.split(",")


def inspect(patch: Any) -> Any:
    """What ``patch`` would do: import its main module, then decide (never
    installs anything)."""
    import importlib

    from vllm_capture_guard.runtime.patching import LOCK, Outcome, Status

    try:
        importlib.import_module(patch.modules[0])
    except Exception as e:
        why = f"cannot import {patch.modules[0]}: {type(e).__name__}: {e}"
        return Outcome(patch.name, Status.UNAVAILABLE, why[:300])
    with LOCK:
        return patch.decide()


def entry_point() -> Any:
    """Our ``vllm.general_plugins`` entry point, or None if not installed."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == ENTRY_POINT_NAME:
            return ep
    return None


def not_loaded_reasons(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Why vLLM's plugin loader would not load the guard (empty: it would)."""
    env = os.environ if environ is None else environ
    name = ENTRY_POINT_NAME
    reasons = []
    if entry_point() is None:
        reasons.append(
            f"no '{name}' entry point in {ENTRY_POINT_GROUP} "
            "(the package is not installed in this Python)"
        )
    if not loaded_by_vllm(env):
        shown = repr(env.get(PLUGINS_ENV, ""))
        reasons.append(f"{PLUGINS_ENV}={shown} does not list '{name}'")
    return reasons


@dataclasses.dataclass
class Story:
    """The guard on this host, in one place."""

    loaded: bool  # vLLM's loader loads it (in a tool: did load it)
    not_loaded_because: list[str]
    mode: str  # the mode as the operator set it (auto, on, off)
    mode_problem: str | None
    rocm: bool
    platform: str
    acts: bool  # vLLM processes on this host would patch capture
    why: str  # why it acts or not, in words
    #: Set by the tools that judge capture: the command's name, whether it
    #: simulates the ROCm path on a host that is not ROCm, and what the
    #: plugin did in this process (its ``Report.action``, None: not loaded).
    judged_by: str | None = None
    simulated: bool = False
    action: str | None = None

    def line(self) -> str:
        """``guard: ...``, the same words in every command."""
        if self.loaded:
            parts = ["loaded by vLLM's plugin loader"]
        else:
            parts = ["NOT loaded: " + "; ".join(self.not_loaded_because)]
        parts.append(f"{switch.ENV}={self.mode}")
        parts.append(self.why)
        text = "guard: " + "; ".join(parts)
        if self.judged_by is None:
            return text
        if self.simulated:
            auto = self.mode == "auto" and self.loaded
            forced = " (auto counts as on)" if auto else ""
            text += f"; {self.judged_by} SIMULATES the ROCm path here{forced}"
        if not self.loaded:
            return text + ": guard absent, vLLM's capture as shipped"
        return text + f": {self.action}"


def _host(mode: switch.Mode, rocm: bool, platform: str) -> tuple[bool, str]:
    if mode is switch.Mode.OFF:
        return False, "does nothing (off)"
    if rocm:
        return True, f"acts on this host (platform {platform}, ROCm)"
    if mode is switch.Mode.AUTO:
        return False, (
            f"does not act on this host (platform {platform}, not ROCm; auto "
            "acts on ROCm only)"
        )
    return True, (
        f"acts on any platform (on); this host (platform {platform}) is not "
        "ROCm, so vLLM here never runs the ROCm builders"
    )


def story(environ: MutableMapping[str, str] | None = None) -> Story:
    """The guard as ``vllm serve`` on this host would have it."""
    from vllm_capture_guard.runtime.plugin import platform_name

    env = os.environ if environ is None else environ
    mode, problem = switch.read_mode(env)
    rocm, platform = platform_name()
    reasons = not_loaded_reasons(env)
    acts, why = _host(mode, rocm, platform)
    return Story(
        loaded=not reasons,
        not_loaded_because=reasons,
        mode=mode.value,
        mode_problem=problem,
        rocm=rocm,
        platform=platform,
        acts=acts and not reasons,
        why=why,
    )


def judge_rocm_path(environ: MutableMapping[str, str] | None = None) -> str:
    """Read the switch; under ``auto`` set it to ``on``. Returns the mode as
    the tools print it (a bad value is one of :func:`warnings`)."""
    env = os.environ if environ is None else environ
    mode, _problem = switch.read_mode(env)
    if mode is switch.Mode.AUTO:
        env[switch.ENV] = switch.Mode.ON.value
        return "auto (counts as on: judges the ROCm path)"
    return mode.value


def load_plugins_as_worker(command: str | None = None) -> Story:
    """:func:`story` as this host has it, then :func:`judge_rocm_path` and
    ``vllm.plugins.load_general_plugins()``; the story says what the plugin
    did. The backend modules are patched when they are imported afterwards,
    so :attr:`Story.action` is refreshed by :func:`finish`."""
    told = story()
    judge_rocm_path()
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    told.judged_by = command or "this run"
    told.simulated = not told.rocm and told.mode != switch.Mode.OFF.value
    return finish(told)


def finish(told: Story) -> Story:
    """Fill in what the plugin did in this process so far."""
    from vllm_capture_guard.runtime.plugin import report

    done = report()
    if done is None:
        told.loaded = False
        if not told.not_loaded_because:
            told.not_loaded_because = ["vLLM's plugin loader did not call it"]
        told.action = None
    else:
        told.loaded = True
        told.action = done.action
    return told


def warnings(told: Story | None = None) -> list[str]:
    """What the operator must be told, each once: a bad ``VLLM_CAPTURE_GUARD``
    value, ``VLLM_CAPTURE_GUARD_DISABLE`` names that are no patch or a patch's
    former name (the plugin logs these only where it acts, and the tools keep
    vLLM's log quiet), and the plugin's own warnings and failures in this
    process."""
    from vllm_capture_guard.runtime.patches import switch_problems
    from vllm_capture_guard.runtime.plugin import report

    found = [told.mode_problem if told else switch.read_mode()[1]]
    found += switch_problems()
    done = report()
    if done is not None:
        found += [
            f"{o.patch}: {o.warning}"
            for o in done.outcomes.values()
            if getattr(o, "warning", None)
        ]
        found += list(done.failures)
    return list(dict.fromkeys(w for w in found if w))
