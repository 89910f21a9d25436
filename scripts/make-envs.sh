#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The other vLLM releases of the version matrix and the oracle, beside the base
# venv: each one is `pip install --no-deps --target ENVS/vllm-X vllm==X` (plus
# requirements/vllm-X.txt, if a release ever imports more than the base venv
# holds). Put first on PYTHONPATH, a target wins over the venv's own vLLM, and
# importlib.metadata reports its version. The base venv supplies torch etc.
# A release the venv itself holds is skipped. uv installs them (scripts/uv.sh;
# CAPTURE_GUARD_NO_UV=1 forces pip).
#   scripts/make-envs.sh PYTHON ENVS_DIR VERSION...
set -euo pipefail
python=${1:?usage: make-envs.sh PYTHON ENVS_DIR VERSION...}
envs=${2:?usage: make-envs.sh PYTHON ENVS_DIR VERSION...}
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$envs"
own=$(PYTHONPATH= "$python" -c \
    "from importlib.metadata import version; print(version('vllm'))")
if uv=$("$root/scripts/uv.sh"); then
    mapfile -t sources < <("$python" "$root/scripts/pip_sources.py" "$python")
    pip=("$uv" pip install --quiet --python "$python" --no-deps "${sources[@]}")
else
    pip=("$python" -m pip install --quiet --disable-pip-version-check --no-deps)
fi
for version in "$@"; do
    target="$envs/vllm-$version"
    if [ "$version" = "$own" ]; then
        echo "ready: vllm $version is the venv's own"
        continue
    fi
    if [ -f "$target/.ready" ]; then
        echo "ready: $target"
        continue
    fi
    start=$SECONDS
    rm -rf "$target"
    pkgs=("vllm==$version")
    extra="$root/requirements/vllm-$version.txt"
    [ -f "$extra" ] && pkgs+=(-r "$extra")
    "${pip[@]}" --target "$target" "${pkgs[@]}"
    got=$(PYTHONPATH="$target" "$python" -c \
        "from importlib.metadata import version; print(version('vllm'))")
    if [ "$got" != "$version" ]; then
        echo "make-envs: $target reports vllm $got, not $version" >&2
        exit 1
    fi
    # bytecode, as scripts/make-env.sh compiles the venv's (imports then cost
    # half the CPU)
    "$python" -m compileall -q -j 0 "$target" >/dev/null 2>&1 ||
        echo "make-envs: a few files in $target do not compile (compiled at import)"
    touch "$target/.ready"
    echo "ready: $target (vllm $got, $((SECONDS - start)) s)"
done
