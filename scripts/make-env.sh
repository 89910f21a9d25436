#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Make a CPU virtualenv holding a real vLLM release (its Python code; no GPU
# needed) and this package, from the package registry alone.
#   scripts/make-env.sh VENV_DIR VLLM_VERSION
set -euo pipefail
venv=${1:?usage: make-env.sh VENV_DIR VLLM_VERSION}
version=${2:?usage: make-env.sh VENV_DIR VLLM_VERSION}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
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
touch "$venv/.ready"
