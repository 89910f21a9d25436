# SPDX-License-Identifier: Apache-2.0
"""Post-import hooks on throwaway modules: they run once, right after the
module body, or at once if it is imported; a failing hook never breaks the
import; the loader stays the very same object."""

from __future__ import annotations

import importlib
import sys
import threading

import pytest

from vllm_capture_guard.runtime import hooks
from vllm_capture_guard.tools.revert import clear_hooks, pending_hooks


@pytest.fixture
def modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(name: str, body: str = "VALUE = 1\n") -> str:
        (tmp_path / f"{name}.py").write_text(body)
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)
    clear_hooks()


def test_hook_runs_after_the_body_once(modules):
    name = modules("cg_hook_a", "VALUE = 41\nVALUE += 1\n")
    seen = []
    hooks.when_imported(name, lambda m: seen.append(m.VALUE), pytest.fail)
    assert seen == []
    assert name in pending_hooks()
    module = importlib.import_module(name)
    assert seen == [42]
    importlib.reload(module)
    assert seen == [42]
    assert name not in pending_hooks()
    assert "exec_module" not in vars(module.__spec__.loader)


def test_hook_runs_at_once_when_already_imported(modules):
    name = modules("cg_hook_b")
    importlib.import_module(name)
    seen = []
    hooks.when_imported(name, lambda m: seen.append(m.__name__), pytest.fail)
    assert seen == [name]


def test_failing_hook_goes_to_on_error_and_import_succeeds(modules):
    name = modules("cg_hook_c")
    errors = []

    def boom(module):
        raise RuntimeError("hook exploded")

    hooks.when_imported(name, boom, lambda n, e: errors.append((n, str(e))))
    module = importlib.import_module(name)
    assert module.VALUE == 1
    assert errors == [(name, "hook exploded")]


def test_loader_is_the_same_object(modules):
    from importlib.machinery import SourceFileLoader

    name = modules("cg_hook_d")
    hooks.when_imported(name, lambda m: None, pytest.fail)
    module = importlib.import_module(name)
    assert type(module.__spec__.loader) is SourceFileLoader
    assert module.__loader__ is module.__spec__.loader


def test_many_threads_one_hook_each(modules):
    name = modules("cg_hook_e")
    seen = []
    barrier = threading.Barrier(4)

    def arm():
        barrier.wait()
        hooks.when_imported(name, lambda m: seen.append(1), pytest.fail)

    threads = [threading.Thread(target=arm) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    importlib.import_module(name)
    assert seen == [1, 1, 1, 1]


def test_other_imports_pass_untouched(modules):
    name = modules("cg_hook_f")
    hooks.when_imported("cg_hook_never_imported", pytest.fail, pytest.fail)
    module = importlib.import_module(name)
    assert "exec_module" not in vars(module.__spec__.loader)


def test_hook_asked_for_during_the_import_runs_once_it_is_complete(modules):
    name = modules(
        "cg_hook_g",
        "import builtins\n"
        "from vllm_capture_guard.runtime import hooks\n"
        "hooks.when_imported(__name__, lambda m: builtins.__dict__.setdefault("
        "'cg_seen', []).append(m.VALUE), lambda n, e: None)\n"
        "VALUE = 7\n",
    )
    import builtins

    importlib.import_module(name)
    importlib.import_module(modules("cg_hook_h"))  # any later import
    assert builtins.__dict__.pop("cg_seen", None) == [7]


class _ClassLoader:
    """A loader that is a class, as the built-in and frozen importers are."""

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        module.VALUE = 3


class _ClassLoaderFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "cg_hook_class_loaded":
            return None
        import importlib.util

        return importlib.util.spec_from_loader(name, _ClassLoader)


def test_loader_that_cannot_carry_a_hook_is_reported_not_broken(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, _ClassLoaderFinder])
    errors = []
    hooks.when_imported(
        "cg_hook_class_loaded", pytest.fail, lambda n, e: errors.append(str(e))
    )
    try:
        module = importlib.import_module("cg_hook_class_loaded")
        assert module.VALUE == 3
        assert "exec_module" not in vars(_ClassLoader) or isinstance(
            vars(_ClassLoader)["exec_module"], staticmethod
        )
        assert len(errors) == 1 and "cannot carry a hook" in errors[0]
    finally:
        sys.modules.pop("cg_hook_class_loaded", None)
        clear_hooks()
