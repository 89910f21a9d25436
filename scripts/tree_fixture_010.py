#!/usr/bin/env python
# SPDX-License-Identifier: Apache-2.0
"""Write ``tests/tools/data/tree-0.1.0.json``: what release 0.1.0 of this
project (commit 7a4b9f7) wrote into each vLLM release's files with
``patch --apply``. A maintainer's tool; the test that reads the file is
``tests/tools/test_tree_010.py``.

No vLLM source is stored in this repository, so the file holds no vLLM line.
Per release and per target file it holds the sha256 of vLLM's original, the
sha256 of the file that 0.1.0 wrote, whether 0.1.0 kept the original beside
it, and 0.1.0's edit as a script that holds only the text we wrote:

* a line hunk ``{"line": L, "removed": N, "added": [...]}``: before original
  line L (1-based), N original lines are dropped (only their count is kept)
  and the added lines go in, each ending in the file's ``newline``;
* an insert ``{"line": L, "column": C, "insert": TEXT}``: TEXT goes into
  original line L at byte C (a call that gets ``stream=current_stream()``).
  The rest of that line is vLLM's, so it is not stored.

Every added line and insert is checked against 0.1.0's own texts (its marker
comments, the builder class and the import it inserts, the argument it adds),
so a line copied from vLLM can never get into the file.

How:

1. 0.1.0's package is taken from git (``git archive``) into a temporary
   folder, and run from there with ``python -S``: the standard library only,
   so neither today's code nor vLLM nor torch can be imported by it.
2. Each release's wheel is fetched with ``pip download --no-deps`` into a
   cache folder (``--wheels``, default ``/tmp/capture-guard-wheels``); a
   wheel already there is used as it is.
3. The target files are taken from the wheel into a minimal vLLM package in a
   temporary folder, and 0.1.0 runs ``--check --json``, ``--apply``,
   ``--check --json``, ``--apply`` again (nothing to do) and ``--revert``
   (every original back, byte for byte) on it.

    .venv/bin/python scripts/tree_fixture_010.py
    .venv/bin/python scripts/tree_fixture_010.py --releases 0.28.0
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "tools" / "data" / "tree-0.1.0.json"
COMMIT = "7a4b9f7"
RELEASES = ("0.27.1", "0.28.0", "0.29.0")
WHEELS = Path("/tmp/capture-guard-wheels")

#: Run inside 0.1.0's own package: the names and texts its patcher uses.
TEXTS = r"""
import json
from vllm_capture_guard import __version__, tools
from vllm_capture_guard.tools.tree import aiter_builder, capture_stream, files
from vllm_capture_guard.tools.tree import plan, source
print(json.dumps({
    "version": __version__,
    "package": tools.__file__,
    "files": list(plan.FILES),
    "sidecar": files.SIDECAR,
    "marker": source.MARKER_RE.pattern.decode(),
    "lines": [b.decode() for b in (*aiter_builder.BLOCK, capture_stream.IMPORT)],
    "fragments": [capture_stream.ARG.decode(), aiter_builder.BUILDER],
}))
"""

#: Run inside 0.1.0's own package: its CLI, with the arguments given.
CLI = "import sys; from vllm_capture_guard.tools.cli import main; sys.exit(main())"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def extract_010(commit: str, dest: Path) -> Path:
    """0.1.0's package from git into ``dest``; returns its ``src`` folder."""
    tar = subprocess.run(
        ["git", "archive", "--format=tar", commit, "src/vllm_capture_guard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    return dest / "src"


def run_010(src: Path, *args: str, code: str = CLI) -> subprocess.CompletedProcess:
    """Python ``-S`` (no site-packages) with 0.1.0's package on the path."""
    return subprocess.run(
        [sys.executable, "-S", "-c", code, *args],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=src.parent,
        timeout=120,
    )


def wheel(version: str, cache: Path) -> Path:
    """The release's wheel in ``cache``, fetched with pip if missing."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--only-binary=:all:", "--implementation", "cp",
             "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
             "-d", str(cache), f"vllm=={version}"],
            check=True,
        )  # fmt: skip
        found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"no wheel of vllm {version} in {cache}")
    return found[0]


def make_tree(root: Path, whl: Path, inside: list[str]) -> dict[str, bytes | None]:
    """A minimal vLLM package under ``root``: an empty ``__init__.py``, the
    folder that marks a package, and the target files found in the wheel."""
    package = root / "vllm"
    (package / "v1" / "attention" / "backends").mkdir(parents=True)
    (package / "__init__.py").write_bytes(b"")
    out: dict[str, bytes | None] = {}
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        for name in inside:
            member = f"vllm/{name}"
            out[name] = z.read(member) if member in names else None
            if out[name] is not None:
                path = package / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(out[name])
    return out


def listing(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
    )


def single_insert(old: bytes, new: bytes) -> tuple[int, bytes] | None:
    """``(column, text)`` if ``new`` is ``old`` with one piece put in."""
    if len(new) <= len(old):
        return None
    at = 0
    while at < len(old) and old[at] == new[at]:
        at += 1
    grown = len(new) - len(old)
    if new[at + grown :] != old[at:]:
        return None
    text = new[at : at + grown]
    while at and old[at - 1] == text[-1]:  # the leftmost of equal places
        at -= 1
        text = old[at : at + 1] + text[:-1]
    return at, text


def _body(line: bytes) -> bytes:
    return line.rstrip(b"\r\n")


def edit_script(old: bytes, new: bytes) -> list[dict]:
    """The edit that makes ``new`` of ``old``, holding none of ``old``'s lines
    (see the module docstring). A replaced line that is the old one with a
    piece put in becomes an insert, so the rest of it is not stored."""
    a = old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    ops: list[tuple] = []  # (line, kind, payload) in the original's order
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        j = j1
        for i in range(i1, i2):
            match = next(
                (x for x in range(j, j2) if single_insert(_body(a[i]), _body(b[x]))),
                None,
            )
            if match is None:
                ops.append((i + 1, "remove", None))
                continue
            ops.extend((i + 1, "add", _body(line)) for line in b[j:match])
            column, text = single_insert(_body(a[i]), _body(b[match]))
            ops.append((i + 1, "insert", (column, text)))
            j = match + 1
        ops.extend((i2 + 1, "add", _body(line)) for line in b[j:j2])
    hunks: list[dict] = []
    for line, kind, payload in ops:
        if kind == "insert":
            column, text = payload
            hunks.append({"line": line, "column": column, "insert": text.decode()})
            continue
        last = hunks[-1] if hunks else None
        # one hunk for lines that follow each other (added or removed)
        if (
            last is None
            or "added" not in last
            or last["line"] + last["removed"] != line
        ):
            last = {"line": line, "removed": 0, "added": []}
            hunks.append(last)
        if kind == "add":
            last["added"].append(payload.decode())
        else:
            last["removed"] += 1
    return hunks


def rebuild(old: bytes, hunks: list[dict], newline: str) -> bytes:
    """What the edit script ``hunks`` makes of ``old``: a line hunk puts its
    added lines before original line ``line`` and drops ``removed`` lines
    from there; an insert puts its text into line ``line`` at ``column``
    (``tests/tools/test_tree_010.py`` uses this one)."""
    lines = old.splitlines(keepends=True)
    out: list[bytes] = []
    skip = 0
    for number in range(1, len(lines) + 2):
        for h in hunks:
            if h["line"] == number and "added" in h:
                out += [(t + newline).encode() for t in h["added"]]
                skip += h["removed"]
        if number > len(lines):
            break
        if skip:
            skip -= 1
            continue
        line = lines[number - 1]
        inserts = [h for h in hunks if h["line"] == number and "insert" in h]
        for h in sorted(inserts, key=lambda h: -h["column"]):
            c = h["column"]
            line = line[:c] + h["insert"].encode() + line[c:]
        out.append(line)
    return b"".join(out)


def newline_of(hunks: list[dict], new: bytes) -> str:
    """The line ending that 0.1.0 gave its added lines (the file's own)."""
    for end in ("\r\n", "\n", "\r"):
        if all((t + end).encode() in new for h in hunks for t in h.get("added", ())):
            return end
    raise SystemExit("added lines with mixed line endings")


def ours(hunks: list[dict], texts: dict, rel: str) -> None:
    """Every added line and insert is 0.1.0's own text; exit otherwise."""
    marker = re.compile(texts["marker"])
    lines = {t.strip() for t in texts["lines"]}
    for h in hunks:
        for text in h.get("added", ()):
            body = text.strip()
            if (
                body
                and body not in lines
                and not marker.fullmatch(re.sub(r" \([^()]*\)$", "", body))
            ):
                raise SystemExit(f"{rel}: added line is not our text: {text!r}")
        if "insert" in h:
            piece = h["insert"].removeprefix(", ")
            if not piece or not any(piece in f for f in texts["fragments"]):
                raise SystemExit(f"{rel}: insert is not our text: {h['insert']!r}")


def record(src: Path, texts: dict, version: str, whl: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"tree-010-{version}-") as tmp:
        root = Path(tmp)
        originals = make_tree(root, whl, texts["files"])
        tree = str(root)

        def cli(*args: str) -> subprocess.CompletedProcess:
            return run_010(src, "patch", *args, "--tree", tree)

        def states() -> dict[str, str]:
            done = cli("--check", "--json")
            if done.returncode not in (0, 1):
                raise SystemExit(f"0.1.0 --check on {version}: {done.stdout}")
            found = json.loads(done.stdout)["findings"]
            return {f["file"].removeprefix("vllm/"): f["state"] for f in found}

        before = states()
        applied = cli("--apply")
        if applied.returncode != 0:
            raise SystemExit(f"0.1.0 --apply on {version}: {applied.stdout}")
        after = states()
        tree_after = listing(root)
        patched = {
            name: (root / "vllm" / name).read_bytes()
            for name, data in originals.items()
            if data is not None
        }
        again = cli("--apply")
        if again.returncode != 0 or listing(root) != tree_after:
            raise SystemExit(f"0.1.0's second --apply on {version}: {again.stdout}")
        if any((root / "vllm" / n).read_bytes() != d for n, d in patched.items()):
            raise SystemExit(f"0.1.0's second --apply on {version} changed a file")
        back = cli("--revert")
        if back.returncode != 0:
            raise SystemExit(f"0.1.0 --revert on {version}: {back.stdout}")
        for name, data in originals.items():
            path = root / "vllm" / name
            if (path.read_bytes() if path.exists() else None) != data:
                raise SystemExit(f"0.1.0's --revert on {version}: {name} differs")
    files = {}
    for name, old in originals.items():
        if old is None:
            files[name] = {"present": False, "state_before": before[name],
                           "state_after": after[name]}  # fmt: skip
            continue
        new = patched[name]
        hunks = edit_script(old, new) if new != old else []
        newline = newline_of(hunks, new) if hunks else "\n"
        if rebuild(old, hunks, newline) != new:
            raise SystemExit(f"{version} {name}: the edit script does not rebuild")
        ours(hunks, texts, f"{version} {name}")
        lines = {t.strip() for t in old.decode().splitlines()} - {""}
        kept = [t for h in hunks for t in h.get("added", ()) if t.strip() in lines]
        if kept:  # our own text, but the same as a line of vLLM's file
            raise SystemExit(f"{version} {name}: added lines as in vLLM's: {kept}")
        files[name] = {
            "present": True,
            "original_sha256": sha256(old),
            "original_size": len(old),
            "patched_sha256": sha256(new),
            "patched_size": len(new),
            "sidecar": f"vllm/{name}{texts['sidecar']}" in tree_after,
            "state_before": before[name],
            "state_after": after[name],
            "newline": newline,
            "hunks": hunks,
        }
    return {
        "wheel": whl.name,
        "wheel_sha256": sha256(whl.read_bytes()),
        "tree_after_apply": tree_after,
        "files": files,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--releases", nargs="+", default=list(RELEASES))
    p.add_argument("--commit", default=COMMIT, help="release 0.1.0's commit")
    p.add_argument("--wheels", type=Path, default=WHEELS, help="the wheel cache")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{args.commit}^{{commit}}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="capture-guard-010-") as tmp:
        src = extract_010(commit, Path(tmp))
        done = run_010(src, code=TEXTS)
        if done.returncode != 0:
            raise SystemExit(f"0.1.0 did not run: {done.stderr}")
        texts = json.loads(done.stdout)
        if not texts["package"].startswith(str(src)):
            raise SystemExit(f"0.1.0 ran from {texts['package']}, not {src}")
        releases = {}
        for version in args.releases:
            releases[version] = record(src, texts, version, wheel(version, args.wheels))
            files = releases[version]["files"].values()
            hunks = [h for f in files for h in f.get("hunks", ())]
            added = [t for h in hunks for t in h.get("added", ())]
            inserts = [h["insert"] for h in hunks if "insert" in h]
            print(
                f"vLLM {version}: {len(files)} files, {len(hunks)} hunks; "
                f"{len(added)} lines added ({sum(map(len, added))} characters), "
                f"{len(inserts)} inserts ({sum(map(len, inserts))} characters)"
            )
    data = {
        "about": "What vllm-capture-guard 0.1.0 (patch --apply) wrote into each "
        "vLLM release; made by scripts/tree_fixture_010.py, read by "
        "tests/tools/test_tree_010.py. No vLLM line is stored: removed lines "
        "are counted, added lines and inserts are our own text.",
        "commit": commit,
        "version": texts["version"],
        "sidecar_suffix": texts["sidecar"],
        "files": texts["files"],
        "releases": releases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
