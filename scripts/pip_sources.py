# SPDX-License-Identifier: Apache-2.0
"""Print, one per line, the uv flags that give uv the sources pip is set up with.

pip reads its indexes, find-links and constraints from its configuration files
and PIP_* variables; uv reads none of them. So that uv takes wheels already on
this machine (a local index, a find-links folder) instead of downloading them,
this reads ``pip config list`` and turns each source into uv's flag. Sources
that are local paths and do not exist are left out (uv refuses them). uv then
resolves as pip does across several indexes: ``--index-strategy
unsafe-best-match``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def _exists(value: str) -> bool:
    url = urlparse(value)
    if url.scheme in ("http", "https"):
        return True
    path = unquote(url.path) if url.scheme == "file" else value
    return Path(path).exists()


def parse(listing: str) -> list[str]:
    """uv flags for the lines of ``pip config list``, in pip's order."""
    seen: dict[str, list[str]] = {}
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        if name not in FLAGS:
            continue
        values = seen.setdefault(name, [])
        for value in raw.strip().strip("'\"").split():
            if value not in values and _exists(value):
                values.append(value)
    flags = ["--index-strategy", "unsafe-best-match"]
    for name, values in seen.items():
        if name == "index-url":
            values = values[-1:]  # one index-url: the last source wins, as in pip
        for value in values:
            flags += [FLAGS[name], value]
    return flags


def main() -> int:
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    out = subprocess.run(
        [python, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    print("\n".join(parse(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
