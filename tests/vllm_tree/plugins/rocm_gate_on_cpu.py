# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (``-p rocm_gate_on_cpu``): run vLLM's ROCm-gated capture test
from vLLM's own ``tests/`` tree on a CPU host, changing as little as possible.

It does three things only:

* where vLLM detects no platform at all (no GPU, and a vLLM that is not a CPU
  build), it sets vLLM's own ``CpuPlatform`` as the current platform before
  vLLM's ``conftest.py`` is loaded, so that ``DeviceConfig()`` resolves (0.28
  and later do the same for ``VLLM_TARGET_DEVICE=cpu``; 0.27.1 has no such
  switch);
* while pytest imports the file named by ``CAPTURE_GUARD_GATED_TEST`` (and
  nothing else), ``current_platform.is_rocm()`` answers True, so that its
  ``skipif(not current_platform.is_rocm())`` gate lets it run. Every module the
  file imports is imported first, with the platform answering honestly, and
  the answer is put back once the file is collected: the tests themselves run
  on the CPU platform, unchanged;
* whenever vLLM imports ``vllm.platforms.rocm``, which asks the GPU for its
  architecture at import (vLLM 0.33's AITER unified backend imports it), that
  one query is answered with an MI300X's (gfx942) while the module executes,
  then torch is put back; the metadata builders never read it. Releases whose
  test run never imports the module get no answer.

Test-only; never part of the package.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

import pytest

GATED = "CAPTURE_GUARD_GATED_TEST"
ARCH = "gfx942:sramecc+:xnack-"


class _AnswerArchQuery(importlib.abc.MetaPathFinder):
    """Executes ``vllm.platforms.rocm`` with the architecture query answered."""

    answered: list[str] = []

    def find_spec(self, fullname, path, target=None):
        if fullname != "vllm.platforms.rocm":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            import torch

            real = torch.cuda.get_device_properties

            def answer(*args, **kwargs):
                self.answered.append(ARCH)
                return types.SimpleNamespace(gcnArchName=ARCH)

            torch.cuda.get_device_properties = answer
            try:
                real_exec(module)
            finally:
                torch.cuda.get_device_properties = real

        spec.loader.exec_module = exec_module
        return spec


def _imports_of(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
    return found


def _cpu_platform() -> str:
    import vllm.platforms as platforms

    if platforms.current_platform.device_type:
        return type(platforms.current_platform).__name__ + " (detected)"
    from vllm.platforms.cpu import CpuPlatform

    platforms.current_platform = CpuPlatform()
    return "CpuPlatform (set: none detected)"


_FINDER = _AnswerArchQuery()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config):
    import torch

    early_config._rocm_gate_notes = [f"platform {_cpu_platform()}"]
    if not torch.cuda.is_available():
        sys.meta_path.insert(0, _FINDER)


def pytest_terminal_summary(terminalreporter, config):
    notes = list(getattr(config, "_rocm_gate_notes", []))
    if _FINDER.answered:
        notes.append(
            f"the GPU architecture query of vllm.platforms.rocm answered ({ARCH})"
        )
    for note in notes:
        terminalreporter.write_line(f"rocm_gate_on_cpu: {note}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    gated = os.environ.get(GATED)
    path = getattr(collector, "path", None)
    if not gated or not isinstance(collector, pytest.Module) or path is None:
        yield
        return
    if path.name != Path(gated).name:
        yield
        return
    for name in _imports_of(path):
        importlib.import_module(name)
    from vllm.platforms import current_platform

    assert not current_platform.is_rocm(), "a ROCm host needs no gate answer"
    current_platform.is_rocm = lambda: True
    try:
        yield
    finally:
        del current_platform.is_rocm
