# SPDX-License-Identifier: Apache-2.0
"""Post-import hooks, as ``wrapt.when_imported`` without wrapt: a finder first on
``sys.meta_path`` wraps a watched module's loader once, so hooks run right after
the module body, never breaking the import (one asked mid-import: at the next)."""

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
_deferred: set[str] = set()  # watched modules that were mid-import


def _run(name: str, module: ModuleType, hooks: list[tuple[Hook, OnError]]) -> None:
    for hook, on_error in hooks:
        try:
            hook(module)
        except Exception as e:  # never break vLLM's import
            with contextlib.suppress(Exception):
                on_error(name, e)


def _take(name: str) -> list[tuple[Hook, OnError]]:
    with _lock:
        return _pending.pop(name, [])


def complete(name: str) -> bool:  # imported, its body run
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return name in sys.modules and not getattr(spec, "_initializing", False)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if _deferred:
            with _lock:
                ready = [n for n in _deferred if complete(n)]
                _deferred.difference_update(ready)
            for name in ready:
                _run(name, sys.modules[name], _take(name))
        if fullname not in _pending:  # the fast path for every other import
            return None
        others = (f for f in sys.meta_path if f is not self)
        finds = (getattr(f, "find_spec", lambda *a: None) for f in others)
        spec = next((s for find in finds if (s := find(fullname, path, target))), None)
        if spec is None:
            return None
        loader = spec.loader
        original = getattr(loader, "exec_module", None)

        def exec_module(module: ModuleType) -> None:
            try:
                original(module)
            finally:  # the loader as it was, before anyone else sees it
                if vars(loader).get("exec_module") is exec_module:
                    del loader.exec_module
            if module.__name__ == fullname:  # the body ran: the module is complete
                with contextlib.suppress(Exception):
                    module.__spec__._initializing = False
                _run(fullname, module, _take(fullname))

        try:
            if original is None or isinstance(loader, type):
                raise TypeError
            loader.exec_module = exec_module
        except Exception:
            why = f"its loader {loader!r} cannot carry a hook"
            error = RuntimeError(f"cannot watch the import of {fullname}: {why}")
            for _hook, on_error in _take(fullname):
                with contextlib.suppress(Exception):
                    on_error(fullname, error)
        return spec


_finder = _Finder()


def when_imported(name: str, hook: Hook, on_error: OnError) -> None:
    """``hook(module)`` once ``name`` is imported: now, or right after its import."""
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        if not complete(name):
            _pending.setdefault(name, []).append((hook, on_error))
            if name in sys.modules:  # being imported right now
                _deferred.add(name)
            return
    _run(name, sys.modules[name], [(hook, on_error)])
