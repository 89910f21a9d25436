#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What a step rendered by vllm-project/ci-infra's test-template-amd.j2 calls on
# the AMD agent, from this checkout:
#   bash .buildkite/scripts/hardware_ci/run-amd-test.sh "<prefix> && cd <working_dir> ; cmd1 && cmd2"
# Runs that command string with bash inside the affected image
# (.buildkite/scripts/image.env), this checkout mounted at /vllm-capture-guard,
# the GPUs passed the way vLLM's ROCm docs run its image
# (docs/getting_started/installation/gpu.rocm.inc.md, "pre-built images").
# The image's entrypoint is `vllm serve`, so it is replaced by bash. The
# checkout is mounted read-only and nothing writes into it (no bytecode, no
# pytest cache), so the agent's checkout holds no files owned by the
# container's root afterwards. On agents that publish their GPUs' render nodes
# (BUILDKITE_AGENT_META_DATA_RENDER_DEVICES, as vLLM's AMD agents do) only
# those are passed; otherwise all of /dev/dri, as vLLM's docs do.
# CAPTURE_GUARD_DRY_RUN=1 prints the docker commands instead of running them.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
# shellcheck source=../image.env
source "$root/.buildkite/scripts/image.env"
command=${1:?usage: run-amd-test.sh "COMMANDS"}

# shellcheck disable=SC2206  # "--device /dev/dri/renderD128 ..." words
render=(${BUILDKITE_AGENT_META_DATA_RENDER_DEVICES:---device /dev/dri})
run=(docker run --rm
    --group-add=video
    --cap-add=SYS_PTRACE
    --security-opt seccomp=unconfined
    --device /dev/kfd
    "${render[@]}"
    --network=host
    --ipc=host
    -v "$root:$CAPTURE_GUARD_MOUNT:ro"
    -e HF_HUB_OFFLINE=1
    -e PYTHONDONTWRITEBYTECODE=1
    -e "PYTEST_ADDOPTS=-p no:cacheprovider"
    --entrypoint /bin/bash
    "$CAPTURE_GUARD_IMAGE"
    -c "$command")

if [[ "${CAPTURE_GUARD_DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' docker pull "$CAPTURE_GUARD_IMAGE"; echo
    printf '%q ' "${run[@]}"; echo
    exit 0
fi
docker pull "$CAPTURE_GUARD_IMAGE"
exec "${run[@]}"
