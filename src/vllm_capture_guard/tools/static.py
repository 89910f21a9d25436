# SPDX-License-Identifier: Apache-2.0
"""What ``status`` needs to read vLLM's imported code: a :class:`Reading` per
fix site, the import as ``check`` does it on a host without a GPU, and the
source of an imported module for the fix's one reader. Each fix's reader is
in its module of :mod:`.fixes`: ``status`` hands it the source of the module
this process imported (:func:`imported_source`), ``patch --check`` the file's
bytes in the tree it is given. The tools' view, never the runtime's (the
runtime guards every call).

Read before the plugin patches this process (``status`` does): a patched
backend returns the backport's builder, which reads as fixed.

Reading can say "needs the fix"; where it says "fixed", the runtime still
guards (a write through an alias, a capture bound per instance, a stream that
is ``None`` at run time all read as fixed).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
from pathlib import Path
from typing import Any

from vllm_capture_guard.tools.failure import one_line
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.source import Source, Unrecognised

METHOD = "build_for_cudagraph_capture"


@dataclasses.dataclass(frozen=True)
class Reading:
    where: str
    needed: bool | None  # None: could not be read, or not importable here
    why: str
    #: False: the module does not import on this host (a dependency of vLLM
    #: missing here), so nothing was read
    importable: bool = True


def import_to_read(module: str) -> Any:
    """The module, imported as ``check`` and the audit import it on a host
    without a GPU (0.33's AITER module asks the GPU's architecture at import:
    an MI300X's is answered, :func:`.simulate.rocm_platform_answered`); or
    why it does not import here."""
    from vllm_capture_guard.tools.simulate import rocm_platform_answered

    try:
        with rocm_platform_answered():
            return importlib.import_module(module)
    except Exception as e:  # a dependency of vLLM that is missing here
        return f"cannot import {module} ({one_line(e)[:160]})"


@dataclasses.dataclass(frozen=True)
class Imported:
    """The source of a module as this process imported it, or why there is none."""

    module: Any  # the module, or None
    source: Source | None
    why: str = ""
    #: False: the module does not import on this host
    importable: bool = True

    def unread(self, where: str) -> Reading:
        return Reading(where, None, self.why, importable=self.importable)


def imported_source(name: str, rel: str) -> Imported:
    """Module ``name`` as imported here, and its source as the fix's reader
    takes it (named ``rel``, the file inside the ``vllm`` package)."""
    module = import_to_read(name)
    if isinstance(module, str):
        return Imported(None, None, module, importable=False)
    try:
        text = inspect.getsource(module)
        source = Source.parse(Path(module.__file__ or rel), rel, text.encode())
    except (OSError, TypeError) as e:
        return Imported(module, None, f"{name}'s source unreadable ({e})")
    except Unrecognised as e:
        return Imported(module, None, str(e))
    return Imported(module, source)


def runs_as_read(source: Source, fn: object, qualname: str) -> bool:
    """Is ``fn`` (a function this process runs) compiled from ``source``? Not
    where the file changed after import (an in-tree patch applied under a
    running process): then reading it says nothing of what runs."""
    code = getattr(inspect.unwrap(fn), "__code__", None)  # type: ignore[arg-type]
    if not isinstance(code, types.CodeType):
        return False
    try:
        compiled = compile(source.data, str(source.path), "exec")
    except (SyntaxError, ValueError):
        return False
    todo = [compiled]
    while todo:
        found = todo.pop()
        if found.co_qualname == qualname:
            return found.co_code == code.co_code and found.co_names == code.co_names
        todo += [c for c in found.co_consts if isinstance(c, types.CodeType)]
    return False


def changed_since_import(where: str, qualname: str, rel: str) -> Reading:
    """In doubt: :func:`runs_as_read` says ``qualname`` is not what ``rel`` says."""
    why = f"{qualname} does not run what {rel} now says (changed since import?)"
    return Reading(where, None, why)


def tree_reading(
    where: str, finding: model.Finding, needed: str, fixed: str
) -> Reading:
    """A fix site as its reader found it, in ``status``'s words: ``needed``,
    ``fixed`` (upstream's fix, or ours in the tree), or in doubt, with why."""
    if finding.state == model.NEEDED:
        return Reading(where, True, needed)
    if finding.state == model.APPLIED:
        return Reading(where, False, f"{fixed} (the in-tree fix)")
    if finding.state in (model.UPSTREAM, model.ABSENT):
        return Reading(where, False, fixed)
    return Reading(where, None, f"cannot tell by reading ({finding.detail})")
