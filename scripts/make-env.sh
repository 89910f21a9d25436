#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Make a CPU virtualenv holding a real vLLM release (its Python code; no GPU
# needed) and this package, from the package registry alone.
#   scripts/make-env.sh VENV_DIR VLLM_VERSION
# With uv on PATH (`pip install uv`), uv builds it (about 1 minute the first
# time, seconds once uv's cache holds the wheels); without it, python -m venv
# and pip (about 4 minutes). CAPTURE_GUARD_NO_UV=1 forces pip. The stamp
# VENV_DIR/.ready holds the vLLM release installed.
set -euo pipefail
venv=${1:?usage: make-env.sh VENV_DIR VLLM_VERSION}
version=${2:?usage: make-env.sh VENV_DIR VLLM_VERSION}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
start=$SECONDS

rm -rf "$venv"
if [ -z "${CAPTURE_GUARD_NO_UV:-}" ] && command -v uv >/dev/null 2>&1; then
    echo "make-env: building $venv with $(uv --version)"
    # --seed: pip inside the venv, for the scripts and tests that call it
    uv venv --quiet --seed --python "$python" "$venv"
    pip=(uv pip install --quiet --python "$venv/bin/python")
else
    echo "make-env: building $venv with python -m venv and pip (uv is faster)"
    "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
fi
"${pip[@]}" -r "$root/requirements/cpu.txt"
# vLLM's full dependency set needs CUDA wheels that fail on a CPU machine; its
# Python code needs only what requirements/cpu.txt holds.
"${pip[@]}" --no-deps "vllm==$version"
"${pip[@]}" --no-deps -e "$root"
"$venv/bin/python" - <<PY
from importlib.metadata import version
assert version("vllm") == "$version", version("vllm")
print("ready:", "$venv", "vllm", version("vllm"), "torch", version("torch"))
PY
echo "$version" > "$venv/.ready"
echo "make-env: $venv in $((SECONDS - start)) s"
