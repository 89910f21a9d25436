# SPDX-License-Identifier: Apache-2.0
"""Safe writes: all files or none, each one atomically, modes kept, stale
bytecode removed.

* Before anything is written, every folder and file to be touched must be
  writable, and its permission bits must allow writing: a file or folder
  marked read-only is refused even for root, whom ``os.access`` never refuses.
* Every new content goes to a temporary file in the target's own folder first
  (flushed and fsynced, with the target's mode and owner); then each one
  replaces its target with ``os.replace``. If a replace fails, the targets
  already replaced get their old bytes back: all or nothing.
* ``--apply`` keeps each file's original bytes beside it (:data:`SIDECAR`)
  rather than making an edit that could be undone from the file alone: the
  original comes back exactly (line endings, the removed line's trailing
  comment, anything), and ``--revert`` first checks that the file is still
  what ``--apply`` makes of that original, so it never overwrites a later
  change. A tree patched with ``--diff`` has no sidecar: reverse that diff.
* ``__pycache__/<name>.*.pyc`` of a changed source is removed, once the
  sources are written (a refusal or a failed write removes nothing). An image
  compiled with hash-based bytecode (``compileall --invalidation-mode
  unchecked-hash``) would otherwise keep running the old code, since Python
  never compares such a file with its source. A removed file for this
  interpreter is compiled again from the new source in the same mode.
* Runs that write are serialised by :func:`tree_lock` (an image build may run
  two at once): the second one reads the tree only after the first is done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import py_compile
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The original bytes of a patched file are kept beside it, under this suffix.
SIDECAR = ".capture-guard-orig"

_MODES = {
    0: py_compile.PycInvalidationMode.TIMESTAMP,
    1: py_compile.PycInvalidationMode.UNCHECKED_HASH,
    3: py_compile.PycInvalidationMode.CHECKED_HASH,
}


class WriteError(Exception):
    """A write was refused or failed; the tree is as it was."""


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR)


@dataclasses.dataclass(frozen=True)
class Change:
    path: Path
    data: bytes | None  # None: remove the file
    like: Path | None = None  # a new file takes this file's mode and owner


def _writable(path: Path, folder: bool) -> bool:
    want = os.W_OK | (os.X_OK if folder else 0)
    return os.access(path, want) and bool(path.stat().st_mode & stat.S_IWUSR)


def stale_bytecode(source: Path) -> list[Path]:
    cache = source.parent / "__pycache__"
    if not cache.is_dir():
        return []
    return sorted(cache.glob(f"{source.stem}.*.pyc"))


def preflight(changes: list[Change], sources: list[Path]) -> None:
    """Refuse, before writing anything, what could not be written."""
    problems: list[str] = []
    for change in changes:
        folder = change.path.parent
        if change.path.is_symlink():
            problems.append(
                f"{change.path} is a symbolic link (patch the tree it points into)"
            )
        elif change.path.exists() and not _writable(change.path, folder=False):
            problems.append(f"{change.path} is read-only")
        if not _writable(folder, folder=True):
            problems.append(f"folder {folder} is read-only")
    for source in sources:
        for pyc in stale_bytecode(source):
            if not _writable(pyc.parent, folder=True):
                problems.append(f"cannot remove stale bytecode {pyc} (read-only)")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise WriteError(
            "cannot write this tree; nothing was written:\n  " + "\n  ".join(unique)
        )


def _stage(change: Change) -> Path:
    """The new content in a temporary file beside the target."""
    model = change.path if change.path.exists() else change.like
    fd, name = tempfile.mkstemp(
        dir=change.path.parent, prefix=f".{change.path.name}.", suffix=".tmp"
    )
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(change.data or b"")
            f.flush()
            os.fsync(f.fileno())
        if model is not None:
            st = model.stat()
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (0, 0):
                os.chown(tmp, st.st_uid, st.st_gid)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(changes: list[Change]) -> None:
    """Every change or none (see the module docstring)."""
    staged: list[tuple[Change, Path | None]] = []
    try:
        for change in changes:
            staged.append((change, None if change.data is None else _stage(change)))
    except OSError as e:
        for _, tmp in staged:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        raise WriteError(f"could not stage {change.path}: {e}; nothing written") from e
    done: list[tuple[Change, bytes | None]] = []
    try:
        for change, tmp in staged:
            old = change.path.read_bytes() if change.path.exists() else None
            if tmp is None:
                change.path.unlink(missing_ok=True)
            else:
                os.replace(tmp, change.path)
            done.append((change, old))
    except OSError as e:
        for change, old in reversed(done):
            if old is None:
                change.path.unlink(missing_ok=True)
            else:
                os.replace(_stage(Change(change.path, old, change.like)), change.path)
        for _, tmp in staged:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        raise WriteError(
            f"could not write {change.path}: {e}; the files already written were "
            f"put back, nothing changed"
        ) from e
    for folder in {c.path.parent for c in changes}:
        _sync_folder(folder)


@dataclasses.dataclass(frozen=True)
class Bytecode:
    path: Path
    mode: py_compile.PycInvalidationMode | None
    optimize: int | None  # None: another interpreter's file


def find_stale_bytecode(source: Path) -> list[Bytecode]:
    """The bytecode of ``source`` that a change makes stale; reads only."""
    found = []
    for pyc in stale_bytecode(source):
        parts = pyc.name.split(".")  # name, tag, [opt-N], pyc
        mode = None
        try:
            with open(pyc, "rb") as f:
                header = f.read(16)
            mode = _MODES.get(int.from_bytes(header[4:8], "little"))
        except OSError:
            pass
        optimize = None
        if parts[1] == sys.implementation.cache_tag:
            optimize = 0
            if len(parts) == 4 and parts[2].startswith("opt-"):
                optimize = int(parts[2][4:]) if parts[2][4:].isdigit() else None
        found.append(Bytecode(pyc, mode, optimize))
    return found


def remove_bytecode(stale: list[Bytecode]) -> list[Bytecode]:
    """Remove ``stale`` (after the sources were written: a refusal removes
    nothing); a file already gone is no error."""
    for old in stale:
        old.path.unlink(missing_ok=True)
    return stale


def remove_stale_bytecode(source: Path) -> list[Bytecode]:
    return remove_bytecode(find_stale_bytecode(source))


def recompile(source: Path, removed: list[Bytecode]) -> list[str]:
    """Compile ``source`` again where this interpreter's bytecode was removed,
    in the same invalidation mode. Returns what was written."""
    written = []
    for old in removed:
        if old.optimize is None or old.mode is None:
            continue
        try:
            py_compile.compile(
                str(source),
                cfile=str(old.path),
                optimize=old.optimize,
                invalidation_mode=old.mode,
                doraise=True,
            )
        except (py_compile.PyCompileError, OSError):
            continue  # Python compiles it on import instead
        written.append(f"{old.path.name} ({old.mode.name.lower().replace('_', '-')})")
    return written


#: The lock file that serialises ``--apply`` and ``--revert`` on one tree; it
#: lives in the vllm package folder while a run holds it.
LOCK = ".capture-guard.lock"


@contextlib.contextmanager
def tree_lock(package: Path) -> Iterator[None]:
    """Hold the tree's lock (``fcntl.flock`` on :data:`LOCK` in ``package``).

    The file is removed only by the run that created it, while it still holds
    the lock; a run that got the lock on a file removed meanwhile tries again,
    so two runs never hold locks on two different files. A lock file that was
    there before (left by a killed run) is used and left in place."""
    path = package / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # removed between the two opens
            created = False
        except OSError as e:
            raise WriteError(
                f"cannot create the lock file {path} ({e.strerror}); nothing was "
                f"written"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its creator removed it before we got it
                continue
            try:
                yield
            finally:
                if created:
                    path.unlink(missing_ok=True)
            return
        finally:
            os.close(fd)  # releases the lock
