#!/usr/bin/env python
# SPDX-License-Identifier: Apache-2.0
"""``make newest``: a new vLLM release, checked the day it ships.

1. The newest vLLM release on the package registry (``pip index versions
   vllm`` through this interpreter's pip: the highest final release, a
   pre-release only where there is no final one); ``--release X`` or
   ``NEWEST_VLLM=X`` names one instead, and nothing is asked of the registry.
2. Its environment, built as the version matrix builds one
   (``scripts/make-envs.sh``: ``.envs/vllm-X``, put first on ``PYTHONPATH``).
3. On it, and on the newest release the matrix pins (the last of the
   Makefile's ``ALL_VERSIONS``; ``--pinned``), each in a fresh interpreter of
   that release:

   * ``vllm-capture-guard status --json`` and ``check --json``, as an
     operator runs them (no ``VLLM_CAPTURE_GUARD*`` or ``VLLM_PLUGINS`` from
     this shell);
   * ``vllm-capture-guard audit --json`` with ``VLLM_CAPTURE_GUARD=off``: the
     release's own captures (with the guard on it keeps what they write, and
     the audit would see nothing);
   * vLLM's generic capture test (``upstream/vllm/``) in the release's own
     sdist ``tests/`` tree, run as ``tests/vllm_tree/`` runs it for the
     pinned releases.

4. One drift report (``scripts/newest_report.py``; what each kind means and
   what to do: docs/newest.md).

A release's results are kept in ``.envs/cache/newest/`` (``--cache``), keyed
by the release and this checkout's git HEAD (and its uncommitted changes),
so a second run only reads them; a release where a command could not run is
not kept. Where the two releases are one, its commands run once.

Exit 0: no drift; 1: drift, a maintainer is needed; 2: the newest release
could not be resolved, or an environment could not be built.

    python scripts/newest.py                    # make newest
    python scripts/newest.py --release 0.34.0   # or NEWEST_VLLM=0.34.0
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.vllm_tree: the sdist tree and its run
sys.path.insert(0, str(Path(__file__).resolve().parent))

import newest_report as report  # noqa: E402 (beside this script)

from vllm_capture_guard.lab.oracle import releases  # noqa: E402
from vllm_capture_guard.runtime import switch  # noqa: E402

ENV = "NEWEST_VLLM"
MAKEFILE = ROOT / "Makefile"
CACHE = ROOT / ".envs" / "cache" / "newest"
#: Commands at once (two cores), as the version matrix runs its jobs.
PARALLEL = int(os.environ.get("CAPTURE_GUARD_JOBS", "2"))
#: Seconds one command may take.
TIMEOUT = 900
#: The variables an operator's shell may set that would change what the
#: commands judge; each command sets its own.
SWITCHES = (
    "VLLM_PLUGINS",
    switch.ENV,
    "VLLM_CAPTURE_GUARD_DISABLE",
    # which runner vLLM uses, and how it captures, must be vLLM's own choice
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_USE_BREAKABLE_CUDAGRAPH",
)
#: Each tool command's arguments and the guard mode it runs under (None: as
#: an operator runs it, ``auto``).
TOOLS = {
    "status": (["status", "--json"], None),
    "check": (["check", "--json"], None),
    "audit": (["audit", "--json"], "off"),
}
#: The slowest first, so that two at a time finish together.
ORDER = ("audit", "generic", "check", "status")


class CannotRun(Exception):
    """The newest release could not be resolved, or an environment built."""


# --- which releases -----------------------------------------------------------


def pinned_release(makefile: str) -> str:
    """The newest release the version matrix pins: the last of the
    Makefile's ``ALL_VERSIONS``."""
    found = re.search(r"^ALL_VERSIONS\s*:?=\s*(.+)$", makefile, re.M)
    if not found or not found.group(1).split():
        raise CannotRun("the Makefile sets no ALL_VERSIONS")
    return found.group(1).split()[-1]


def pick_newest(listing: str) -> str:
    """The highest final release in ``pip index versions --pre`` output (its
    ``Available versions:`` line), else the highest pre-release."""
    from packaging.version import InvalidVersion, Version

    found = re.search(r"^Available versions:\s*(.+)$", listing, re.M)
    if not found:
        raise CannotRun(f"pip listed no versions: {report.one_line(listing)}")
    versions = []
    for text in found.group(1).split(","):
        try:
            versions.append(Version(text.strip()))
        except InvalidVersion:
            continue
    finals = [v for v in versions if not v.is_prerelease]  # nor a dev release
    if not (finals or versions):
        raise CannotRun(f"pip listed no version: {report.one_line(found.group(1))}")
    return str(max(finals or versions))


def resolve_newest(asked: str | None) -> tuple[str, str]:
    """(the release, how it was chosen)."""
    if asked:
        return asked, "named by --release"
    if os.environ.get(ENV):
        return os.environ[ENV], f"named by {ENV}"
    args = [sys.executable, "-m", "pip", "index", "versions", "--pre", "vllm"]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise CannotRun(f"pip index versions vllm: {e}") from e
    if proc.returncode != 0:
        raise CannotRun(f"pip index versions vllm: {report.one_line(proc.stderr)}")
    return pick_newest(proc.stdout), "the newest on the package registry"


def build_env(release: str) -> None:
    """``.envs/vllm-X``, as ``make envs`` builds it (quick where it is)."""
    envs = os.environ[releases.ENVS_VAR]
    script = ROOT / "scripts" / "make-envs.sh"
    proc = subprocess.run(
        [str(script), sys.executable, envs, release],
        stdout=sys.stderr,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        why = _last_line(proc.stderr)
        raise CannotRun(f"the environment of vLLM {release} was not built: {why}")


# --- the cache ------------------------------------------------------------------------


def checkout_key() -> str:
    """This checkout's git HEAD and, where it has uncommitted changes to what
    the commands run (the package, upstream/, tests/, scripts/), a digest of
    them."""

    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True)
        return proc.stdout.decode(errors="replace") if proc.returncode == 0 else ""

    head = git("rev-parse", "HEAD").strip()[:12] or "no-git"
    paths = ["--", "src", "upstream", "tests", "scripts"]
    changed = git("diff", "HEAD", "--no-ext-diff", *paths)
    added = sorted(git("ls-files", "-o", "--exclude-standard", *paths).splitlines())
    if not changed and not added:
        return head
    digest = hashlib.sha256(changed.encode())
    for name in added:
        digest.update(name.encode())
        with contextlib.suppress(OSError):  # removed meanwhile
            digest.update((ROOT / name).read_bytes())
    return f"{head}-changed-{digest.hexdigest()[:12]}"


def cache_file(folder: Path, release: str, key: str) -> Path:
    return folder / f"vllm-{release}-{key}.json"


def load_cached(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- running the commands ------------------------------------------------------------


def parse_json(stdout: str) -> dict | None:
    """The one JSON object a ``--json`` command printed (from its first line
    that opens one)."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
    if start is None:
        return None
    try:
        return json.loads("\n".join(lines[start:]))
    except ValueError:
        return None


def run_tool(release: str, name: str) -> dict:
    """``vllm-capture-guard NAME --json`` in a fresh interpreter of
    ``release``: exit status, JSON and, where it could not run, why."""
    args, mode = TOOLS[name]
    overrides = {k: None for k in SWITCHES} | {switch.ENV: mode}
    start = time.monotonic()
    try:
        command = ["-m", "vllm_capture_guard", *args]
        proc = releases.run_in(release, command, overrides, cwd=ROOT, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return outcome(None, None, f"timed out after {TIMEOUT} s", start)
    found = parse_json(proc.stdout)
    if proc.returncode == 2 or found is None:
        why = (found or {}).get("error") or _last_line(proc.stderr or proc.stdout)
        return outcome(proc.returncode, found, why, start)
    wrong = releases.wrong_release(release, str(found.get("vllm")))
    return outcome(proc.returncode, found, wrong, start)


def run_generic(release: str) -> dict:
    """vLLM's generic capture test (and the ROCm instance test beside it) in
    the release's own sdist ``tests/`` tree, as
    ``tests/vllm_tree/test_upstream_regression_test.py`` runs it: one pytest
    process, guard off, Triton's interpreter."""
    from tests.vllm_tree import sdist
    from tests.vllm_tree import test_upstream_regression_test as tree_test

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"newest-{release}-") as tmp:
        try:
            tree = sdist.extract_tests(release, Path(tmp) / "tree")
            for name in (tree_test.INSTANCE, tree_test.GENERIC):
                into = tree / "tests" / "v1" / "attention" / name
                shutil.copyfile(tree_test.OURS / name, into)
            scenario = tree_test.Scenario(release, "stock", True, tree_test.NONE)
            run = tree_test._run(scenario, tree, Path(tmp))
        except Exception as e:  # the sdist, the tree, a time-out
            return outcome(None, None, f"{type(e).__name__}: {e}", start)
    found = {
        "rc": run.rc,
        "instance": tree_test._counts(run.instance) or "none collected",
        "outcomes": _outcomes(run.generic),
        "skips_by_cause": run.skip_causes(),
        "backends": {
            key: {
                "outcome": case.outcome,
                "host_writes": case.props.get("host_writes", ""),
                "text": report.one_line(case.text),
            }
            for key, case in run.generic.items()
        },
    }
    if run.rc not in (0, 1) or not run.generic:
        return outcome(run.rc, found, _last_line(run.output), start)
    return outcome(run.rc, found, None, start)


def _outcomes(cases: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for case in cases.values():
        counts[case.outcome] = counts.get(case.outcome, 0) + 1
    return counts


def outcome(rc: int | None, found: dict | None, why: str | None, start: float):
    seconds = round(time.monotonic() - start)
    return {"rc": rc, "json": found, "reason": why, "seconds": seconds}


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return report.one_line(lines[-1] if lines else "no output", 300)


def run_one(release: str, name: str) -> dict:
    print(f"newest: vLLM {release}: {name} ...", file=sys.stderr, flush=True)
    done = run_generic(release) if name == "generic" else run_tool(release, name)
    print(
        f"newest: vLLM {release}: {name}: exit {done['rc']} in {done['seconds']} s"
        + (f" (could not run: {done['reason']})" if done["reason"] else ""),
        file=sys.stderr,
        flush=True,
    )
    return done


def results_for(wanted: list[str], folder: Path, fresh: bool) -> dict[str, dict]:
    """Each release's results: from the cache, else run (two commands at a
    time); each release once, however often it is named."""
    key = checkout_key()
    found: dict[str, dict] = {}
    for release in dict.fromkeys(wanted):
        cached = None if fresh else load_cached(cache_file(folder, release, key))
        if cached is not None:
            print(f"newest: vLLM {release}: results of {key}, kept", file=sys.stderr)
            found[release] = cached
    todo = [(r, n) for n in ORDER for r in dict.fromkeys(wanted) if r not in found]
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        done = {job: pool.submit(run_one, *job) for job in todo}
        for (release, name), future in done.items():
            found.setdefault(release, {"release": release, "commands": {}})
            found[release]["commands"][name] = future.result()
    for release in {r for r, _ in todo}:
        if all(c["reason"] is None for c in found[release]["commands"].values()):
            folder.mkdir(parents=True, exist_ok=True)
            path = cache_file(folder, release, key)
            path.write_text(json.dumps(found[release]))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--release", help=f"the new release (else ${ENV}, else the registry's newest)"
    )
    parser.add_argument(
        "--pinned", help="the release to compare with (the last of ALL_VERSIONS)"
    )
    parser.add_argument(
        "--cache", type=Path, default=CACHE, help="where results are kept"
    )
    parser.add_argument("--fresh", action="store_true", help="run every command again")
    args = parser.parse_args(argv)
    os.environ.setdefault(releases.ENVS_VAR, str(ROOT / ".envs"))
    os.environ.setdefault("CAPTURE_GUARD_SDIST_CACHE", str(ROOT / ".envs/cache/sdists"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    try:
        pinned = args.pinned or pinned_release(MAKEFILE.read_text())
        newest, how = resolve_newest(args.release)
        print(f"newest: vLLM {newest} ({how}); the matrix pins {pinned}", flush=True)
        for release in dict.fromkeys([pinned, newest]):
            build_env(release)
    except CannotRun as e:
        print(f"newest: could not run: {e}", flush=True)
        return 2
    found = results_for([pinned, newest], args.cache, args.fresh)
    drifts = report.compare(found[pinned], found[newest])
    print("\n".join(report.render(found[pinned], found[newest], drifts)))
    print(f"newest: {round(time.monotonic() - start)} s wall")
    return report.exit_status(drifts)


if __name__ == "__main__":
    sys.exit(main())
