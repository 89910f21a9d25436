# SPDX-License-Identifier: Apache-2.0
"""Patchable copies of an installed vLLM, made at test time.

A release's whole ``vllm`` package is large, so :func:`make_overlay` builds a
symlink farm of it: every folder on the way to the files we patch is a real
folder, those files are real copies, and everything else is a symbolic link
to the installed release (bytecode included, except the copied files'). Put
the overlay first on ``PYTHONPATH`` (:func:`overlay_env`) and a fresh
interpreter imports the copied files and the release's own everything else.
The installed release is never written to.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

from vllm_capture_guard.lab.oracle import releases
from vllm_capture_guard.tools.tree.plan import FILES

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PURELIB = Path(sysconfig.get_paths()["purelib"])


def release_base(version: str) -> Path | None:
    """The folder that holds ``vllm/`` of release ``version``: its ``.envs``
    folder, or the venv's site-packages if that is the release installed
    there; None if neither."""
    env = releases.env_dir(version)
    if env is not None and (env / "vllm").is_dir():
        return env
    if (PURELIB / f"vllm-{version}.dist-info").is_dir():
        return PURELIB
    return None


def _mirror(src: Path, dest: Path, copies: set[Path]) -> None:
    """``dest`` as a real folder mirroring ``src``; ``copies`` are the paths,
    relative to ``src``, of the files to copy (their folders are real too)."""
    dest.mkdir()
    folders = {f.parts[0] for f in copies if len(f.parts) > 1}
    here = {f.name for f in copies if len(f.parts) == 1}
    for entry in src.iterdir():
        target = dest / entry.name
        if entry.name in folders:
            inner = {Path(*f.parts[1:]) for f in copies if f.parts[0] == entry.name}
            _mirror(entry, target, inner)
        elif entry.name in here:
            shutil.copyfile(entry, target)
            shutil.copymode(entry, target)
        elif entry.name == "__pycache__" and entry.is_dir():
            target.mkdir()
            stems = {Path(c).stem for c in here}
            for pyc in entry.iterdir():
                if pyc.name.split(".")[0] not in stems:
                    (target / pyc.name).symlink_to(pyc)
        else:
            target.symlink_to(entry)


def make_overlay(base: Path, dest: Path) -> Path:
    """A patchable overlay of ``base/vllm`` under ``dest``; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    _mirror(base / "vllm", dest / "vllm", {Path(f) for f in FILES})
    for info in base.glob("vllm-*.dist-info"):
        (dest / info.name).symlink_to(info)
    return dest


def target_files(tree_root: Path) -> dict[str, Path]:
    return {inside: tree_root / "vllm" / inside for inside in FILES}


def snapshot(tree_root: Path) -> dict[str, bytes]:
    return {k: p.read_bytes() for k, p in target_files(tree_root).items()}


def overlay_env(overlay: Path, base: Path, **extra: str | None) -> dict[str, str]:
    """A process environment whose ``vllm`` is the overlay's."""
    path = [SRC, overlay]
    if base != PURELIB:
        path.append(base)  # what the release's folder holds besides vllm
    # the version matrix's cache of the release, where it shares them: the
    # overlay patches no model file, so the release's model-info cache holds
    cache = releases.cache_for(releases.release_in(base))
    return releases.env_with(path, {**cache, **extra})


def run_in(
    env: dict[str, str], *args: str, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a new process with ``env`` (:mod:`tests.warm`: a
    warm child where the overlay is of the release this process runs)."""
    from tests import warm

    return warm.python(args, env, timeout=timeout, cwd=cwd)


def source_checkout(dest: Path, files: dict[str, bytes]) -> Path:
    """A git-initialised stand-in for a vLLM source checkout holding ``files``
    (inside-package path -> bytes), committed."""
    for inside, data in files.items():
        path = dest / "vllm" / inside
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (dest / "vllm" / "__init__.py").write_bytes(b"")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "vLLM"]):
        subprocess.run([*git, *cmd], cwd=dest, check=True, capture_output=True)
    return dest
