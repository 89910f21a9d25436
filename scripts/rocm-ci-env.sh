#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepare a ROCm host or container (MI300 / MI325 / MI355) for the ROCm tier
# (tests/rocm/), in the current Python environment. Run it from a checkout of
# this repository; it writes nothing into the checkout.
#
# By default it USES the vLLM and torch that are installed (vLLM's ROCm image
# of the release, vllm/vllm-openai-rocm:v0.28.0) and never installs, upgrades
# or replaces either: it fails, saying why, if they are not a ROCm build of the
# release asked for.
#
# CAPTURE_GUARD_INSTALL_VLLM=1 is for a fresh Python 3.12 environment holding
# neither vLLM nor torch (a bare-metal ROCm host): it installs vLLM's ROCm wheel
# of the release the way vLLM's ROCm installation docs give it for pip
# (docs/getting_started/installation/gpu.rocm.inc.md, "Caveats for using pip"):
#     pip install vllm==<version>+<variant> \
#         --extra-index-url https://wheels.vllm.ai/rocm/<version>/<variant>
# That wheel brings its own torch, so this refuses to run where vLLM or torch
# is already installed. ROCm wheels exist for Python 3.12 only (same docs).
#
# Then, in both modes: this package (no dependencies, so --no-deps), pytest if
# missing, a check that vLLM and torch are still exactly what they were, and
# `vllm-capture-guard status`.
#
#   VLLM_VERSION=0.28.0 bash scripts/rocm-ci-env.sh     # in the image
#   VLLM_VERSION=installed ...    accept whatever ROCm vLLM is installed
#                                 (e.g. a nightly image)
#   CAPTURE_GUARD_INSTALL_VLLM=1  install the release's ROCm wheel (see above)
#   VLLM_ROCM_VARIANT=rocm723     wheel variant; the default is known for
#                                 0.27.0, 0.27.1 and 0.28.0 (rocm723)
#   PYTHON=python3                the interpreter to use
#   bash scripts/rocm-ci-env.sh --print-wheel-command   print the wheel's
#                                 install command for VLLM_VERSION and exit
set -euo pipefail
version=${VLLM_VERSION:?set VLLM_VERSION, e.g. VLLM_VERSION=0.28.0}
python=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
pip=("$python" -m pip install --disable-pip-version-check)

say() { echo "rocm-ci-env: $*"; }
fail() { echo "rocm-ci-env: ERROR: $*" >&2; exit 1; }

# The ROCm wheel variant of each release whose wheel we know (vLLM's ROCm
# wheel index, https://wheels.vllm.ai/rocm/<version>/<variant>).
default_variant() {
    case "$1" in
        0.27.0 | 0.27.1 | 0.28.0) echo rocm723 ;;
        *) echo "" ;;
    esac
}
variant=${VLLM_ROCM_VARIANT:-$(default_variant "$version")}
wheel_command() {
    [[ -n "$variant" ]] || fail "no known ROCm wheel variant for vLLM $version:" \
        "set VLLM_ROCM_VARIANT (the variants are listed at https://wheels.vllm.ai/rocm/)"
    echo "$python -m pip install vllm==${version}+${variant}" \
        "--extra-index-url https://wheels.vllm.ai/rocm/${version}/${variant}"
}
if [[ "${1:-}" == "--print-wheel-command" ]]; then
    wheel_command
    exit 0
fi

# "python=3.12 vllm=<version or empty> torch=<version or empty> hip=<or empty>"
facts() {
    "$python" - <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version


def ver(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return ""


torch, hip = ver("torch"), ""
if torch:
    import torch as t

    hip = t.version.hip or ""
print(f"python={sys.version_info[0]}.{sys.version_info[1]} vllm={ver('vllm')} "
      f"torch={torch} hip={hip}")
PY
}
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }

before=$(facts)
say "found: $before"
py=$(field "$before" python)
installed_vllm=$(field "$before" vllm)
installed_torch=$(field "$before" torch)

if [[ "${CAPTURE_GUARD_INSTALL_VLLM:-0}" == "1" ]]; then
    [[ "$py" == "3.12" ]] || fail "vLLM's ROCm wheels are built for Python 3.12" \
        "only; this is Python $py. Make a 3.12 environment first, as vLLM's docs" \
        "show: uv venv --python 3.12 --seed --managed-python"
    [[ -z "$installed_vllm$installed_torch" ]] || fail "vLLM" \
        "'${installed_vllm:-none}' / torch '${installed_torch:-none}' already" \
        "installed here: the ROCm wheel would replace torch. Use that install" \
        "(leave CAPTURE_GUARD_INSTALL_VLLM unset) or start from a fresh environment."
    [[ "$version" != "installed" ]] || fail "VLLM_VERSION=installed needs a vLLM"
    command=$(wheel_command)
    say "installing vLLM's ROCm wheel: $command"
    $command
    before=$(facts)
    say "now: $before"
else
    [[ "$py" == "3.12" ]] || say "note: Python $py (vLLM's ROCm images and wheels" \
        "use 3.12); going on with the vLLM installed here"
    [[ -n "$installed_vllm" ]] || fail "no vLLM in this Python ($python). Run" \
        "inside vLLM's ROCm image of the release (docs/runbook-rocm.md), or set" \
        "CAPTURE_GUARD_INSTALL_VLLM=1 in a fresh Python 3.12 environment."
    if [[ "$version" != "installed" && "${installed_vllm%%+*}" != "$version" ]]; then
        fail "this Python has vLLM $installed_vllm, not $version (set" \
            "VLLM_VERSION=installed to test the vLLM that is here)"
    fi
fi
[[ -n "$(field "$before" hip)" ]] || fail "torch '$(field "$before" torch)' is" \
    "not a ROCm build (torch.version.hip is None): this is not a ROCm vLLM install"
[[ "$(field "$before" vllm)" == *rocm* ]] || say "note: vLLM" \
    "$(field "$before" vllm) carries no +rocm tag (a source build?)"

# This package, from a scratch copy (nothing is written into the checkout).
# Its build backend is setuptools: the environment's own if recent enough,
# otherwise pip fetches it into an isolated build environment.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r "$root/pyproject.toml" "$root/README.md" "$root/LICENSE" "$root/src" "$scratch/"
isolation=()
if "$python" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    isolation=(--no-build-isolation)
fi
"${pip[@]}" --no-deps "${isolation[@]}" "$scratch"
"$python" -c 'import pytest' 2>/dev/null || "${pip[@]}" 'pytest>=8'

after=$(facts)
for name in vllm torch; do
    [[ "$(field "$before" "$name")" == "$(field "$after" "$name")" ]] || fail \
        "$name changed from '$(field "$before" "$name")' to" \
        "'$(field "$after" "$name")' while installing the test tools"
done
say "vLLM $(field "$after" vllm) and torch $(field "$after" torch) unchanged;" \
    "vllm-capture-guard installed"
(cd "$scratch" && HF_HUB_OFFLINE=1 "$python" -m vllm_capture_guard status)
