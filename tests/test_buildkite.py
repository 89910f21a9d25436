# SPDX-License-Identifier: Apache-2.0
"""The downstream AMD jobs, checked on every CPU run.

* ``.buildkite/rocm-tier.yml`` (a plain Buildkite pipeline) and
  ``.github/workflows/rocm-tier.yml`` (self-hosted runners) pass
  ``check-jsonschema`` with its built-in ``vendor.buildkite`` and
  ``vendor.github-workflows`` schemas, which ship inside the package (checked
  here with every proxy pointing nowhere), and a broken copy of each fails.
* Both run ``scripts/rocm-tier.sh`` for TP 1 and 4 and nothing else; the
  script's ``docker run`` (dry run) passes the GPUs as vLLM's ROCm docs do, on
  the pinned image, and runs the tier's commands, which select tests and
  cannot go green on a host without ROCm or without the GPUs.
* ``docs/runbook-rocm.md`` shows the very commands the jobs run.
* ``scripts/rocm-ci-env.sh``: what it installs, and where it stops.
* Nothing in the repository describes a vLLM CI template shape or gate again
  (the jobs are for an image builder's own agents, not vLLM's template).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.rocm.test_async_copies import CASES as ASYNC_CASES

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / ".buildkite" / "rocm-tier.yml"
WORKFLOW = ROOT / ".github" / "workflows" / "rocm-tier.yml"
SCRIPT = "scripts/rocm-tier.sh"
INSTALL_SCRIPT = "scripts/rocm-ci-env.sh"
RUNBOOK = ROOT / "docs" / "runbook-rocm.md"
REQUIRE = "CAPTURE_GUARD_REQUIRE_GPUS"
SCHEMAS = {PIPELINE: "vendor.buildkite", WORKFLOW: "vendor.github-workflows"}
DEAD_PROXY = "http://127.0.0.1:9"


def _check_jsonschema(schema: str, path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("check-jsonschema")
    tool = str(exe) if exe.exists() else shutil.which("check-jsonschema")
    assert tool, "check-jsonschema is not installed (requirements/cpu.txt)"
    offline = {k: DEAD_PROXY for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    offline |= {k.lower(): v for k, v in offline.items()}
    return subprocess.run(
        [tool, "--builtin-schema", schema, str(path)],
        env={**os.environ, **offline, "NO_PROXY": "", "no_proxy": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("path", sorted(SCHEMAS), ids=lambda p: p.name + p.parent.name)
def test_passes_check_jsonschemas_builtin_schema_offline(path):
    proc = _check_jsonschema(SCHEMAS[path], path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok -- validation done" in proc.stdout


BROKEN = {
    # a step key Buildkite does not know, and a timeout that is not a number
    PIPELINE: lambda d: d["steps"][0].update(timeout_in_minutes="soon", gpus=1),
    # a job without runs-on, and a step that is neither `uses` nor `run`
    WORKFLOW: lambda d: (
        d["jobs"]["rocm-tier"].pop("runs-on"),
        d["jobs"]["rocm-tier"]["steps"].append({"name": "nothing"}),
    ),
}


@pytest.mark.parametrize("path", sorted(SCHEMAS), ids=lambda p: p.name + p.parent.name)
def test_a_broken_copy_fails_the_same_check(path, tmp_path):
    data = yaml.safe_load(path.read_text())
    BROKEN[path](data)
    copy = tmp_path / path.name
    copy.write_text(yaml.safe_dump(data))
    proc = _check_jsonschema(SCHEMAS[path], copy)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Schema validation errors" in proc.stdout + proc.stderr


def _pipeline_commands() -> dict[int, str]:
    steps = yaml.safe_load(PIPELINE.read_text())["steps"]
    out = {}
    for step in steps:
        words = shlex.split(step["command"])
        assert words[:2] == ["bash", SCRIPT], step
        out[int(words[2])] = step["agents"]["queue"]
    return out


def test_the_pipeline_runs_tp1_and_tp4_through_the_script():
    queues = _pipeline_commands()
    assert sorted(queues) == [1, 4]
    assert queues[1] != queues[4]  # one-GPU and four-GPU agents


def test_the_workflow_runs_the_same_script_and_starts_only_by_hand():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    # PyYAML reads the key `on` as True
    assert set(workflow[True]) == {"workflow_dispatch"}
    job = workflow["jobs"]["rocm-tier"]
    assert job["strategy"]["matrix"]["tp"] == [1, 4]
    assert "self-hosted" in job["runs-on"]
    (run,) = [s["run"] for s in job["steps"] if "run" in s]
    assert "bash scripts/rocm-tier.sh ${{ matrix.tp }}" in run


def _dry_run(*args: str, **env: str) -> list[list[str]]:
    proc = subprocess.run(
        ["bash", SCRIPT, *args],
        cwd=ROOT,
        env={**os.environ, "CAPTURE_GUARD_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def _image_env() -> dict[str, str]:
    text = (ROOT / ".buildkite" / "scripts" / "image.env").read_text()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)=(?:\$\{\w+:-)?([^}\s]+)\}?$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _tier_commands(tp: int) -> list[str]:
    """The commands the job runs inside the container for ``tp``."""
    run = _dry_run(str(tp))[1]
    return run[-1].split(" && ")


@pytest.mark.parametrize("tp", [1, 4])
def test_the_script_runs_the_tier_in_the_pinned_image_with_the_gpus(tp):
    image = _image_env()["CAPTURE_GUARD_IMAGE"]
    mount = _image_env()["CAPTURE_GUARD_MOUNT"]
    assert re.fullmatch(r"vllm/vllm-openai-rocm:v0\.28\.0@sha256:[0-9a-f]{64}", image)
    pull, run = _dry_run(str(tp))
    assert pull == ["docker", "pull", image]
    assert run[:3] == ["docker", "run", "--rm"]
    devices = [run[i + 1] for i, w in enumerate(run) if w == "--device"]
    assert devices == ["/dev/kfd", "/dev/dri"]
    assert run[run.index("--group-add") + 1] == "video"
    assert "--ipc=host" in run
    assert f"{ROOT}:{mount}:ro" in run  # nothing written into the checkout
    assert run[run.index("-w") + 1] == mount
    # the image's entrypoint is `vllm serve`: replaced by bash
    assert run[run.index("--entrypoint") + 1] == "/bin/bash"
    assert run[-3:-1] == [image, "-c"]
    prepare, tier = _tier_commands(tp)
    assert prepare == f"VLLM_VERSION=0.28.0 bash {INSTALL_SCRIPT}"
    assert tier == (
        f"{REQUIRE}={tp} python3 -m pytest -v -s -m rocm -k tp{tp} "
        "tests/rocm/test_engine_startup.py tests/rocm/test_async_copies.py"
    )


def test_the_script_takes_an_image_builders_image_and_refuses_other_tp():
    pull, run = _dry_run("1", CAPTURE_GUARD_IMAGE="example/own:nightly")
    assert pull[-1] == "example/own:nightly" and "example/own:nightly" in run
    run = _dry_run("1", VLLM_VERSION="installed")[1]
    assert run[-1].startswith(f"VLLM_VERSION=installed bash {INSTALL_SCRIPT} && ")
    proc = subprocess.run(["bash", SCRIPT, "2"], cwd=ROOT, capture_output=True)
    assert proc.returncode == 2


def test_the_pinned_digest_says_how_far_it_is_verified():
    note = "corroborated by public material (three times), not verified"
    env = (ROOT / ".buildkite" / "scripts" / "image.env").read_text()
    assert note in " ".join(env.replace("#", " ").split())
    assert note in " ".join(RUNBOOK.read_text().split())


def test_the_runbook_shows_the_commands_the_jobs_run():
    text = RUNBOOK.read_text()
    for tp in (1, 4):
        assert f"bash {SCRIPT} {tp}" in text
        for command in _tier_commands(tp):
            assert command in text, command
    # the script's own docker run, flag for flag
    flags = "--device /dev/kfd --device /dev/dri --group-add video --ipc=host"
    assert flags in " ".join(text.replace("\\\n", " ").split())


def _env(command: str) -> dict[str, str]:
    out = {}
    for word in shlex.split(command):
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
            break
        key, _, value = word.partition("=")
        out[key] = value
    return out


def test_tier_commands_select_tests_and_cannot_skip_without_the_gpus():
    """Each tier command as the job runs it, here from the repository root
    (the mount's stand-in) on a host without ROCm torch: it must select tests,
    and ``CAPTURE_GUARD_REQUIRE_GPUS`` must turn the "not a ROCm host" skip
    into errors, so an agent without ROCm or without its GPUs cannot go green."""
    torch = pytest.importorskip("torch")
    if torch.version.hip is not None:
        pytest.skip("this host has ROCm torch: the commands would start engines")
    for tp in (1, 4):
        command = _tier_commands(tp)[1]
        words = shlex.split(command)[1:]
        assert words[:3] == ["python3", "-m", "pytest"]
        proc = subprocess.run(
            [sys.executable, *words[1:], "-p", "no:cacheprovider", "-rs"],
            cwd=ROOT,
            env={**os.environ, **_env(command)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        out = proc.stdout + proc.stderr
        summary = proc.stdout.strip().splitlines()[-1]  # pytest's (stderr: torch's)
        assert proc.returncode != 0, (command, summary)
        # the engine tests at that TP size; at TP 1 also the async-copy cases
        errors = {1: 8 + len(ASYNC_CASES), 4: 8}[tp]
        assert re.search(rf"\b{errors} errors?\b", summary), (command, summary)
        assert not re.search(r"\b(passed|skipped)\b", summary), (command, summary)
        assert f"{REQUIRE}={tp}, but not a ROCm host" in out


# --- scripts/rocm-ci-env.sh ----------------------------------------------------


def _env_script(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", INSTALL_SCRIPT, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("version", ["0.27.0", "0.27.1", "0.28.0"])
def test_rocm_wheel_of_the_affected_releases_is_rocm723(version):
    proc = _env_script("--print-wheel-command", VLLM_VERSION=version)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[1:] == [
        "-m",
        "pip",
        "install",
        f"vllm=={version}+rocm723",
        "--extra-index-url",
        f"https://wheels.vllm.ai/rocm/{version}/rocm723",
    ]


def test_rocm_wheel_of_another_release_needs_its_variant_named():
    proc = _env_script("--print-wheel-command", VLLM_VERSION="0.29.0")
    assert proc.returncode != 0 and "set VLLM_ROCM_VARIANT" in proc.stderr
    proc = _env_script(
        "--print-wheel-command", VLLM_VERSION="0.29.0", VLLM_ROCM_VARIANT="rocm999"
    )
    assert "vllm==0.29.0+rocm999" in proc.stdout


def test_rocm_env_uses_the_installed_vllm_and_stops_on_a_non_rocm_torch():
    """Here (a CPU venv: CUDA-build torch, Python 3.11) it must stop before
    installing anything, naming the reason."""
    proc = _env_script(VLLM_VERSION="installed")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "is not a ROCm build" in proc.stderr
    assert "pip install" not in proc.stdout + proc.stderr


def test_rocm_env_installs_vllm_only_into_a_fresh_python_312():
    proc = _env_script(VLLM_VERSION="0.28.0", CAPTURE_GUARD_INSTALL_VLLM="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    if sys.version_info[:2] != (3, 12):
        assert "built for Python 3.12 only" in proc.stderr
    else:  # this venv holds torch and vLLM: the wheel would replace torch
        assert "already installed here" in proc.stderr


def test_rocm_env_installs_only_this_package_and_pytest_besides_the_wheel():
    """Static: what the script may install. The ROCm wheel (which brings torch)
    only in the CAPTURE_GUARD_INSTALL_VLLM branch; otherwise this package with
    --no-deps and pytest, and nothing that names vLLM or torch."""
    text = (ROOT / INSTALL_SCRIPT).read_text()
    code = [ln.strip() for ln in text.splitlines() if not ln.strip().startswith("#")]
    installs = [ln for ln in code if '"${pip[@]}"' in ln and "=(" not in ln]
    assert len(installs) == 2, installs
    assert any("--no-deps" in ln and '"$scratch"' in ln for ln in installs)
    assert any("'pytest>=8'" in ln for ln in installs)
    assert not any("torch" in ln or "vllm" in ln for ln in installs)
    install_branch = text.split('"${CAPTURE_GUARD_INSTALL_VLLM:-0}" == "1" ]]; then')[1]
    install_branch = install_branch.split("\nelse\n")[0]
    assert [ln for ln in code if ln == "$command"] == ["$command"]
    assert "$command" in install_branch


# --- no vLLM-template shape or gate is claimed --------------------------------

#: What the removed vLLM-template shape said. ``soft_fail`` and ``mi325`` may be
#: named (e.g. "every AMD step is soft_fail: true"), never promised for us.
TEMPLATE_SHAPE = (
    "grade: Blocking",
    "Blocking",
    "agent_pool",
    "mirror_hardwares",
    "run-amd-test.sh",
    "ci-bake.sh",
    "test-amd-step.yaml",
    "vllm-amd-ci",
    "mapped by the template",
)


def test_nothing_promises_the_removed_template_shape():
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if path == Path(__file__) or path.suffix not in {
            ".md", ".py", ".sh", ".yml", ".yaml", ".toml", ".env", ""
        } or not path.is_file():  # fmt: skip
            continue
        text = path.read_text(errors="replace")
        found += [f"{name}: {s}" for s in TEMPLATE_SHAPE if s in text]
    assert not found, found
