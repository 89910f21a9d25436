# SPDX-License-Identifier: Apache-2.0
"""Post-import hooks: run a function the moment vLLM imports a module.

Why a small finder of our own rather than ``wrapt.when_imported``: the plugin
is installed into vendor images next to their own vLLM and torch, and it must
not pull in (or let pip upgrade) anything there; it needs only the one thing
wrapt's hooks do, for a handful of module names. So this module does that one
thing, in the way wrapt does it: a finder first on ``sys.meta_path`` that
answers only for the watched names, lets the other finders find the module,
and wraps that spec's ``exec_module`` so the hooks run right after the module
body ran. The loader stays the very same object (``isinstance`` checks,
``inspect.getsource`` and ``importlib.resources`` see no difference).

A hook runs once, under the import lock of its module. It never breaks the
import: an exception in a hook goes to the error handler given to
:func:`when_imported`, and the import goes on.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]
OnError = Callable[[str, BaseException], None]

_lock = threading.RLock()
_pending: dict[str, list[tuple[Hook, OnError]]] = {}


def _run(name: str, module: ModuleType, hooks: list[tuple[Hook, OnError]]) -> None:
    for hook, on_error in hooks:
        try:
            hook(module)
        except BaseException as e:  # never break vLLM's import
            if not isinstance(e, Exception):
                raise
            with contextlib.suppress(Exception):
                on_error(name, e)


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``; answers only for watched module names."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _pending:  # the fast path for every other import
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        original = getattr(loader, "exec_module", None)
        if original is None:
            return spec

        def exec_module(module: ModuleType) -> None:
            try:
                original(module)
            finally:
                # Put the loader back as it was before anyone else sees it.
                loader.__dict__.pop("exec_module", None)
            if module.__name__ == fullname:
                with _lock:
                    hooks = _pending.pop(fullname, [])
                _run(fullname, module, hooks)

        try:
            loader.exec_module = exec_module  # an instance attribute only
        except Exception:  # a loader we cannot annotate: import untouched
            return spec
        return spec


_finder = _Finder()


def _fully_imported(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def when_imported(name: str, hook: Hook, on_error: OnError) -> None:
    """Run ``hook(module)`` once ``name`` is imported: now, if it already is,
    else right after vLLM imports it."""
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        module = sys.modules.get(name)
        if module is None or not _fully_imported(module):
            _pending.setdefault(name, []).append((hook, on_error))
            return
    _run(name, module, [(hook, on_error)])


def pending() -> list[str]:
    """The watched module names not imported yet."""
    with _lock:
        return sorted(_pending)


def clear() -> None:
    """Forget every pending hook and take the finder off ``sys.meta_path``."""
    with _lock:
        _pending.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
