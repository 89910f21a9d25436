# SPDX-License-Identifier: Apache-2.0
"""Which vLLM tree to patch.

``--tree PATH`` names a vLLM source checkout (a folder holding ``vllm/``) or a
``vllm`` package folder (e.g. ``site-packages/vllm``). Without it, the vLLM
that this Python would import, found with ``importlib.util.find_spec("vllm")``:
for a top-level package that only searches ``sys.path`` and executes nothing
(``vllm/__init__.py`` is not run; a test checks ``sys.modules``).

Diff paths are relative to the folder that holds the package, so they read
``vllm/v1/...`` for a checkout and for ``site-packages`` alike.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

#: A folder is a vLLM package if it holds this.
PROBE = Path("v1") / "attention" / "backends"


class TreeError(Exception):
    """The tree cannot be found or used; nothing was written."""


@dataclasses.dataclass(frozen=True)
class Tree:
    root: Path  # the folder that holds the package: diff paths are relative to it
    package: Path  # the vllm package folder

    def path(self, inside: str) -> Path:
        return self.package / inside

    def rel(self, inside: str) -> str:
        return (self.path(inside).relative_to(self.root)).as_posix()

    def describe(self) -> str:
        return f"{self.root} (package {self.package.name}/)"


def _is_package(folder: Path) -> bool:
    return (folder / PROBE).is_dir()


def find_tree(arg: str | os.PathLike | None = None) -> Tree:
    if arg is None:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError) as e:
            raise TreeError(f"cannot look up vllm: {e}") from e
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            if _is_package(Path(location)):
                package = Path(location)
                return Tree(package.parent, package)
        raise TreeError(
            "this Python imports no vLLM package with v1/attention/backends; "
            "name the tree with --tree PATH"
        )
    given = Path(os.path.abspath(arg))  # as named: symlinks are not resolved
    if _is_package(given / "vllm"):
        return Tree(given, given / "vllm")
    if _is_package(given) and (given / "__init__.py").is_file():
        return Tree(given.parent, given)
    raise TreeError(
        f"{arg}: neither a vLLM source checkout (a folder holding vllm/) nor a "
        f"vllm package folder (holding {PROBE.as_posix()}/)"
    )
