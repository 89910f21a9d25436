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
import: an exception in a hook, or a loader that cannot carry one, goes to
the error handler given to :func:`when_imported`, and the import goes on. A
hook asked for while its module is still being imported runs at the next
import anywhere after that module is complete. ``importlib.reload`` does not
run hooks again: a reloaded backend module has vLLM's classes as written.
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
        if _deferred:
            _run_deferred()
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
        if original is None or isinstance(loader, type):
            # A loader we must not annotate (a class, or one without
            # exec_module): the import goes on untouched, the hooks say why.
            _give_up(fullname, f"its loader {loader!r} cannot carry a hook")
            return spec

        def exec_module(module: ModuleType) -> None:
            try:
                original(module)
            finally:
                # Put the loader back as it was before anyone else sees it.
                with contextlib.suppress(Exception):
                    if vars(loader).get("exec_module") is exec_module:
                        del loader.exec_module
            if module.__name__ == fullname:
                with _lock:
                    hooks = _pending.pop(fullname, [])
                _run(fullname, module, hooks)

        try:
            loader.exec_module = exec_module  # an instance attribute only
        except Exception:
            _give_up(fullname, f"its loader {loader!r} cannot carry a hook")
        return spec


def _give_up(name: str, why: str) -> None:
    """Tell every hook waiting for ``name`` that it will not run."""
    with _lock:
        hooks = _pending.pop(name, [])
    error = RuntimeError(f"cannot watch the import of {name}: {why}")
    for _hook, on_error in hooks:
        with contextlib.suppress(Exception):
            on_error(name, error)


#: Modules that were still being imported when a hook was asked for; their
#: hooks run at the next import anywhere once they are complete.
_deferred: set[str] = set()


def _run_deferred() -> None:
    with _lock:
        done = [
            n for n in _deferred if n in sys.modules and _fully_imported(sys.modules[n])
        ]
        ready = []
        for name in done:
            _deferred.discard(name)
            ready.append((name, sys.modules[name], _pending.pop(name, [])))
    for name, module, hooks in ready:
        _run(name, module, hooks)


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
            if module is not None:  # being imported right now
                _deferred.add(name)
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
        _deferred.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
