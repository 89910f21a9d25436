# SPDX-License-Identifier: Apache-2.0
"""``.buildkite/test-amd.yaml`` cannot rot unnoticed.

The AMD steps run only on MI325 agents, so nothing else would notice a renamed
test, a dropped source path or a misspelt key. This CPU test checks:

* every step against a JSON schema of vLLM's AMD step keys;
* one step on ``mi325_1`` and one on ``mi325_4``, with GPUs to match;
* each step installs the pinned vLLM (the Makefile's ``VLLM_VERSION``) and
  this package, then runs the ROCm tier (``pytest -m rocm``);
* every ``source_file_dependencies`` entry and every path a command names
  exists in the repository;
* every pytest command selects at least one test and sets
  ``CAPTURE_GUARD_REQUIRE_GPUS`` to its pool's GPUs, so that a CI agent
  without ROCm or without those GPUs fails instead of skipping (run here: on a
  CPU host the commands fail with that reason).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / ".buildkite" / "test-amd.yaml"
INSTALL_SCRIPT = "scripts/rocm-ci-env.sh"
AGENT_POOLS = {"mi325_1", "mi325_4"}
REQUIRE = "CAPTURE_GUARD_REQUIRE_GPUS"

#: The step keys of vLLM's .buildkite/test-amd.yaml, as its header documents
#: them, plus ``agent_pool``, ``no_gpu`` and ``grade`` that its steps use.
STEP_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "label",
        "agent_pool",
        "source_file_dependencies",
        "commands",
        "timeout_in_minutes",
    ],
    "properties": {
        "label": {"type": "string", "minLength": 1},
        "agent_pool": {"type": "string", "pattern": r"^mi(250|300|325|355)_[1248]$"},
        "num_gpus": {"type": "integer", "enum": [1, 2, 4, 8]},
        "no_gpu": {"type": "boolean"},
        "mirror_hardwares": {
            "type": "array",
            "items": {"type": "string", "pattern": r"^amd[a-z0-9]+$"},
            "uniqueItems": True,
        },
        "source_file_dependencies": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "minLength": 1},
            "uniqueItems": True,
        },
        "commands": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "minLength": 1},
        },
        "command": {"type": "string"},
        "timeout_in_minutes": {"type": "integer", "minimum": 1, "maximum": 240},
        "optional": {"type": "boolean"},
        "soft_fail": {"type": "boolean"},
        "fast_check": {"type": "boolean"},
        "fast_check_only": {"type": "boolean"},
        "dind": {"type": "boolean"},
        "grade": {"type": "string"},
        "num_nodes": {"type": "integer", "minimum": 1},
        "parallelism": {"type": "integer", "minimum": 1},
        "working_dir": {"type": "string"},
    },
    "not": {"required": ["command", "commands"]},
}

PIPELINE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["steps"],
    "properties": {"steps": {"type": "array", "minItems": 1, "items": STEP_SCHEMA}},
}


def load_steps(path: Path = PIPELINE) -> list[dict]:
    pipeline = yaml.safe_load(path.read_text())
    jsonschema.validate(pipeline, PIPELINE_SCHEMA)
    return pipeline["steps"]


def pinned_vllm() -> str:
    match = re.search(
        r"^VLLM_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M
    )
    assert match, "Makefile has no `VLLM_VERSION ?= ...` line"
    return match.group(1)


def _words(command: str) -> list[str]:
    """The command's words, leading ``NAME=value`` assignments dropped."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words.pop(0)
    return words


def _env(command: str) -> dict[str, str]:
    out = {}
    for word in shlex.split(command):
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
            break
        key, _, value = word.partition("=")
        out[key] = value
    return out


def pytest_args(command: str) -> list[str] | None:
    """The arguments after ``pytest`` / ``python[3] -m pytest``, or None."""
    words = _words(command)
    if words[:1] == ["pytest"]:
        return words[1:]
    python = re.match(r"^python(3(\.\d+)?)?$", words[0]) if words else None
    if python and words[1:3] == ["-m", "pytest"]:
        return words[3:]
    return None


#: pytest options whose next word is a value, not a path.
_VALUE_OPTIONS = {"-k", "-m", "-p", "-o", "--timeout", "--maxfail", "-n", "--tb"}


def named_paths(command: str) -> list[str]:
    """Repository paths that ``command`` names: pytest's positional arguments
    (``::test`` ids stripped), and any other word that looks like a path."""
    args = pytest_args(command)
    if args is not None:
        paths, skip = [], False
        for word in args:
            if skip:
                skip = False
            elif word in _VALUE_OPTIONS:
                skip = True
            elif not word.startswith("-"):
                paths.append(word.split("::")[0])
        return paths
    return [
        w
        for w in _words(command)
        if not w.startswith(("-", "$", "/")) and "://" not in w and "=" not in w
        if "/" in w or w.endswith((".py", ".sh"))
    ]


def _base(step: dict) -> Path:
    wd = step.get("working_dir")
    return ROOT / wd if wd and not wd.startswith("/") else ROOT


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    return load_steps()


def test_pipeline_matches_the_step_schema(steps):
    labels = [s["label"] for s in steps]
    assert len(set(labels)) == len(labels), labels


def test_one_step_per_mi325_pool_with_matching_gpus(steps):
    assert {s["agent_pool"] for s in steps} == AGENT_POOLS
    for step in steps:
        gpus = int(step["agent_pool"].rsplit("_", 1)[1])
        assert step.get("num_gpus", 1) == gpus, step["label"]


def test_each_step_installs_the_pins_then_runs_the_rocm_tier(steps):
    pin = pinned_vllm()
    for step in steps:
        commands = step["commands"]
        installs = [
            i for i, c in enumerate(commands) if INSTALL_SCRIPT in _words(c)[:2]
        ]
        tiers = [
            i
            for i, c in enumerate(commands)
            if (args := pytest_args(c)) is not None
            and "-m" in args
            and args[args.index("-m") + 1] == "rocm"
        ]
        assert installs and tiers, (step["label"], commands)
        assert installs[0] < tiers[0], step["label"]
        env = _env(commands[installs[0]])
        assert env.get("VLLM_VERSION") == pin, (step["label"], env, pin)


def test_every_named_path_exists(steps):
    missing = []
    for step in steps:
        for dep in step["source_file_dependencies"]:
            if not (ROOT / dep).exists():
                missing.append((step["label"], "source_file_dependencies", dep))
        for command in step["commands"]:
            for path in named_paths(command):
                if not (_base(step) / path).exists():
                    missing.append((step["label"], command, path))
    assert not missing, missing


def _run_pytest(step: dict, command: str, **env: str | None):
    """``command``'s pytest arguments, run here with ``env`` over ours."""
    full_env = dict(os.environ)
    for key, value in env.items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args(command)]
        + ["-p", "no:cacheprovider", "-rs"],
        cwd=_base(step),
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    return proc.returncode, out, out.strip().splitlines()[-1]


def test_each_tier_run_requires_its_pools_gpus(steps):
    for step in steps:
        gpus = str(step.get("num_gpus", 1))
        tier = [c for c in step["commands"] if pytest_args(c)]
        assert tier and all(_env(c).get(REQUIRE) == gpus for c in tier), (
            step["label"],
            tier,
        )


def test_pytest_commands_select_tests_and_cannot_skip_in_ci(steps):
    """Each pytest command as written, on this host without ROCm torch: it
    must select tests, and CI's ``CAPTURE_GUARD_REQUIRE_GPUS`` must turn the
    "not a ROCm host" skip into a failure (an agent without ROCm or without
    its GPUs cannot go green). Without that variable the same tests skip, as
    in every CPU run of the whole suite."""
    torch = pytest.importorskip("torch")
    if torch.version.hip is not None:
        pytest.skip("this host has ROCm torch: the commands would start engines")
    commands = [(s, c) for s in steps for c in s["commands"] if pytest_args(c)]
    assert commands
    for step, command in commands:
        code, out, summary = _run_pytest(step, command, **_env(command))
        assert code != 0, (command, summary)
        assert re.search(r"\b\d+ errors?\b", summary), (command, summary)
        assert not re.search(r"\b(passed|skipped)\b", summary), (command, summary)
        assert f"{REQUIRE}={_env(command)[REQUIRE]}, but not a ROCm host" in out
