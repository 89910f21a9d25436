#!/usr/bin/env python
# SPDX-License-Identifier: Apache-2.0
"""The version matrix: the guard's verdict and the test suite on each release.

For each vLLM release, in its own environment (``.envs/vllm-X`` first on
``PYTHONPATH``, or the venv's own vLLM; see ``scripts/make-envs.sh``):

0. before any job starts, vLLM's model-info cache of the release is filled
   in one process (:func:`warm_model_info`); every process that the jobs
   start against the release shares that cache
   (``$CAPTURE_GUARD_VLLM_CACHES/vllm-X``, by default ``.envs/cache/vllm``);
1. facts, in one fresh interpreter: the seed capture scenario (every ROCm
   backend x batch) with no plugin loaded, and what the tools read in the
   installed code (the capture-stream sites); then
   ``vllm.plugins.load_general_plugins()`` with ``VLLM_CAPTURE_GUARD=on`` as a
   worker does, what the guard did, the seed scenario again, and what the
   guard saw each builder's capture write;
2. the test suite (pytest), as jobs that run two at a time: each release's
   own tests; the ``oracle`` tests once, with the base venv (they start every
   release themselves), and the ``once`` tests, which do not depend on the
   release (packaging, for instance).

``--write`` writes docs/version-matrix.md (the version table between its
``version-matrix`` markers, then the suite's counts) and docs/durations.md;
``--check`` fails if the table in docs/version-matrix.md is not what this run
found (so it is never typed by hand). The README holds no table: it links the
page. Exit 1 if any test failed.

    python scripts/version_matrix.py --check                  # make test
    python scripts/version_matrix.py --write                  # make matrix
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import difflib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VERSIONS = ("0.27.1", "0.28.0", "0.29.0", "0.33.0", "0.34.0")
#: The page that holds the version table, between the markers.
DOC = ROOT / "docs" / "version-matrix.md"
DURATIONS = ROOT / "docs" / "durations.md"
START, END = "<!-- version-matrix:start -->", "<!-- version-matrix:end -->"
CACHE = ROOT / ".envs" / "cache"
#: Jobs at once: the CI machine has two cores.
PARALLEL = int(os.environ.get("CAPTURE_GUARD_JOBS", "2"))
#: Slowest tests listed per job in docs/durations.md.
SLOWEST = 15

# --- in the release's own environment ----------------------------------------


def _seed_summary(result) -> dict:
    """Per backend: runs, passes and the distinct errors of a ``SeedResult``."""
    out: dict = {}
    for backend, why in result.unavailable.items():
        out[backend] = {"unavailable": why.split(":")[0]}
    for run in result.runs:
        entry = out.setdefault(run.backend, {"ok": 0, "runs": 0, "errors": []})
        entry["runs"] += 1
        entry["ok"] += run.ok
        if not run.ok:
            error = run.error.split(":")[0]
            site = (run.error_site or "").rsplit(":", 1)[0]
            if f"{error} in {site}" not in entry["errors"]:
                entry["errors"].append(f"{error} in {site}")
    return out


def read_facts() -> dict:
    """The patches in the runtime's order, those that name no attention backend
    (the affected cell shows what is read of their sites), and what the tools
    read of each patch's sites (call it before the plugin patches anything)."""
    from vllm_capture_guard.runtime.patches import PATCHES
    from vllm_capture_guard.tools import fixes

    return {
        "patches": [p.name for p in PATCHES],
        "read_only": [p.name for p in PATCHES if not p.backends],
        "read": {
            p.name: [dataclasses.asdict(r) for r in fixes.module_of(p).readings()]
            for p in PATCHES
        },
    }


def facts() -> dict:
    """What the guard finds and does on the vLLM of this interpreter."""
    import vllm.plugins

    from vllm_capture_guard.runtime import plugin, switch
    from vllm_capture_guard.runtime.guard import guarded_call
    from vllm_capture_guard.tools import harness
    from vllm_capture_guard.tools.check import run_seed
    from vllm_capture_guard.tools.harness import runners, seed_backends

    os.environ[switch.ENV] = switch.Mode.ON.value
    runner = runners.choose(harness.make_vllm_config(0, graphs=True))
    unguarded = _seed_summary(run_seed())  # before the plugin loads
    read = read_facts()  # before the plugin patches anything
    vllm.plugins.load_general_plugins()  # as a worker does
    guarded = _seed_summary(run_seed())
    report = plugin.report()
    return {
        "vllm": plugin.vllm_version(),
        "runner": [runner.name, runner.why],
        "backends": list(seed_backends()),
        "unguarded": unguarded,
        **read,
        "guard_action": report.action,
        "outcomes": {
            name: [o.status.value, o.detail] for name, o in report.outcomes.items()
        },
        "wrote": {name: dict(seen.wrote) for name, seen in guarded_call.SEEN.items()},
        "guarded": guarded,
        "in_tree": _in_tree_facts(),
    }


def warm_model_info(in_process: bool = True) -> dict:
    """Fill this release's ``VLLM_CACHE_ROOT`` with vLLM's model-class
    inspections for the tiny models the tools and tests build (each family's
    ``ModelConfig``; the ROCm tier's text-only MiniMax-M3), as vLLM caches
    them after a run. vLLM runs each inspection in a subprocess that imports
    vLLM again, to keep CUDA uninitialised in its own process; here, on a CPU
    host, this process runs them all (``in_process=False``: vLLM's own way,
    which the tests compare it with). Nothing depends on it: a class left out
    is inspected, and cached, by the first process that needs it."""
    from vllm.config import ModelConfig
    from vllm.model_executor.models import registry

    from vllm_capture_guard.tools.harness.model import model_config
    from vllm_capture_guard.tools.harness.models import CONFIGS

    if in_process:
        if not callable(getattr(registry, "_run_in_subprocess", None)):
            return {"warmed": [], "failed": {"all": "vLLM inspects another way"}}
        registry._run_in_subprocess = lambda fn: fn()
    sys.path.insert(0, str(ROOT))
    from tests.rocm.tiny_model import write_engine_model

    def rocm_tier() -> None:
        with tempfile.TemporaryDirectory() as folder:
            model = str(write_engine_model(folder, 1))
            ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=1024)

    builds = {family: lambda f=family: model_config(f) for family in CONFIGS}
    warmed, failed = [], {}
    for name, build in {**builds, "rocm-tier": rocm_tier}.items():
        try:
            build()
            warmed.append(name)
        except Exception as e:  # a family this release lacks, most often
            failed[name] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    return {"warmed": warmed, "failed": failed}


def _warm_in(version: str) -> str:
    """:func:`warm_model_info` in a fresh interpreter of ``version``; what
    happened, in a line (never raises: the jobs inspect what was not warmed)."""
    from vllm_capture_guard.lab.oracle import releases

    start = time.monotonic()
    try:
        proc = releases.run_in(version, [__file__, "--warm"], cwd=ROOT, timeout=600)
        took = f"{time.monotonic() - start:.0f} s"
        if proc.returncode != 0:
            return f"vLLM {version}: not warmed ({took}): {proc.stderr[-300:]}"
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as e:
        return f"vLLM {version}: not warmed: {type(e).__name__}: {e}"
    said = f"vLLM {version}: {len(found['warmed'])} models in {took}"
    if found.get("failed"):
        said += f"; not built: {', '.join(found['failed'])}"
    return said


def _in_tree_facts() -> dict:
    """``vllm-capture-guard patch --check`` on this release's files (reads
    them; imports nothing): applies / nothing to do / refused."""
    from vllm_capture_guard.tools.tree.command import verdict

    return verdict()


# --- driving the releases ----------------------------------------------------


def _facts_in(version: str) -> dict:
    from vllm_capture_guard.lab.oracle import releases
    from vllm_capture_guard.runtime import switch
    from vllm_capture_guard.tools.simulate import triton_interpreter_env

    # as check sets itself up (its choice of runner is among the facts)
    env = {switch.ENV: None, **triton_interpreter_env()}
    proc = releases.run_in(version, [__file__, "--facts"], env, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(
            f"facts on vLLM {version} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    problem = releases.wrong_release(version, result["vllm"])
    if problem:
        raise SystemExit(problem)
    return result


@dataclasses.dataclass(frozen=True)
class Job:
    """One pytest run: ``marks`` selects its tests; ``version`` is the release
    its interpreter runs (``facts``: it also gathers the release's facts for
    the version table)."""

    name: str
    version: str
    marks: str
    facts: bool


#: The jobs' share of the matrix, measured (seconds of one job run alone on
#: the 2-core CI machine); the longest start first.
EXPECTED = {"oracle": 580, "vllm-0.27.1": 300, "vllm-0.28.0": 290, "once": 160,
            "vllm-0.29.0": 270, "vllm-0.33.0": 260, "vllm-0.34.0": 280}  # fmt: skip


def jobs_for(versions: list[str], own: str) -> list[Job]:
    """A job per release (the release's own tests), and, where the venv's own
    release is asked for, the tests that run once: the ``oracle`` set (it
    starts every release itself) and the ``once`` set (release-independent)."""
    found = [Job(f"vllm-{v}", v, "not oracle and not once", True) for v in versions]
    if own in versions:
        found += [
            Job("oracle", own, "oracle", False),
            Job("once", own, "once and not oracle", False),
        ]
    return sorted(found, key=lambda j: -EXPECTED.get(j.name, 100))


def _job_env(job: Job, folder: Path) -> dict[str, str | None]:
    """What a job writes is its own: caches (pip's, the tools') under its own
    ``XDG_CACHE_HOME``, kept between runs in ``.envs/cache``. Two are
    shared: the vLLM sdists, read by two jobs (the in-tree tests, vLLM's
    pre-commit hooks) and written whole or not at all, in
    ``.envs/cache/sdists``; and vLLM's own cache, one per release
    (``.envs/cache/vllm/vllm-X``, ``releases.cache_for``), for every process
    that any job starts against that release: what the suite has vLLM write
    there is its model-class inspections, each file written atomically."""
    from vllm_capture_guard.runtime import switch

    cache = CACHE / job.name
    cache.mkdir(parents=True, exist_ok=True)
    return {
        switch.ENV: None,  # the suite sets the switch itself
        "VLLM_LOGGING_STREAM": os.environ.get("VLLM_LOGGING_STREAM"),
        "XDG_CACHE_HOME": str(cache),
        "CAPTURE_GUARD_SDIST_CACHE": os.environ.get("CAPTURE_GUARD_SDIST_CACHE")
        or str(CACHE / "sdists"),
    }


def _run_tests(job: Job, folder: Path) -> dict:
    from vllm_capture_guard.lab.oracle import releases

    xml = folder / f"pytest-{job.name}.xml"
    log = folder / f"pytest-{job.name}.log"
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}"]
    args += ["-m", job.marks, f"--basetemp={folder / ('tmp-' + job.name)}"]
    start = time.monotonic()
    with log.open("w") as out:
        out.write(f"=== {job.name} (vLLM {job.version}): {' '.join(args)}\n")
        out.flush()
        proc = releases.run_in(
            job.version, args, _job_env(job, folder), cwd=ROOT, timeout=None,
            capture_output=False, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    seconds = time.monotonic() - start
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    skips: dict[str, int] = {}
    slowest = []
    for case in suite.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            reason = (skipped.get("message") or "").removeprefix("Skipped: ")
            skips[reason] = skips.get(reason, 0) + 1
        name = f"{case.get('classname')}::{case.get('name')}"
        slowest.append((round(float(case.get("time") or 0), 1), name))
    tests = int(suite.get("tests"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    skipped = int(suite.get("skipped"))
    return {
        "rc": proc.returncode,
        "passed": tests - failed - skipped,
        "failed": failed,
        "skipped": skipped,
        "skips": skips,
        "seconds": round(seconds),
        "slowest": sorted(slowest, reverse=True)[:SLOWEST],
        "log": log.read_text(),
    }


def run_job(job: Job, folder: Path) -> dict:
    """The job's facts (if any), then its tests; never raises."""
    found: dict = {"job": job}
    start = time.monotonic()
    try:
        if job.facts:
            found["facts"] = _facts_in(job.version)
        found["tests"] = _run_tests(job, folder)
    except BaseException as e:  # reported, counted as a failure
        found["error"] = f"{type(e).__name__}: {e}"
    found["seconds"] = round(time.monotonic() - start)
    return found


# --- rendering ---------------------------------------------------------------


def _capture(summary: dict, backend: str) -> str:
    entry = summary.get(backend)
    if entry is None:
        return "not run"
    if "unavailable" in entry:
        return f"not importable here ({entry['unavailable']} at import)"
    if entry["ok"] == entry["runs"]:
        return f"passes ({entry['ok']}/{entry['runs']})"
    errors = "; ".join(f"`{e}`" for e in entry["errors"])
    return f"**fails** ({entry['runs'] - entry['ok']}/{entry['runs']}: {errors})"


def _wrote(f: dict) -> str:
    """What each builder class's capture wrote, told by the guard from the
    host values it saved before each capture (put back for the other
    builders) during the guarded run."""
    cells = []
    for name, fields in sorted(f["wrote"].items()):
        what = ", ".join(f"`{k}`" for k in fields) or "nothing"
        cells.append(f"{name}: {what}")
    return "<br>".join(cells) or "no capture ran"


def _patches(f: dict) -> str:
    """One line per patch: what the guard did (no outcome: its modules were
    not imported)."""
    cells = []
    for name in f["patches"]:
        status = f["outcomes"].get(name, ["not imported"])[0]
        cells.append(f"{name}: {status}")
    return "<br>".join(cells)


def _read_only(f: dict) -> list[str]:
    """The affected cell's line for each patch that names no attention backend
    (no capture of the seed scenario shows it): what the tools read of its
    sites."""
    lines = []
    for name in f["read_only"]:
        sites = f["read"][name]
        bad = [s["where"] for s in sites if s["needed"]]
        if bad:
            lines.append(f"{name}: **needed** ({len(bad)}/{len(sites)} sites, read)")
        else:
            lines.append(f"{name}: not needed ({len(sites)} sites, read)")
    return lines


def _in_tree(f: dict) -> str:
    entry = f.get("in_tree")
    if entry is None:
        return "not run"
    fixes = [f"{fix}: {state}" for fix, state in entry["fixes"].items()]
    return "<br>".join([entry["verdict"], *fixes])


def table_section(results: dict) -> str:
    """The version table, between its markers, as docs/version-matrix.md
    holds it."""
    affected = {
        v: any(e.get("errors") for e in r["facts"]["unguarded"].values())
        or any(
            s["needed"] for n in r["facts"]["read_only"] for s in r["facts"]["read"][n]
        )
        for v, r in results.items()
    }
    lines = [
        START,
        "<!-- generated by scripts/version_matrix.py --write; do not edit -->",
        "| vLLM | `check` drives | affected (capture, no guard) | guard with "
        "`VLLM_CAPTURE_GUARD=on` | capture with the guard | what the guarded "
        "captures wrote (kept) | in-tree patch (`vllm-capture-guard patch`) |",
        "|---|---|---|---|---|---|---|",
    ]
    for version, r in results.items():
        f = r["facts"]
        unguarded = "<br>".join(
            [f"{b}: {_capture(f['unguarded'], b)}" for b in f["backends"]]
            + _read_only(f)
        )
        guarded = "<br>".join(
            f"{b}: {_capture(f['guarded'], b)}" for b in f["backends"]
        )
        name, why = f["runner"]
        lines.append(
            f"| {version} | {name}<br>({why}) | "
            f"{'**yes**' if affected[version] else 'no'}<br>"
            f"{unguarded} | {f['guard_action']}<br>{_patches(f)} | {guarded} | "
            f"{_wrote(f)} | {_in_tree(f)} |"
        )
    lines.append(END)
    return "\n".join(lines)


def doc(results: dict, once: dict, section: str, total: float, cpu: float) -> str:
    out = [
        "<!-- SPDX-License-Identifier: Apache-2.0 -->",
        "# Version matrix",
        "",
        "Generated by `python scripts/version_matrix.py --write` (`make matrix`) "
        "from a real run on a CPU host; `make test` reruns it and fails if the "
        "table below differs. Capture results are the seed scenario "
        "(ROCm backend builder, then MiniMax-M3's indexer, on shared runner "
        "buffers; 6 batch shapes per backend) on vLLM's real builders.",
        "",
        section,
        "",
        "## Test suite per job",
        "",
        "Each release runs its own tests; the `oracle` set (which starts every "
        "release itself) and the release-independent `once` set run in the "
        f"venv. {PARALLEL} jobs run at a time.",
        "",
        "| job | passed | failed | skipped | seconds |",
        "|---|---|---|---|---|",
    ]
    rows = {f"vLLM {v}": r for v, r in results.items()}
    rows.update({f"{n} (venv)": r for n, r in once.items()})
    for name, r in rows.items():
        t = r["tests"]
        out.append(
            f"| {name} | {t['passed']} | {t['failed']} | {t['skipped']} | "
            f"{t['seconds']} |"
        )
    out += [
        "",
        f"Whole matrix: {round(total)} s wall, {round(cpu)} s CPU (user+sys).",
        "",
        "## Why tests skip",
        "",
    ]
    for name, r in rows.items():
        for reason, n in sorted(r["tests"]["skips"].items()):
            out.append(f"- {name}: {n} x {reason}")
    out += ["", "## What the guard said", ""]
    for version, r in results.items():
        for name, (status, detail) in r["facts"]["outcomes"].items():
            out.append(f"- {version}, `{name}`: {status} ({detail})")
    return "\n".join(out) + "\n"


def durations(done: dict, total: float, cpu: float) -> str:
    """docs/durations.md: each job's slowest tests, from its junit times (what
    ``pytest --durations`` shows), so that the next slow test is visible."""
    out = [
        "<!-- SPDX-License-Identifier: Apache-2.0 -->",
        "# Test durations",
        "",
        "Generated by `make matrix` from the same run as the version table: "
        f"the {SLOWEST} slowest tests of each job (seconds of wall time, setup "
        "included, as junit records them). "
        f"Whole matrix: {round(total)} s wall, {round(cpu)} s CPU.",
    ]
    for name, r in done.items():
        t = r.get("tests")
        if not t:
            continue
        out += ["", f"## {name} ({t['seconds']} s)", "", "| s | test |", "|---|---|"]
        out += [f"| {sec} | `{test}` |" for sec, test in t["slowest"]]
    return "\n".join(out) + "\n"


def _replace_section(text: str, section: str) -> str:
    if START in text and END in text:
        head, rest = text.split(START, 1)
        return head + section + rest.split(END, 1)[1]
    raise SystemExit(f"{DOC.relative_to(ROOT)} has no {START} ... {END} markers")


def stale_table(section: str, page: Path = DOC) -> list[str]:
    """A diff of ``page``'s version table against ``section`` (this run's);
    empty when they are the same (the rest of the page, timings included,
    is not compared)."""
    text = page.read_text()
    wanted = _replace_section(text, section)
    if wanted == text:
        return []
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
    return list(
        difflib.unified_diff(
            text.splitlines(True), wanted.splitlines(True), name, "run"
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the docs pages")
    mode.add_argument(
        "--check", action="store_true", help="the table in the docs must match"
    )
    mode.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)
    mode.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    mode.add_argument("--warm-as-vllm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS))
    args = parser.parse_args(argv)
    if args.facts:
        print(json.dumps(facts()))
        return 0
    if args.warm or args.warm_as_vllm:
        print(json.dumps(warm_model_info(in_process=args.warm)))
        return 0

    from vllm_capture_guard.lab.oracle import releases

    os.environ.setdefault(releases.CACHES_VAR, str(CACHE / "vllm"))
    own = _own_release()
    jobs = jobs_for(list(args.versions), own)
    start, cpu = time.monotonic(), _machine_cpu()
    done: dict[str, dict] = {}
    with (
        tempfile.TemporaryDirectory(prefix="version-matrix-") as tmp,
        concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool,
    ):
        for said in pool.map(_warm_in, args.versions):
            print(f"=== warmed vLLM's model-info cache: {said}", flush=True)
        running = {}
        for job in jobs:
            print(f"=== {job.name} (vLLM {job.version}): queued", flush=True)
            running[pool.submit(run_job, job, Path(tmp))] = job
        for future in concurrent.futures.as_completed(running):
            found = future.result()
            job = found["job"]
            done[job.name] = found
            if "tests" in found:
                print(found["tests"].pop("log"), flush=True)
                for sec, test in found["tests"]["slowest"][:10]:
                    print(f"    {sec:7.1f} s  {test}", flush=True)
            t = found.get("tests", {})
            print(
                f"=== {job.name}: finished in {found['seconds']} s: "
                f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                f"{t.get('skipped', 0)} skipped{_error(found)}",
                flush=True,
            )
    total, cpu = time.monotonic() - start, _machine_cpu() - cpu
    results = {v: done[f"vllm-{v}"] for v in args.versions}
    once = {n: done[n] for n in ("oracle", "once") if n in done}
    broken = [f"{n}: {r['error']}" for n, r in done.items() if "error" in r]
    stale = False
    if not broken:
        section = table_section(results)
        print("\n" + section.replace("<br>", "; "))
        if args.write:
            DOC.parent.mkdir(exist_ok=True)
            DOC.write_text(doc(results, once, section, total, cpu))
            DURATIONS.write_text(durations(done, total, cpu))
            print(f"wrote {DOC.relative_to(ROOT)}, {DURATIONS.relative_to(ROOT)}")
        elif args.check and (diff := stale_table(section)):
            stale = True
            print(
                f"{DOC.relative_to(ROOT)}'s version table is not what this run found:"
            )
            sys.stdout.writelines(diff)
            print("regenerate it with `make matrix` and commit it")
    tests = [r["tests"] for r in done.values() if "tests" in r]
    passed = sum(t["passed"] for t in tests)
    failed = sum(t["failed"] for t in tests) + len(broken)
    skipped = sum(t["skipped"] for t in tests)
    for name, r in done.items():
        t = r.get("tests")
        if t:
            print(
                f"{name}: {t['passed']} passed, {t['failed']} failed, "
                f"{t['skipped']} skipped in {t['seconds']} s"
            )
    for line in broken:
        print(f"job failed: {line}")
    load = os.getloadavg()[0]
    print(
        f"matrix time: {round(total)} s wall, {round(cpu)} s machine CPU "
        f"(user+sys), load average {load:.1f}"
    )
    print(f"version-matrix: {passed} passed, {failed} failed, {skipped} skipped")
    bad = failed or any(t["rc"] != 0 for t in tests)
    return 1 if bad or stale else 0


def _error(found: dict) -> str:
    return f"; job failed: {found['error'][-2000:]}" if "error" in found else ""


def _machine_cpu() -> float:
    """CPU seconds (user+sys, all cores) this machine has spent so far: what
    the run costs, forked and orphaned processes included (nothing else runs
    on a CI machine)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6))  # user nice sys irqs
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        t = os.times()
        return t.children_user + t.children_system


def _own_release() -> str:
    """The release the venv itself holds (no ``PYTHONPATH`` in front)."""
    proc = subprocess.run(
        [sys.executable, "-c", "from importlib.metadata import version as v; "
         "print(v('vllm'))"],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return proc.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
