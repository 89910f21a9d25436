# SPDX-License-Identifier: Apache-2.0
"""Post-import hooks, as ``wrapt.when_imported`` without wrapt. A finder first
on ``sys.meta_path`` wraps a watched module's loader once, so that its hooks run
right after the module's body. A hook never breaks the import; one asked for
while its module is still being imported runs at the next import."""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]
OnError = Callable[[str, BaseException], None]  # told what a hook raised
Pending = tuple[Hook, OnError]

_lock = threading.RLock()
_pending: dict[str, list[Pending]] = {}  # module name -> hooks waiting for it
_mid_import: set[str] = set()  # watched modules asked for while being imported


def _run(name: str, module: ModuleType, pending: list[Pending]) -> None:
    for hook, on_error in pending:
        try:
            hook(module)
        except Exception as e:  # never break vLLM's import
            with contextlib.suppress(Exception):
                on_error(name, e)


def _take(name: str) -> list[Pending]:  # the hooks of ``name``, once
    with _lock:
        return _pending.pop(name, [])


def complete(name: str) -> bool:
    """Whether ``name`` is imported and its body has run."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return name in sys.modules and not getattr(spec, "_initializing", False)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module, it asks the other finders
    and wraps the loader they return."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if _mid_import:  # hooks asked for mid-import: run those now complete
            with _lock:
                ready = [name for name in _mid_import if complete(name)]
                _mid_import.difference_update(ready)
            for name in ready:
                _run(name, sys.modules[name], _take(name))
        if fullname not in _pending:  # the fast path, for every other import
            return None
        spec = self._spec_from_the_others(fullname, path, target)
        if spec is not None:
            self._hook_the_loader(fullname, spec.loader)
        return spec

    def _spec_from_the_others(self, fullname: str, path: Any, target: Any) -> Any:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _hook_the_loader(self, fullname: str, loader: Any) -> None:
        original = getattr(loader, "exec_module", None)

        def exec_module(module: ModuleType) -> None:
            try:
                original(module)
            finally:  # the loader as it was, before anyone else sees it
                if vars(loader).get("exec_module") is exec_module:
                    del loader.exec_module
            if module.__name__ == fullname:  # its body ran: the module is complete
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


_finder = _Finder()


def when_imported(name: str, hook: Hook, on_error: OnError) -> None:
    """``hook(module)`` once ``name`` is imported: now, or right after its import."""
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        if not complete(name):
            _pending.setdefault(name, []).append((hook, on_error))
            if name in sys.modules:  # being imported right now
                _mid_import.add(name)
            return
    _run(name, sys.modules[name], [(hook, on_error)])


def waiting_for() -> list[str]:
    """The module names that hooks still wait for (for the tools)."""
    with _lock:
        return sorted(_pending)


def stop_watching() -> None:
    """Forget every hook, and the finder (the tools' revert; not vLLM's)."""
    with _lock:
        _pending.clear()
        _mid_import.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
