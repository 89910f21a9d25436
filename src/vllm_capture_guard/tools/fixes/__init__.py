# SPDX-License-Identifier: Apache-2.0
"""What the tools know of each runtime patch beyond what the runtime loads: one
module per patch, named after it (``builder-capture-guard`` is
:mod:`.builder_capture_guard`), found through the list of patches. Each holds

* one reader per fix site, ``read_source()`` (the capture stream's is
  ``passes_stream()``, one call at a time): ``readings()`` hands it the
  imported code's source and words what it found as one
  :class:`.static.Reading` per site, for ``status``; ``tree_findings()``
  hands it the file's bytes, for ``patch``;
* ``CONSEQUENCE``: what a needed fix prevents, in the words of its failure;
* ``undo()``: put back what the patch installed (tests and tools; ``vllm
  serve`` never does); :func:`.revert.revert` calls it;
* ``TREE_FILES`` and ``tree_findings(sources, broken, tree, context)``: its
  in-tree form, for ``vllm-capture-guard patch`` (empty and ``[]`` for none);
* ``judgements(checked)`` and ``fails_as(judgement)``: ``check``'s checks of
  it and the verdict's words for a failure (``[]``: ``check`` has none).
  Every module has them: :func:`.verdict.judge` calls each.

The patch itself declares its name, PR, the vLLM modules it applies on, its
attention backends and its target classes (:class:`.patching.Patch`)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def all_patches() -> tuple[Any, ...]:
    """The runtime's patches, in the order they apply."""
    from vllm_capture_guard.runtime.patches import PATCHES

    return PATCHES


def by_name(name: str) -> Any:
    """The runtime patch called ``name`` (KeyError: no such patch)."""
    return {p.name: p for p in all_patches()}[name]


def former_names() -> dict[str, str]:
    """Each former patch name, and the patch's name now (in the JSON of
    ``status`` and ``check``: monitoring may match either)."""
    return {old: p.name for p in all_patches() for old in p.former_names}


def module_of(patch: Any) -> ModuleType:
    """The tools module of ``patch``: :mod:`.<its name, with underscores>`."""
    return importlib.import_module(f"{__name__}.{patch.name.replace('-', '_')}")


def modules() -> list[ModuleType]:
    """Every patch's tools module, in the runtime's order."""
    return [module_of(p) for p in all_patches()]


def backends(patch: Any) -> tuple[str, ...]:
    """The attention backends whose capture ``patch`` fixes (``()``: none)."""
    return patch.backends


def targets(patch: Any) -> tuple[tuple[str, str], ...]:
    """The ``(module, class)`` pairs ``patch`` may change."""
    return patch.targets
