# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard audit``: exit 0 if no backend's capture writes shared
CPU metadata, 1 if one does, 2 if the audit could not run."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def use_version_cache() -> str | None:
    """Give this process a vLLM cache directory of its own per vLLM version,
    unless ``VLLM_CACHE_ROOT`` is set. vLLM caches the model-class inspection
    that a ``ModelConfig`` needs (a subprocess that imports vLLM again, the
    slowest step of an audit) in one file per class, whatever the version, so
    auditing two versions in turn would redo it on every run. Call before
    importing vLLM; returns the directory chosen."""
    from importlib.metadata import version

    if os.environ.get("VLLM_CACHE_ROOT"):
        return None
    try:
        ver = version("vllm")
    except Exception:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    root = str(Path(base) / "vllm-capture-guard" / f"vllm-{ver}")
    os.environ["VLLM_CACHE_ROOT"] = root
    return root


def unknown_backends(names: Sequence[str]) -> str | None:
    """Why some of ``names`` (``--backend``, matched without regard to case)
    name no registered backend, with the valid names; None if all do."""
    from vllm_capture_guard.tools.audit.registry import registered_backends

    valid = sorted({e.name for e in registered_backends()})
    known = {n.upper() for n in valid}
    unknown = [n for n in names if n.upper() not in known]
    if not unknown:
        return None
    return (
        f"unknown --backend {', '.join(repr(n) for n in unknown)}; valid names: "
        f"{', '.join(valid)}"
    )


def main(as_json: bool = False, backends: Sequence[str] | None = None) -> int:
    """Every registered backend's capture, as this install's vLLM processes
    would run it: the guard is loaded through vLLM's plugin loader, following
    VLLM_CAPTURE_GUARD and VLLM_PLUGINS as ``check`` does."""
    from vllm_capture_guard.tools.failure import could_not_run, one_line, vllm_problem

    if as_json:  # keep stdout for the JSON: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    use_version_cache()  # before vLLM is imported
    try:
        from vllm_capture_guard.tools.simulate import use_triton_interpreter

        use_triton_interpreter()  # likewise
    except ImportError:  # no torch: said below
        pass
    broken = vllm_problem()
    if broken:
        return could_not_run("audit", broken, as_json)
    try:
        from vllm_capture_guard.tools.guard import load_plugins_as_worker
        from vllm_capture_guard.tools.harness import error_text
    except Exception as e:  # torch or numpy missing
        return could_not_run("audit", one_line(e), as_json)
    from vllm_capture_guard.tools import support

    outside = support.problem()
    if outside:
        return could_not_run("audit", outside, as_json)
    try:
        unknown = unknown_backends(backends or [])
    except Exception as e:
        return could_not_run("audit", error_text(e), as_json)
    if unknown:
        return could_not_run("audit", unknown, as_json)
    try:
        from vllm_capture_guard.tools.audit.run import run_audit
        from vllm_capture_guard.tools.guard import finish, warnings
        from vllm_capture_guard.tools.harness import make_vllm_config

        told = load_plugins_as_worker("audit")
    except Exception as e:
        return could_not_run("audit", error_text(e), as_json)
    try:
        make_vllm_config(0)
    except Exception as e:
        return could_not_run("audit", support.cannot_set_up(str(e)), as_json)
    try:
        result = run_audit(backends, guard_mode=told.mode)
        result.guard_line = finish(told).line()
        result.guard_warnings = warnings(told)
    except Exception as e:
        return could_not_run("audit", error_text(e), as_json)
    from vllm_capture_guard.runtime.plugin import PREFIX
    from vllm_capture_guard.tools.audit.render import no_verdict
    from vllm_capture_guard.tools.failure import CANNOT_JUDGE, warn

    warn(result.guard_warnings)
    why = no_verdict(result)
    code = 1 if result.cpu_writers else 0
    if why:  # no capture ran: no verdict either way
        code = CANNOT_JUDGE
    if as_json:
        from vllm_capture_guard.tools.audit.schema import to_json

        out = to_json(result)
        out["exit"] = code
        out["cannot_judge"] = code == CANNOT_JUDGE
        if why:
            out["error"] = f"cannot judge: {why}"
        print(json.dumps(out, indent=2))
    else:
        from vllm_capture_guard.tools.audit.render import print_report

        print_report(result)
    if why:
        print(f"{PREFIX} audit cannot judge: {why}", file=sys.stderr)
    return code
