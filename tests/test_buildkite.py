# SPDX-License-Identifier: Apache-2.0
"""The two AMD CI shapes, checked against the rules of the template that
renders them, so that neither can rot unnoticed on a CPU host.

* ``upstream/vllm-amd-ci/test-amd-step.yaml``: steps for vLLM's own
  ``.buildkite/test-amd.yaml``, running the regression test that
  ``upstream/vllm-amd-ci/NOTE.md`` describes, from vLLM's ``tests/`` on the
  vLLM under test;
* ``.buildkite/test-amd.yaml``: our ROCm tier (``tests/rocm/``) on an affected
  image, for a downstream Buildkite that renders the same template on this
  repository.

The template's rules, as read from the sources (stored public copies):

* ``vllm-project/ci-infra`` ``buildkite/test-template-amd.j2`` (commits
  ``fd27a430a5f9`` and ``0101524f4bd2``): a step is included only if the run's
  ``mirror_hw`` is in its ``mirror_hardwares``; it is *blocked* (a manual
  "Run ..." gate) unless a ``source_file_dependencies`` entry is a substring
  of a changed file, or the build is run-all or nightly (no dependencies:
  never blocked); an ``optional`` step is blocked outside nightlies; queue
  ``amd_<agent_pool>`` (``amd_mi325_1`` without a pool); ``soft_fail`` unless
  ``grade: Blocking``; the agent runs ``bash
  .buildkite/scripts/hardware_ci/run-amd-test.sh "... && cd <working_dir,
  default /vllm-workspace/tests> ; <commands joined by &&>"``; it waits for
  the image build of the pool's architecture (``pool_to_arch``, else
  ``amd-build``); ``num_gpus`` and ``timeout_in_minutes`` are not used.
* ``vllm-project/ci-infra`` ``buildkite/bootstrap-amd.sh`` (commit
  ``05c995ed3565``): ``AMD_MIRROR_HW`` defaults to ``amdproduction``; the
  changed files are the pipeline repository's own ``git diff`` against the
  merge base.
* ``vllm-project/vllm`` ``.buildkite/test-amd.yaml`` (commit ``009780b00808``):
  the current pools (``mi250_*``, ``mi300_*``, ``mi355_*``), each step tagged
  ``[amdexperimental, amdproduction, amdgfx<arch>nightly, amdmi<N>]`` with
  ``dind: false``; older revisions had ``mi325_1/2/4/8``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
DOWNSTREAM = ROOT / ".buildkite" / "test-amd.yaml"
UPSTREAM_DIR = ROOT / "upstream" / "vllm-amd-ci"
UPSTREAM = UPSTREAM_DIR / "test-amd-step.yaml"
UPSTREAM_TEST_NAME = "test_rocm_capture_shared_metadata.py"
#: Where vLLM maintainers would put the test (vLLM's tests/ tree).
UPSTREAM_TEST_IN_VLLM = "tests/v1/attention/" + UPSTREAM_TEST_NAME
RUN_AMD_TEST = ".buildkite/scripts/hardware_ci/run-amd-test.sh"
INSTALL_SCRIPT = "scripts/rocm-ci-env.sh"
REQUIRE = "CAPTURE_GUARD_REQUIRE_GPUS"

# --- the template's rules (see the module docstring for the sources) -------

DEFAULT_MIRROR_HW = "amdproduction"
DEFAULT_WORKING_DIR = "/vllm-workspace/tests"
POOL_TO_ARCH = {
    **{f"mi250_{n}": "gfx90a" for n in (1, 2, 4, 8)},
    **{f"mi325_{n}": "gfx942" for n in (1, 2, 4, 8)},
    **{f"mi355_{n}": "gfx950" for n in (1, 2, 4, 8)},
}
ARCH_TO_BUILD_KEY = {a: f"amd-build-{a}" for a in ("gfx90a", "gfx942", "gfx950")}


def included(step: dict, mirror_hw: str = DEFAULT_MIRROR_HW) -> bool:
    return bool(step.get("mirror_hardwares")) and mirror_hw in step["mirror_hardwares"]


def gated(
    step: dict,
    changed: list[str],
    run_all: bool = False,
    nightly: bool = False,
    branch: str = "pr",
) -> bool:
    """True if the rendered step waits behind a manual "Run ..." block."""
    blocked = not (run_all or nightly)
    deps = step.get("source_file_dependencies")
    if not deps or any(dep in f for dep in deps for f in changed):
        blocked = False
    autorun = step.get("autorun_on_main") is True and branch == "main"
    return (blocked or (bool(step.get("optional")) and not nightly)) and not autorun


def queue(step: dict) -> str:
    return f"amd_{step['agent_pool']}" if step.get("agent_pool") else "amd_mi325_1"


def soft_fail(step: dict) -> bool:
    return step.get("grade") != "Blocking"


def build_key(step: dict) -> str:
    arch = POOL_TO_ARCH.get(step.get("agent_pool", ""), "")
    return ARCH_TO_BUILD_KEY.get(arch, "amd-build")


def agent_command(step: dict) -> str:
    """The string the agent hands to run-amd-test.sh, after the template's own
    prefix (``rocm-smi``, ``VLLM_TEST_GROUP_NAME``, ...)."""
    commands = step.get("command") or " && ".join(step["commands"])
    return f"cd {step.get('working_dir') or DEFAULT_WORKING_DIR} ; {commands}"


# --- vLLM's current step conventions ----------------------------------------

ARCH_TAG = {"mi250": "amdgfx90anightly", "mi300": "amdgfx942nightly"}
ARCH_TAG |= {"mi325": "amdgfx942nightly", "mi355": "amdgfx950nightly"}
#: Pools as named in vLLM's current file; MI325 as in its older files (and in
#: the template's pool_to_arch), for downstreams whose MI325 pools exist.
CURRENT_POOL = re.compile(r"^mi(250|300|355)_[1248]$")
MI325_POOL = re.compile(r"^mi325_[1248]$")

STEP_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "label",
        "agent_pool",
        "mirror_hardwares",
        "source_file_dependencies",
        "commands",
        "working_dir",
        "grade",
        "dind",
    ],
    "properties": {
        "label": {"type": "string", "minLength": 1},
        "agent_pool": {"type": "string", "pattern": r"^mi(250|300|325|355)_[1248]$"},
        "num_gpus": {"type": "integer", "enum": [1, 2, 4, 8]},
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
        "timeout_in_minutes": {"type": "integer", "minimum": 1, "maximum": 240},
        "dind": {"type": "boolean"},
        "grade": {"enum": ["Blocking"]},
        "working_dir": {"type": "string", "pattern": "^/"},
    },
}

PIPELINES = {"upstream": UPSTREAM, "downstream": DOWNSTREAM}


def load_steps(path: Path) -> list[dict]:
    pipeline = yaml.safe_load(path.read_text())
    assert set(pipeline) == {"steps"}, set(pipeline)
    for step in pipeline["steps"]:
        jsonschema.validate(step, STEP_SCHEMA)
    return pipeline["steps"]


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def pipeline(request) -> tuple[str, list[dict]]:
    return request.param, load_steps(PIPELINES[request.param])


@pytest.fixture(scope="module")
def upstream() -> list[dict]:
    return load_steps(UPSTREAM)


@pytest.fixture(scope="module")
def downstream() -> list[dict]:
    return load_steps(DOWNSTREAM)


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
    """Paths that ``command`` names, relative to its working directory."""
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


def _gpus(step: dict) -> int:
    return int(step["agent_pool"].rsplit("_", 1)[1])


def _image_env() -> dict[str, str]:
    text = (ROOT / ".buildkite" / "scripts" / "image.env").read_text()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)=(?:\$\{\w+:-)?([^}\s]+)\}?$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


# --- both shapes ---------------------------------------------------------------


def test_steps_match_the_schema_and_labels_are_unique(pipeline):
    _, steps = pipeline
    labels = [s["label"] for s in steps]
    assert len(set(labels)) == len(labels), labels


def test_inclusion_every_step_on_the_default_mirror_hardware(pipeline):
    _, steps = pipeline
    assert all(included(s) for s in steps)
    # and the rule does exclude: another run's mirror tag picks none of them
    assert not any(included(s, "amdtentative") for s in steps)


def test_queue_pools_and_tags_as_in_vllms_current_file(pipeline):
    name, steps = pipeline
    for step in steps:
        pool = step["agent_pool"]
        family = pool.split("_")[0]
        assert queue(step) == f"amd_{pool}"
        assert CURRENT_POOL.match(pool) or (
            name == "downstream" and MI325_POOL.match(pool)
        ), pool
        tags = step["mirror_hardwares"]
        assert tags[:2] == ["amdexperimental", "amdproduction"], tags
        assert ARCH_TAG[family] in tags, (pool, tags)
        if CURRENT_POOL.match(pool):
            assert f"amd{family}" in tags, (pool, tags)
        assert step["dind"] is False
        # The queue alone decides the GPUs: the template reads no num_gpus.
        assert "num_gpus" not in step, step["label"]
        # Which image build the step waits for (MI300 pools: the multi-arch one)
        expected = {"mi325": "gfx942", "mi355": "gfx950"}.get(family)
        assert build_key(step) == (f"amd-build-{expected}" if expected else "amd-build")


def test_grade_blocking_and_not_optional(pipeline):
    _, steps = pipeline
    for step in steps:
        assert soft_fail(step) is False, step["label"]
        assert not step.get("optional"), step["label"]
        assert not gated(step, [], nightly=True), step["label"]


def test_commands_survive_the_templates_double_quotes(pipeline):
    """The template puts the joined commands inside one double-quoted argument
    of run-amd-test.sh, which the agent's shell expands: a ``"`` would end it
    and a single ``$`` would be expanded on the agent (vLLM writes ``$$``)."""
    _, steps = pipeline
    for step in steps:
        for command in step["commands"]:
            assert '"' not in command and "`" not in command, command
            assert "$" not in command.replace("$$", ""), command


def test_no_step_is_ever_gated_on_a_run_all_build(pipeline):
    _, steps = pipeline
    assert not any(gated(s, ["README.md"], run_all=True) for s in steps)


# --- (a) vLLM's own AMD CI: the regression test ------------------------------


def _vllm_root() -> Path:
    """The folder holding the installed ``vllm`` package (not imported)."""
    return Path(importlib.util.find_spec("vllm").origin).parents[1]


def test_upstream_gating_follows_vllms_own_diff(upstream):
    for step in upstream:
        for dep in step["source_file_dependencies"]:
            if dep.startswith("vllm/"):
                # vLLM's own paths, present in the installed release
                assert (_vllm_root() / dep).exists(), dep
            else:
                assert dep == UPSTREAM_TEST_IN_VLLM, dep
        # a vLLM PR touching the ROCm builder, the indexer or the runner runs it
        for changed in (
            "vllm/v1/attention/backends/rocm_attn.py",
            "vllm/v1/attention/backends/rocm_aiter_unified_attn.py",
            "vllm/models/minimax_m3/common/indexer.py",
            "vllm/v1/worker/gpu_model_runner.py",
            UPSTREAM_TEST_IN_VLLM,
        ):
            assert not gated(step, ["docs/index.md", changed]), changed
        # an unrelated vLLM PR does not; nor could any path of this repository
        assert gated(step, ["vllm/entrypoints/openai/api_server.py"])
        assert gated(step, ["src/vllm_capture_guard/runtime/plugin.py", "tests/rocm/"])


def test_upstream_runs_the_test_from_vllms_tests_folder(upstream):
    for step in upstream:
        assert step["working_dir"] == DEFAULT_WORKING_DIR
        (command,) = step["commands"]
        assert pytest_args(command) is not None
        (path,) = named_paths(command)
        # cd /vllm-workspace/tests ; pytest v1/attention/<file>
        assert f"tests/{path}" == UPSTREAM_TEST_IN_VLLM
        assert agent_command(step).startswith(f"cd {DEFAULT_WORKING_DIR} ; pytest ")
    assert UPSTREAM_TEST_IN_VLLM in (UPSTREAM_DIR / "NOTE.md").read_text()


def test_upstream_has_one_step_per_current_architecture(upstream):
    assert {s["agent_pool"] for s in upstream} == {"mi300_1", "mi355_1"}


# --- (b) downstream: our ROCm tier on an affected image ------------------------


def test_downstream_gating_follows_this_repositorys_diff(downstream):
    for step in downstream:
        for dep in step["source_file_dependencies"]:
            assert (ROOT / dep).exists(), dep
        assert not gated(step, ["src/vllm_capture_guard/runtime/patches/__init__.py"])
        assert not gated(step, ["tests/rocm/engine_run.py"])
        assert not gated(step, [".buildkite/test-amd.yaml"])
        assert gated(step, ["README.md", "docs/version-matrix.md"])


def test_downstream_runs_in_the_mounted_checkout(downstream):
    mount = _image_env()["CAPTURE_GUARD_MOUNT"]
    for step in downstream:
        assert step["working_dir"] == mount
        assert agent_command(step).startswith(f"cd {mount} ; ")
        for command in step["commands"]:
            for path in named_paths(command):
                # the mount is this checkout
                assert (ROOT / path).exists(), (step["label"], path)


def test_downstream_pools_and_tp_sizes(downstream):
    pools = {s["agent_pool"] for s in downstream}
    assert pools == {f"mi{m}_{n}" for m in (300, 325, 355) for n in (1, 4)}
    for step in downstream:
        gpus = _gpus(step)
        tier = [c for c in step["commands"] if pytest_args(c)]
        assert len(tier) == 1, step["commands"]
        args = pytest_args(tier[0])
        assert args[args.index("-k") + 1] == f"tp{gpus}"
        assert args[args.index("-m") + 1] == "rocm"
        # the pool decides the GPUs; the tier must fail, not skip, on fewer
        assert _env(tier[0]).get(REQUIRE) == str(gpus)


def test_downstream_prepares_the_image_first(downstream):
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^VLLM_VERSION \?= (\S+)$", makefile, re.M).group(1)
    for step in downstream:
        first = step["commands"][0]
        assert _words(first)[:2] == ["bash", INSTALL_SCRIPT], first
        assert _env(first) == {"VLLM_VERSION": pin}


def _dry_run(script: str, *args: str) -> list[list[str]]:
    proc = subprocess.run(
        ["bash", script, *args],
        cwd=ROOT,
        env={**os.environ, "CAPTURE_GUARD_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def test_run_amd_test_runs_the_string_in_the_pinned_image(downstream):
    image, mount = (
        _image_env()["CAPTURE_GUARD_IMAGE"],
        _image_env()["CAPTURE_GUARD_MOUNT"],
    )
    assert re.fullmatch(r"vllm/vllm-openai-rocm:v0\.28\.0@sha256:[0-9a-f]{64}", image)
    step = downstream[0]
    string = f"(command rocm-smi || true) && {agent_command(step)}"
    pull, run = _dry_run(RUN_AMD_TEST, string)
    assert pull == ["docker", "pull", image]
    assert run[:3] == ["docker", "run", "--rm"]
    # vLLM's ROCm docs' flags for its image (gpu.rocm.inc.md, pre-built images)
    for flag in ("--group-add=video", "--cap-add=SYS_PTRACE", "--ipc=host"):
        assert flag in run, flag
    assert run[run.index("--security-opt") + 1] == "seccomp=unconfined"
    assert run[run.index("--device") + 1] == "/dev/kfd"
    assert f"{ROOT}:{mount}:ro" in run  # nothing written into the checkout
    assert run[run.index("--device", run.index("--device") + 1) + 1] == "/dev/dri"
    # the image's entrypoint is `vllm serve`: replaced, the string run by bash
    assert run[run.index("--entrypoint") + 1] == "/bin/bash"
    assert run[-3:] == [image, "-c", string]


def test_ci_bake_checks_the_image_instead_of_building(downstream):
    image = _image_env()["CAPTURE_GUARD_IMAGE"]
    pull, run = _dry_run(".buildkite/scripts/ci-bake.sh", "test-rocm-gfx942-ci")[1:]
    assert pull == ["docker", "pull", image]
    assert run[run.index("--entrypoint") + 1] == "python3" and image in run
    check = run[-1]
    assert "(3, 12)" in check and "torch.version.hip" in check
    assert "VLLM_VERSION=0.28.0" in run  # the release the steps expect
    assert '"installed"' in check  # an image builder's own image: any release


def _run_pytest(command: str) -> tuple[int, str, str]:
    """``command``'s pytest arguments, run here from the repository root (the
    mount's stand-in) with the command's own environment assignments."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args(command)]
        + ["-p", "no:cacheprovider", "-rs"],
        cwd=ROOT,
        env={**os.environ, **_env(command)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    return proc.returncode, out, out.strip().splitlines()[-1]


def test_pytest_commands_select_tests_and_cannot_skip_in_ci(downstream):
    """Each distinct pytest command as written, on this host without ROCm
    torch: it must select tests, and ``CAPTURE_GUARD_REQUIRE_GPUS`` must turn
    the "not a ROCm host" skip into a failure (an agent without ROCm or
    without its GPUs cannot go green)."""
    torch = pytest.importorskip("torch")
    if torch.version.hip is not None:
        pytest.skip("this host has ROCm torch: the commands would start engines")
    commands = sorted({c for s in downstream for c in s["commands"] if pytest_args(c)})
    assert len(commands) == 2, commands  # TP1 and TP4
    for command in commands:
        code, out, summary = _run_pytest(command)
        assert code != 0, (command, summary)
        assert re.search(r"\b\d+ errors?\b", summary), (command, summary)
        assert not re.search(r"\b(passed|skipped)\b", summary), (command, summary)
        assert f"{REQUIRE}={_env(command)[REQUIRE]}, but not a ROCm host" in out


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
