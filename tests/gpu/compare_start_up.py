# SPDX-License-Identifier: Apache-2.0
"""The guard's start-up cost, this checkout's runtime beside a baseline's, on
one GPU host: ``tests/gpu/start_up_cost.py`` in a new interpreter for each of
unguarded, the baseline's runtime and this one's, in turn, ``--rounds`` times,
on the V1 path (0.28.0) and on Model Runner V2 (0.28.0, and 0.34.0 where its
tree is given). Only ``vllm_capture_guard/runtime`` differs between the two
guarded runs (``--baseline-src``: this checkout's ``src`` with the baseline's
runtime in it); tools and tests are this checkout's.

The cost of each is its least guarded start-up minus the least unguarded
one. Unguarded, 0.28.0 crashes at capture (the bug), so there the reference
is the in-tree form: a copy of that vLLM patched by ``patch --apply``, guard
off. On 0.34.0 it is stock vLLM, guard off.
Written to ``--out``: every run, and per path and backend the two costs in
milliseconds and their ratio (the goal: this checkout at most 1.05 times the
baseline).

    python -m tests.gpu.compare_start_up --baseline-src B --head-src H --out f.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLATFORM_ONLY = "capture_guard_gpu_tier"  # VLLM_PLUGINS: no general plugin
#: (name, --path, the vLLM tree's release or None for the installed one, env)
PATHS = (
    ("v1-0.28.0", "v1", None, {}),
    ("v2-0.28.0", "v2", None, {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    ("v2-0.34.0", "v2", "0.34.0", {}),
)
VARIANTS = ("off", "baseline", "head")


def in_tree_copy(scratch: Path) -> Path:
    """A copy of the installed vLLM with the in-tree fix applied: its folder."""
    installed = Path(importlib.util.find_spec("vllm").origin).parent
    copy = scratch / "in-tree"
    shutil.copytree(
        installed, copy / "vllm", ignore=shutil.ignore_patterns("__pycache__")
    )
    patch = [sys.executable, "-m", "vllm_capture_guard", "patch"]
    for mode, want in (("--apply", 0), ("--check", 0)):
        done = subprocess.run(
            [*patch, mode, "--tree", str(copy / "vllm")], capture_output=True, text=True
        )
        if done.returncode != want:
            raise SystemExit(
                f"patch {mode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
    return copy


def _run(args, path: tuple, variant: str, out: Path) -> dict:  # noqa: ANN001
    name, mode, release, extra = path
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    parts = env.get("PYTHONPATH", "").split(os.pathsep)
    if variant == "off" and release is None:  # the installed release: in-tree fix
        parts.insert(0, str(args.in_tree))
    if variant == "baseline":  # the same path, the baseline's runtime in src
        parts = [args.baseline_src if p == args.head_src else p for p in parts]
        assert args.baseline_src in parts, parts
    if release is not None:
        parts.insert(0, str(Path(args.trees) / f"vllm-{release}"))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    if variant == "off":
        env.update(VLLM_CAPTURE_GUARD="off", VLLM_PLUGINS=PLATFORM_ONLY)
    else:
        env["VLLM_CAPTURE_GUARD"] = "on"
        env.pop("VLLM_PLUGINS", None)
    cmd = [sys.executable, "-m", "tests.gpu.start_up_cost", "--path", mode]
    cmd += ["--guard", "off" if variant == "off" else "on", "--out", str(out)]
    cmd += ["--repeat", str(args.repeat)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} {variant}: {done.stderr[-4000:]}")
    return json.loads(out.read_text())


def summary(runs: list[dict]) -> dict:
    """Per path and backend: the least of each variant, the costs, the ratio."""
    found: dict = {}
    for run in runs:
        for backend, figures in run["result"].items():
            if not isinstance(figures, dict):
                continue
            entry = found.setdefault(run["path"], {}).setdefault(backend, {})
            least = entry.get(run["variant"], float("inf"))
            entry[run["variant"]] = min(least, figures["least_s"])
    for backends in found.values():
        for entry in backends.values():
            entry["baseline_ms"] = (entry["baseline"] - entry["off"]) * 1e3
            entry["head_ms"] = (entry["head"] - entry["off"]) * 1e3
            if entry["baseline_ms"] > 0:
                entry["ratio"] = entry["head_ms"] / entry["baseline_ms"]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", required=True)
    ap.add_argument("--head-src", required=True)
    ap.add_argument("--trees", default=os.environ.get("GPU_TIER_VLLM_TREES", ""))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--paths", default=",".join(p[0] for p in PATHS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    paths = [p for p in PATHS if p[0] in args.paths.split(",")]
    trees = Path(args.trees)
    paths = [p for p in paths if p[2] is None or (trees / f"vllm-{p[2]}").is_dir()]
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        args.in_tree = in_tree_copy(Path(scratch))
        for round_ in range(args.rounds):
            for path in paths:
                # the order turns each round, so that drift falls on every variant
                turn = round_ % len(VARIANTS)
                for variant in VARIANTS[turn:] + VARIANTS[:turn]:
                    out = Path(scratch) / f"{path[0]}-{variant}-{round_}.json"
                    result = _run(args, path, variant, out)
                    run = {"round": round_, "path": path[0], "variant": variant}
                    runs.append({**run, "result": result})
                    print(f"round {round_} {path[0]} {variant}", flush=True)
    found = {"rounds": args.rounds, "repeat": args.repeat, "runs": runs}
    found["summary"] = summary(runs)
    Path(args.out).write_text(json.dumps(found, indent=1))
    print(json.dumps(found["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
