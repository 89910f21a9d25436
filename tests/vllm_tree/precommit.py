# SPDX-License-Identifier: Apache-2.0
"""vLLM's own pre-commit hooks on the files we write for its tree.

``upstream/vllm/`` holds files as they would sit in vLLM's tree. vLLM's sdist
carries its ``.pre-commit-config.yaml`` and ``tools/pre_commit/``; this runs
the hooks of that config named in :data:`HOOKS` on those files, laid into a
copy of the release's sdist tree, as ``pre-commit run --files <our files>``
would there:

* in the order the config lists them, each on the files its ``files``,
  ``exclude`` and ``types`` select, with the ``args`` the config gives it;
* a hook of a hook repository (ruff, typos) runs that repository's ``entry``
  (:data:`REPO_HOOKS`, read from its ``.pre-commit-hooks.yaml`` at the pinned
  ``rev``) from the package registry's release of the tool at that ``rev``
  (``requirements/upstream-hooks.txt``, installed once into
  ``.tools/upstream-hooks-<digest>/``): pre-commit itself would clone the
  repository from GitHub, and this needs the package registry alone;
* a local hook (``language: python``) runs the config's ``entry`` with this
  interpreter, the tool folder first on ``PYTHONPATH`` (its
  ``additional_dependencies`` must be pinned there);
* a hook fails, as under pre-commit, when it exits non-zero or changes a file.

Nothing of vLLM's is stored here: the config and the scripts are read from the
sdist (``tests/vllm_tree/sdist.py``, the cache the in-tree tests use) at run
time.

    python -m tests.vllm_tree.precommit             # make upstream-hooks
    python -m tests.vllm_tree.precommit --rev HEAD  # as committed
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import yaml

from tests.vllm_tree import sdist

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "upstream" / "vllm"
#: upstream/vllm/ files that are not files of vLLM's tree (the PR's text).
NOT_IN_TREE = frozenset({"PR.md"})
REQUIREMENTS = ROOT / "requirements" / "upstream-hooks.txt"
RELEASE = "0.33.0"
#: The hooks of vLLM's config that run, by id.
HOOKS = (
    "ruff-check",
    "ruff-format",
    "typos",
    "check-test-tethering",
    "check-spdx-header",
)


@dataclasses.dataclass(frozen=True)
class RepoHook:
    """A hook as its repository's ``.pre-commit-hooks.yaml`` defines it."""

    package: str  # on the package registry, released at the repository's rev
    entry: str
    args: tuple[str, ...]  # used where the config gives none
    types: tuple[str, ...] = ()
    types_or: tuple[str, ...] = ()


#: (repository, hook id) -> its definition, at the revs vLLM 0.33.0 pins
#: (ruff-pre-commit v0.14.0, typos v1.43.5).
REPO_HOOKS = {
    ("https://github.com/astral-sh/ruff-pre-commit", "ruff-check"): RepoHook(
        "ruff", "ruff check --force-exclude", (), types_or=("python", "pyi", "jupyter")
    ),
    ("https://github.com/astral-sh/ruff-pre-commit", "ruff-format"): RepoHook(
        "ruff", "ruff format --force-exclude", (), types_or=("python", "pyi", "jupyter")
    ),
    ("https://github.com/crate-ci/typos", "typos"): RepoHook(
        "typos", "typos", ("--write-changes", "--force-exclude"), types=("text",)
    ),
}

#: What pre-commit's ``identify`` calls a file, for the suffixes we write.
TAGS = {
    ".py": {"python"},
    ".pyi": {"pyi"},
    ".md": {"markdown"},
    ".yaml": {"yaml"},
    ".yml": {"yaml"},
    ".rs": {"rust"},
    ".proto": {"proto"},
    ".sh": {"shell"},
    ".txt": {"plain-text"},
}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", requirement).lower()


def pins() -> dict[str, str]:
    """``requirements/upstream-hooks.txt``: normalised name -> version."""
    found = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[_name(name)] = version.strip()
    return found


def tools() -> Path:
    """The folder holding the pinned tools, installed on first use."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    folder = ROOT / ".tools" / f"upstream-hooks-{digest}"
    if (folder / ".ready").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
            + ["--disable-pip-version-check", "--only-binary", ":all:"]
            + ["--target", str(partial), "-r", str(REQUIREMENTS)],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"installing {REQUIREMENTS.name}: {proc.stderr[-2000:]}")
        (partial / ".ready").touch()
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def lay_tree(dest: Path, release: str = RELEASE) -> Path:
    """A copy of vLLM ``release``'s sdist tree under ``dest``; its root."""
    with tarfile.open(sdist.fetch(release)) as tar:
        tar.extractall(dest, filter="data")
    root = dest / f"{sdist.PROJECT}-{release}"
    if not (root / ".pre-commit-config.yaml").is_file():
        raise LookupError(f"vLLM {release}'s sdist holds no .pre-commit-config.yaml")
    return root


def ours(rev: str | None = None) -> dict[str, bytes]:
    """upstream/vllm/'s files of vLLM's tree, path in the tree -> content: as
    they are in the work tree, or as committed at git revision ``rev``."""
    if rev is None:
        paths = [p.relative_to(ROOT).as_posix() for p in UPSTREAM.rglob("*")]
        paths = [p for p in paths if (ROOT / p).is_file()]
    else:
        listing = ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev]
        out = subprocess.run(listing + ["--", "upstream/vllm/"], check=True,
                             capture_output=True, text=True)  # fmt: skip
        paths = out.stdout.splitlines()
    found = {}
    prefix = UPSTREAM.relative_to(ROOT).as_posix() + "/"
    for path in sorted(paths):
        inside = path.removeprefix(prefix)
        if inside in NOT_IN_TREE:
            continue
        if rev is None:
            found[inside] = (ROOT / path).read_bytes()
        else:
            show = ["git", "-C", str(ROOT), "show", f"{rev}:{path}"]
            found[inside] = subprocess.run(show, check=True, capture_output=True).stdout
    return found


@dataclasses.dataclass
class Hook:
    id: str
    command: list[str]  # before the file names
    pass_filenames: bool
    files: str
    exclude: str
    types: tuple[str, ...]
    types_or: tuple[str, ...]
    exclude_types: tuple[str, ...]
    version: str  # the tool and its version, or the local hook's script

    def selects(self, path: str, global_exclude: str) -> bool:
        suffix = Path(path).suffix
        if suffix not in TAGS:
            raise ValueError(f"{path}: which pre-commit types it has is not known")
        tags = {"file", "text"} | TAGS[suffix]
        return bool(
            re.search(self.files, path)
            and not re.search(self.exclude, path)
            and not (global_exclude and re.search(global_exclude, path))
            and all(t in tags for t in self.types)
            and (not self.types_or or any(t in tags for t in self.types_or))
            and not any(t in tags for t in self.exclude_types)
        )


def hooks(tree: Path, tool_dir: Path) -> tuple[list[Hook], str]:
    """:data:`HOOKS` as the tree's config defines them, in its order, and the
    config's global ``exclude``."""
    config = yaml.safe_load((tree / ".pre-commit-config.yaml").read_text())
    pinned = pins()
    found = []
    for repo in config["repos"]:
        for spec in repo["hooks"]:
            if spec["id"] not in HOOKS:
                continue
            if repo["repo"] == "local":
                if spec["language"] != "python":
                    raise ValueError(f"{spec['id']}: language {spec['language']}")
                for dep in spec.get("additional_dependencies", []):
                    if _name(dep) not in pinned:
                        raise LookupError(
                            f"{spec['id']} needs {dep}: pin it in {REQUIREMENTS.name}"
                        )
                entry = shlex.split(spec["entry"])
                if entry[0] != "python":
                    raise ValueError(f"{spec['id']}: entry {spec['entry']}")
                command = [sys.executable, *entry[1:]]
                defaults = RepoHook("", "", ())
                version = f"{entry[1]} of vLLM {tree.name.rsplit('-', 1)[1]}"
            else:
                defaults = REPO_HOOKS[(repo["repo"], spec["id"])]
                want = str(repo["rev"]).removeprefix("v")
                if pinned.get(defaults.package) != want:
                    raise LookupError(
                        f"vLLM's config pins {defaults.package} {want} "
                        f"({repo['repo']} rev {repo['rev']}); "
                        f"{REQUIREMENTS.name} pins {pinned.get(defaults.package)}"
                    )
                entry = shlex.split(defaults.entry)
                command = [str(tool_dir / "bin" / entry[0]), *entry[1:]]
                version = f"{defaults.package} {want}"
            args = spec.get("args", list(defaults.args))
            found.append(
                Hook(
                    id=spec["id"],
                    command=command + [str(a) for a in args],
                    pass_filenames=spec.get("pass_filenames", True),
                    files=spec.get("files", ""),
                    exclude=spec.get("exclude", "^$"),
                    types=tuple(spec.get("types", defaults.types or ("file",))),
                    types_or=tuple(spec.get("types_or", defaults.types_or)),
                    exclude_types=tuple(spec.get("exclude_types", ())),
                    version=version,
                )
            )
    missing = set(HOOKS) - {h.id for h in found}
    if missing:
        raise LookupError(f"vLLM's config has no hook {sorted(missing)}")
    return found, config.get("exclude", "")


@dataclasses.dataclass
class Result:
    hook: str
    version: str
    files: list[str]  # the files the hook was given
    returncode: int
    changed: list[str]  # the files it changed
    output: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.changed

    def line(self) -> str:
        if self.passed:
            verdict = "Passed"
        else:
            why = [f"exit {self.returncode}"] if self.returncode else []
            why += [f"changed {', '.join(self.changed)}"] if self.changed else []
            verdict = f"Failed ({'; '.join(why)})"
        files = len(self.files)
        return (
            f"{self.hook} ({self.version}): {verdict}, {files} file(s), "
            f"{self.seconds:.2f} s"
        )


def run(tree: Path, files: dict[str, bytes], tool_dir: Path) -> list[Result]:
    """Lay ``files`` into ``tree``, run the hooks on them in the config's order,
    and take them out again (the tree is as it was after)."""
    selected, global_exclude = hooks(tree, tool_dir)
    before = {}
    for path, content in files.items():
        target = tree / path
        before[path] = target.read_bytes() if target.exists() else None
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(tool_dir), PYTHONNOUSERSITE="1", NO_COLOR="1")
    results = []
    try:
        for hook in selected:
            given = [p for p in files if hook.selects(p, global_exclude)]
            if hook.pass_filenames and not given:
                continue
            old = {p: (tree / p).read_bytes() for p in given}
            start = time.monotonic()
            proc = subprocess.run(
                hook.command + (given if hook.pass_filenames else []),
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            seconds = time.monotonic() - start
            changed = [p for p in given if (tree / p).read_bytes() != old[p]]
            results.append(
                Result(
                    hook.id,
                    hook.version,
                    given,
                    proc.returncode,
                    changed,
                    (proc.stdout + proc.stderr).strip(),
                    seconds,
                )
            )
    finally:
        for path, content in before.items():
            if content is None:
                (tree / path).unlink(missing_ok=True)
            else:
                (tree / path).write_bytes(content)
    return results


def report(results: Iterable[Result]) -> str:
    lines = []
    for r in results:
        lines.append(r.line())
        if not r.passed and r.output:
            lines += [f"    {line}" for line in r.output.splitlines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rev", help="take upstream/vllm/ as committed at this git revision"
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    files = ours(args.rev)
    tool_dir = tools()
    with tempfile.TemporaryDirectory(prefix="vllm-hooks-") as tmp:
        tree = lay_tree(Path(tmp))
        results = run(tree, files, tool_dir)
    where = f"upstream/vllm/ at {args.rev}" if args.rev else "upstream/vllm/"
    print(f"vLLM {RELEASE}'s pre-commit hooks on {where}: {', '.join(files)}")
    print(report(results))
    failed = [r.hook for r in results if not r.passed]
    seconds = time.monotonic() - start
    verdict = f"failed: {', '.join(failed)}" if failed else "all passed"
    print(f"{verdict} ({seconds:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
