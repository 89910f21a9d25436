# SPDX-License-Identifier: Apache-2.0
"""What ``status`` needs to read vLLM's imported code with each fix's one
reader (``read_source()`` in its module of :mod:`.fixes`, the reader that
``patch --check`` hands a file's bytes):

* :func:`imported_source`: an imported module's source, as :class:`Imported`
  (the import done as ``check`` does it on a host without a GPU);
* :func:`not_as_read`: why that source might not be the code that runs (a
  decorated function, a file changed since import);
* :func:`reading_of`: what the reader found (a ``tree.model.Finding``, in
  ``patch``'s words) as one :class:`Reading`, one fix site in ``status``'s
  words: needed, not needed, or in doubt.

Read before the plugin patches this process (``status`` does): a patched
backend returns the backport's builder, which reads as in doubt. The tools'
view, never the runtime's: where reading says "fixed", the runtime still
guards every call (a capture bound per instance, a stream that is ``None``
at run time).
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


def not_as_read(source: Source, fn: object, qualname: str) -> str | None:
    """Why reading ``source`` says nothing of ``fn``, the function this
    process runs as ``qualname`` (``Class.method``); None where ``fn`` is
    compiled from exactly that source. Not so for a decorated function, or
    where the file changed after import (an in-tree patch applied under a
    running process)."""
    if hasattr(fn, "__wrapped__"):
        return f"{qualname} is decorated"
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return f"{qualname} is not a plain function"
    try:
        compiled = compile(source.data, str(source.path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return f"{source.rel} does not compile"
    for name in qualname.split("."):  # the class's body, then the method's
        inner = [c for c in compiled.co_consts if isinstance(c, types.CodeType)]
        named = [c for c in inner if c.co_name == name]
        if len(named) != 1:
            return f"{qualname} is not defined once in {source.rel}"
        compiled = named[0]
    if compiled != code:
        changed = f"{source.rel} now says (changed since import?)"
        return f"{qualname} does not run what {changed}"
    return None


def in_doubt(where: str, why: str) -> Reading:
    return Reading(where, None, f"cannot tell by reading ({why})")


def reading_of(
    where: str, finding: model.Finding, fixed: str, needed: str | None = None
) -> Reading:
    """What the reader found at one fix site, in ``status``'s words: ``needed``
    (for a finding that needs the fix), ``fixed`` (upstream's fix, or ours in
    the files), or in doubt, with the reader's reason."""
    if finding.state == model.NEEDED and needed is not None:
        return Reading(where, True, needed)
    if finding.state == model.APPLIED:
        return Reading(where, False, f"{fixed} (the in-tree fix)")
    if finding.state in (model.UPSTREAM, model.ABSENT):
        return Reading(where, False, fixed)
    return in_doubt(where, finding.detail)
