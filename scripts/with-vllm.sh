#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run a command against vLLM VERSION, as `make check` does for VLLM_VERSION:
# the venv's own vLLM when it is that release, else ENVS/vllm-VERSION (built
# on first use by make-envs.sh) first on PYTHONPATH, as the version matrix
# runs the other releases. Whatever PYTHONPATH the caller had is dropped, so
# the release run is the one asked for; it is checked before the command runs.
#   scripts/with-vllm.sh PYTHON ENVS_DIR VERSION COMMAND...
set -euo pipefail
python=${1:?usage: with-vllm.sh PYTHON ENVS_DIR VERSION COMMAND...}
envs=${2:?usage: with-vllm.sh PYTHON ENVS_DIR VERSION COMMAND...}
version=${3:?usage: with-vllm.sh PYTHON ENVS_DIR VERSION COMMAND...}
shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
ask='from importlib.metadata import version; print(version("vllm"))'
own=$(PYTHONPATH= "$python" -c "$ask")
if [ "$own" = "$version" ]; then
    export PYTHONPATH=
    where="the venv's own"
else
    "$root/scripts/make-envs.sh" "$python" "$envs" "$version" >&2
    export PYTHONPATH="$envs/vllm-$version"
    where="$envs/vllm-$version, in front of the venv's $own"
fi
# vLLM's cache for this release, where a folder of them is named (the version
# matrix names one: a model class's inspection is cached per release there)
if [ -n "${CAPTURE_GUARD_VLLM_CACHES:-}" ]; then
    export VLLM_CACHE_ROOT="$(realpath -m "$CAPTURE_GUARD_VLLM_CACHES")/vllm-$version"
fi
got=$("$python" -c "$ask")
if [ "$got" != "$version" ]; then
    echo "with-vllm: asked for vLLM $version, got $got" >&2
    exit 2
fi
echo "== vLLM $version ($where): $*"
exec "$@"
