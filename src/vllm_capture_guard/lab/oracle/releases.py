# SPDX-License-Identifier: Apache-2.0
"""Run something against another vLLM release: the one way the oracle and
the version matrix do it.

Each other release is a folder ``<envs>/vllm-X`` made by ``pip install
--no-deps --target`` (``scripts/make-envs.sh``); a process runs against it
when that folder comes first on ``PYTHONPATH``, in front of the venv's own
vLLM. ``<envs>`` is ``$CAPTURE_GUARD_ENVS``, else ``.envs``. A release with
no folder is the interpreter's own vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

ENVS_VAR = "CAPTURE_GUARD_ENVS"
DEFAULT_ENVS = ".envs"
#: A folder of vLLM caches, one per release (``vllm-X``), for the processes
#: started against each release (the version matrix sets it).
CACHES_VAR = "CAPTURE_GUARD_VLLM_CACHES"


def src_dir() -> Path:
    """The folder this package is imported from (``src`` of a checkout)."""
    import vllm_capture_guard

    return Path(vllm_capture_guard.__file__).resolve().parents[1]


def env_dir(version: str | None, envs: str | os.PathLike | None = None) -> Path | None:
    """``<envs>/vllm-<version>`` if it exists, else None (the interpreter's
    own vLLM is meant, as with ``version=None``)."""
    if version is None:
        return None
    root = Path(envs or os.environ.get(ENVS_VAR) or DEFAULT_ENVS)
    path = root / f"vllm-{version}"
    return path.resolve() if path.is_dir() else None


def release_in(folder: str | os.PathLike) -> str | None:
    """The vLLM release installed in ``folder`` (a site-packages or a
    ``vllm-X`` target), read from its ``.dist-info``; no import. None unless
    there is exactly one."""
    found = [p.name for p in Path(folder).glob("vllm-*.dist-info")]
    if len(found) != 1:
        return None
    return found[0].removeprefix("vllm-").removesuffix(".dist-info")


def own_version() -> str | None:
    """The release of the venv's own vLLM (what runs with no ``vllm-X``
    folder in front of it)."""
    return release_in(sysconfig.get_paths()["purelib"])


def cache_for(version: str | None) -> dict[str, str]:
    """``VLLM_CACHE_ROOT`` for a process that runs vLLM ``version``, where
    ``$CAPTURE_GUARD_VLLM_CACHES`` names a folder of caches per release; else
    nothing. vLLM caches each model class's inspection (a subprocess that
    imports vLLM again, about 9 s on two cores) in one file per class,
    whatever the release, so processes of two releases that share one cache
    redo it in turn."""
    base = os.environ.get(CACHES_VAR)
    if not base or not version:
        return {}
    return {"VLLM_CACHE_ROOT": str(Path(base).resolve() / f"vllm-{version}")}


def env_with(
    path: Sequence[str | os.PathLike],
    overrides: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """This process's environment with ``path`` as ``PYTHONPATH``; ``overrides``
    set (or, with None, remove) variables. vLLM logs to stderr, so that stdout
    stays the tool's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    for key, value in (overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def env_for(
    version: str | None,
    overrides: Mapping[str, str | None] | None = None,
    envs: str | os.PathLike | None = None,
) -> dict[str, str]:
    """The process environment that runs this package against ``version``."""
    target = env_dir(version, envs)
    path = [src_dir()] if target is None else [src_dir(), target]
    ran = version if target is not None else own_version()  # its cache
    return env_with(path, {**cache_for(ran), **(overrides or {})})


def run_in(
    version: str | None,
    args: Sequence[str],
    overrides: Mapping[str, str | None] | None = None,
    envs: str | os.PathLike | None = None,
    timeout: float = 900,
    **kwargs,
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh interpreter against vLLM ``version``."""
    return subprocess.run(
        [sys.executable, *args],
        env=env_for(version, overrides, envs),
        text=True,
        timeout=timeout,
        **{"capture_output": True, **kwargs},
    )


def wrong_release(version: str, found: str) -> str | None:
    """Why a run asked for ``version`` but got ``found``, or None."""
    if found == version:
        return None
    return (
        f"asked for vLLM {version} but the environment has {found}; build it "
        f"(make envs) or point {ENVS_VAR} at a folder of vllm-X targets"
    )
