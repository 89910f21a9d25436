# SPDX-License-Identifier: Apache-2.0
"""vLLM's own ``tests/`` tree of a release, from its sdist on the package
registry.

The wheel carries no ``tests/``; the sdist does. :func:`fetch` finds the sdist
through the registry's simple API (PEP 691 JSON), downloads it once into a
cache outside the repository and checks its sha256 against the registry's;
:func:`extract_tests` lays out ``tests/`` and ``pyproject.toml`` (vLLM's pytest
settings), and never vLLM's sources: the tree under test must be the installed
release, as in vLLM's CI image.

Cache: ``$CAPTURE_GUARD_SDIST_CACHE``, else ``$XDG_CACHE_HOME`` (or
``~/.cache``) ``/vllm-capture-guard/sdists``. Index: ``$CAPTURE_GUARD_INDEX_URL``,
else an http(s) ``$PIP_INDEX_URL``, else https://pypi.org/simple.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PROJECT = "vllm"
DEFAULT_INDEX = "https://pypi.org/simple"


def cache_dir() -> Path:
    explicit = os.environ.get("CAPTURE_GUARD_SDIST_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-capture-guard" / "sdists"


def index_url() -> str:
    for name in ("CAPTURE_GUARD_INDEX_URL", "PIP_INDEX_URL"):
        value = os.environ.get(name, "")
        if value.startswith(("https://", "http://")):
            return value.rstrip("/")
    return DEFAULT_INDEX


def _sdist_entry(version: str) -> dict:
    """The registry's file entry for ``vllm-<version>.tar.gz``."""
    url = f"{index_url()}/{PROJECT}/"
    request = urllib.request.Request(
        url, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    name = f"{PROJECT}-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return entry
    raise LookupError(f"{url} lists no {name}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(version: str) -> Path:
    """The cached sdist of vLLM ``version``, downloaded if missing."""
    target = cache_dir() / f"{PROJECT}-{version}.tar.gz"
    stamp = target.with_name(target.name + ".sha256")
    if (
        target.is_file()
        and stamp.is_file()
        and _sha256(target) == stamp.read_text().strip()
    ):
        return target
    entry = _sdist_entry(version)
    want = entry["hashes"]["sha256"]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".")
    try:
        with (
            os.fdopen(fd, "wb") as out,
            urllib.request.urlopen(entry["url"], timeout=300) as response,
        ):
            while block := response.read(1 << 20):
                out.write(block)
        got = _sha256(Path(partial))
        if got != want:
            raise ValueError(f"{entry['url']}: sha256 {got}, registry says {want}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    stamp.write_text(want + "\n")
    return target


def extract_tests(version: str, dest: Path) -> Path:
    """``dest`` holding the release's ``tests/`` and ``pyproject.toml``."""
    archive = fetch(version)
    prefix = f"{PROJECT}-{version}/"
    wanted = (prefix + "tests/", prefix + "pyproject.toml")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(wanted) or not (
                member.isfile() or member.isdir()
            ):
                continue
            member.name = member.name[len(prefix) :]
            members.append(member)
        tar.extractall(dest, members=members, filter="data")
    if not (dest / "tests" / "conftest.py").is_file():
        raise LookupError(f"{archive.name} holds no tests/conftest.py")
    return dest
