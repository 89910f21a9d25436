# SPDX-License-Identifier: Apache-2.0
"""Processes where the plugin has never loaded, in well under a second.

A fresh interpreter spends 10-15 s of CPU importing torch and vLLM before a
test's snippet does its 0.1-1.5 s of work. :func:`python` runs the same
snippet, module or script in a child forked from a *warm parent* instead:
Python's own ``multiprocessing`` forkserver, preloaded with
:mod:`tests.warm_parent` (torch and vLLM's core imported, nothing else, and
checked). Why the forkserver: it is the standard library's own mechanism for
exactly this (one clean server started from a fresh interpreter, children
forked from it on request, preloads named by module), so there is no server
of our own to keep; the pytest process itself, which imports vLLM's backends
and patches classes in its own tests, is never forked.

A child gets what a fresh ``python ARGS`` would get from the caller:

* its environment, made in the caller at call time (``os.environ`` plus the
  overrides, as :func:`tests.conftest.fresh_env`), replaces the parent's;
* ``PYTHONPATH`` entries the parent does not have go first on ``sys.path``;
  for a folder that holds a package the parent has already imported (a
  ``vllm/`` overlay), the folder's copy of each imported package goes first
  on that package's ``__path__``, so a module the overlay changes is imported
  from the overlay. That holds only for modules the parent has not imported:
  a child that finds the overlay changes one of those refuses
  (:class:`NotWarmable`) and the call runs in a fresh interpreter instead;
* ``VLLM_LOGGING_LEVEL`` and ``VLLM_LOGGING_STREAM`` reach vLLM's logger as
  they would at its import (which happened in the parent);
* its own stdout and stderr (files, read back), its exit status, its
  ``sys.argv``; ``-c CODE`` runs as ``__main__``, ``-m MODULE`` through
  ``runpy``.

What a warm child cannot be, a test asks for with ``fresh=True``: where
freshness is what is tested (the absence of import-time output, variables
read at import, shims that act before ``vllm.platforms`` resolves, vLLM's own
test tree, the CLI as an operator runs it once per release).

If the parent's verdict failed (:mod:`tests.warm_parent`), every call runs
fresh, and :func:`verdict` says why.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = "tests.warm_parent"
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload([PRELOAD])
#: Set to 1 to run every call in a fresh interpreter (to compare the two).
FRESH_ENV = "CAPTURE_GUARD_TESTS_FRESH"
_verdict: dict | None = None
#: The environment the warm parent starts with: this process's at import,
#: before any test changed it.
_PARENT_ENV = dict(os.environ)


class NotWarmable(Exception):
    """This call cannot run in a warm child (exit status 90)."""


NOT_WARMABLE = 90


def _overlay(entries: list[str]) -> None:
    """Put ``entries`` first on ``sys.path``, in their order; for each
    imported package that a folder among them also holds, that folder's copy
    first on ``__path__``, in the same order."""
    for entry in reversed(entries):
        sys.path.insert(0, entry)
    for entry in reversed(entries):  # the first entry ends up first
        base = Path(entry)
        for name, module in list(sys.modules.items()):
            parts = name.split(".")
            if not (base / parts[0]).is_dir():
                continue
            path = getattr(module, "__path__", None)
            here = base.joinpath(*parts)
            own = here / "__init__.py" if path is not None else here.with_suffix(".py")
            loaded = getattr(module, "__file__", None)
            if own.is_file() and (
                loaded is None or own.resolve() != Path(loaded).resolve()
            ):
                # the parent imported what the overlay changes: not honoured
                raise NotWarmable(f"the parent imported {name}, which {entry} changes")
            if path is not None and here.is_dir() and str(here) not in path:
                path.insert(0, str(here))
    sys.path_importer_cache.clear()


def _same_release() -> None:
    """The vLLM that the new ``sys.path`` names is the one the parent imported."""
    from importlib.metadata import version

    imported = getattr(sys.modules.get("vllm"), "__version__", None)
    if imported is not None and version("vllm") != imported:
        raise NotWarmable(f"PYTHONPATH names vLLM {version('vllm')}, not {imported}")


def _logging(env: Mapping[str, str]) -> None:
    """What vLLM's logger would have read at import, in this child's env."""
    log = logging.getLogger("vllm")
    level = env.get("VLLM_LOGGING_LEVEL")
    if level:
        log.setLevel(level.upper())
    stream = env.get("VLLM_LOGGING_STREAM")
    if stream in ("ext://sys.stdout", "ext://sys.stderr"):
        target = sys.stdout if stream.endswith("stdout") else sys.stderr
        for handler in log.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(target)


def _child(
    args: list[str], env: dict[str, str], out: str, err: str, cwd: str | None
) -> None:
    """In the forked child: become ``python ARGS`` and exit with its status."""
    code = 1
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    try:
        parent = sys.modules.get(PRELOAD)
        if parent is None or not parent.VERDICT["ok"]:
            raise NotWarmable("the warm parent failed its checks")
        known = {os.path.abspath(p) for p in sys.path}
        added = [
            os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
        ]
        os.environ.clear()
        os.environ.update(env)
        os.environ["OMP_NUM_THREADS"] = "1"
        _overlay(list(dict.fromkeys(p for p in added if p not in known)))
        _same_release()
        _logging(env)
        sys.argv = list(args)
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except NotWarmable as e:
        print(f"not warmable: {e}", file=sys.stderr)
        code = NOT_WARMABLE
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)


def _report_verdict() -> None:
    parent = sys.modules.get(PRELOAD)
    verdict = parent.VERDICT if parent else {"ok": False, "problems": ["no parent"]}
    print(repr(verdict))
    sys.stdout.flush()


def verdict() -> dict:
    """The warm parent's verdict, asked of one child (once per process)."""
    global _verdict
    if _verdict is None:
        if os.environ.get(FRESH_ENV) == "1":
            _verdict = {"ok": False, "problems": [f"{FRESH_ENV}=1"], "platform": None}
            return _verdict
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(_PARENT_ENV)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        proc = _start(["-c", "from tests.warm import _report_verdict as r; r()"], {})
        out = proc.wait(300)
        try:
            import ast

            _verdict = ast.literal_eval(out.stdout.strip().splitlines()[-1])
        except Exception:
            _verdict = {
                "ok": False,
                "problems": [out.stdout[-300:] + out.stderr[-300:]],
            }
    return _verdict


class _Warm:
    def __init__(self, args: list[str], env: dict[str, str], cwd: str | None) -> None:
        self.args = args
        self.dir = tempfile.TemporaryDirectory(prefix="warm-")
        self.out = os.path.join(self.dir.name, "out")
        self.err = os.path.join(self.dir.name, "err")
        for path in (self.out, self.err):
            Path(path).touch()
        self.process = _CTX.Process(
            target=_child, args=(args, env, self.out, self.err, cwd)
        )
        self.process.start()

    def wait(self, timeout: float | None) -> subprocess.CompletedProcess[str]:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        with self.dir:
            out, err = Path(self.out).read_text(), Path(self.err).read_text()
        return subprocess.CompletedProcess(self.args, self.process.exitcode, out, err)


def _start(args: list[str], env: dict[str, str], cwd: str | None = None) -> _Warm:
    return _Warm(list(args), dict(env), cwd)


class Handle:
    """A started ``python ARGS``: :meth:`wait` gives its ``CompletedProcess``."""

    def __init__(
        self, args: Sequence[str], env: dict[str, str], cwd: str | None, fresh: bool
    ) -> None:
        self.args, self.env, self.cwd = list(args), env, cwd
        warm = not fresh and verdict()["ok"]
        self.warm = _start(self.args, env, cwd) if warm else None
        self.popen = None if self.warm else self._popen()

    def _popen(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, *self.args],
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait(self, timeout: float | None = 600) -> subprocess.CompletedProcess[str]:
        if self.warm is not None:
            done = self.warm.wait(timeout)
            if done.returncode != NOT_WARMABLE:
                return done
            self.warm, self.popen = None, self._popen()  # run it fresh instead
        try:
            out, err = self.popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.communicate()
            raise
        return subprocess.CompletedProcess(
            [sys.executable, *self.args], self.popen.returncode, out, err
        )


def start(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    fresh: bool = False,
    cwd: str | os.PathLike | None = None,
) -> Handle:
    """Start ``python ARGS`` in a warm child (or fresh: ``fresh=True``, or if
    the parent is unfit); ``env`` is the child's whole environment."""
    env = dict(os.environ if env is None else env)
    args = [os.fspath(a) for a in args]  # as subprocess takes them
    return Handle(args, env, None if cwd is None else str(cwd), fresh)


def python(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    fresh: bool = False,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = 600,
) -> subprocess.CompletedProcess[str]:
    """``python ARGS``, as :func:`subprocess.run` with output captured."""
    return start(args, env, fresh=fresh, cwd=cwd).wait(timeout)
