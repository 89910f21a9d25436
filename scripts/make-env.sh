#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Make a CPU virtualenv holding a real vLLM release (its Python code; no GPU
# needed) and this package, from the package registry alone.
#   scripts/make-env.sh VENV_DIR VLLM_VERSION
# uv builds it: the uv on PATH, else a pinned uv that scripts/uv.sh installs
# into .tools/ of this checkout. uv is given pip's configured indexes,
# find-links and constraints (scripts/pip_sources.py), so wheels already on
# this machine are not downloaded again. CAPTURE_GUARD_NO_UV=1 uses python -m
# venv and pip instead (slower). The stamp VENV_DIR/.ready holds the release.
set -euo pipefail
venv=${1:?usage: make-env.sh VENV_DIR VLLM_VERSION}
version=${2:?usage: make-env.sh VENV_DIR VLLM_VERSION}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
start=$SECONDS
# pip warns once per package about each configured local index that lacks it;
# those lines say nothing about this build.
# uv lists every package it installed; the count it prints says enough.
quiet_pip() {
    grep -v -e 'is ignored: it is neither' -e "as the 'root' user" -e '^ + ' || true
}

rm -rf "$venv"
if uv=$("$root/scripts/uv.sh"); then
    mapfile -t sources < <("$python" "$root/scripts/pip_sources.py" "$python")
    echo "make-env: building $venv with $("$uv" --version)"
    # --seed: pip inside the venv, for the scripts and tests that call it
    "$uv" venv --quiet --seed --python "$python" "$venv"
    pip=("$uv" pip install --python "$venv/bin/python" "${sources[@]}")
else
    echo "make-env: building $venv with python -m venv and pip (uv is faster)"
    "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --disable-pip-version-check
        --progress-bar off)
fi
step() { echo "make-env: $1 ($((SECONDS - start)) s)"; }
step "installing requirements/cpu.txt"
"${pip[@]}" -r "$root/requirements/cpu.txt" 2>&1 | quiet_pip
step "installing requirements/cpu-nodeps.txt (no dependencies)"
"${pip[@]}" --no-deps -r "$root/requirements/cpu-nodeps.txt" 2>&1 | quiet_pip
# vLLM's full dependency set needs CUDA wheels that fail on a CPU machine; its
# Python code needs only what requirements/cpu.txt holds.
step "installing vllm==$version (no dependencies)"
"${pip[@]}" --no-deps "vllm==$version" 2>&1 | quiet_pip
step "installing this package (editable)"
"${pip[@]}" --no-deps -e "$root" 2>&1 | quiet_pip
# Bytecode: uv writes none (pip does), and where PYTHONDONTWRITEBYTECODE
# is set no import writes it either, so every new interpreter would compile
# torch and vLLM from source again (import torch, vllm.config: 18.5 s of CPU
# without, 8.5 s with, on a 2-core machine; compiling costs about a minute of
# CPU, once).
step "compiling bytecode"
"$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c \
    'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 ||
    echo "make-env: a few files do not compile (they are compiled at import)"
"$venv/bin/python" - <<PY
from importlib.metadata import version
assert version("vllm") == "$version", version("vllm")
print("ready:", "$venv", "vllm", version("vllm"), "torch", version("torch"))
PY
echo "$version" > "$venv/.ready"
echo "make-env: $venv in $((SECONDS - start)) s"
