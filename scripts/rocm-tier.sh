#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The ROCm tier (tests/rocm/) in the pinned affected image, on this host's AMD
# GPUs. It is the whole job of each step of .buildkite/rocm-tier.yml and each
# job of .github/workflows/rocm-tier.yml, and what docs/runbook-rocm.md runs
# by hand:
#   bash scripts/rocm-tier.sh 1     # TP=1: fails unless 1 GPU is visible
#   bash scripts/rocm-tier.sh 4     # TP=4: fails unless 4 GPUs are visible
# It pulls the image (.buildkite/scripts/image.env; CAPTURE_GUARD_IMAGE
# overrides it) and runs, with this checkout mounted read-only, the two
# commands printed below: scripts/rocm-ci-env.sh (checks the image holds a ROCm
# build of VLLM_VERSION, default 0.28.0, and installs this package and pytest)
# and the tier's pytest command for that TP size. The GPUs reach the container
# as vLLM's ROCm docs pass them: /dev/kfd, /dev/dri, group video, host IPC.
# Give each agent its own GPUs (e.g. one agent per GPU set, or
# HIP_VISIBLE_DEVICES in the agent's environment, which is passed on).
# CAPTURE_GUARD_DRY_RUN=1 prints the docker commands instead of running them.
set -euo pipefail
tp=${1:-}
if [[ "$tp" != 1 && "$tp" != 4 ]]; then
    echo "usage: rocm-tier.sh 1|4   (the TP size; the tier has TP=1 and TP=4)" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=../.buildkite/scripts/image.env
source "$root/.buildkite/scripts/image.env"
version=${VLLM_VERSION:-0.28.0}
commands="VLLM_VERSION=$version bash scripts/rocm-ci-env.sh"
commands+=" && CAPTURE_GUARD_REQUIRE_GPUS=$tp python3 -m pytest -v -s -m rocm"
commands+=" -k tp$tp tests/rocm/test_engine_startup.py tests/rocm/test_async_copies.py"
visible=()
[[ -n "${HIP_VISIBLE_DEVICES:-}" ]] && visible=(-e "HIP_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES")
run=(docker run --rm
    --device /dev/kfd
    --device /dev/dri
    --group-add video
    --ipc=host
    --security-opt seccomp=unconfined
    -v "$root:$CAPTURE_GUARD_MOUNT:ro"
    -w "$CAPTURE_GUARD_MOUNT"
    -e HF_HUB_OFFLINE=1
    -e PYTHONDONTWRITEBYTECODE=1
    -e "PYTEST_ADDOPTS=-p no:cacheprovider"
    "${visible[@]}"
    --entrypoint /bin/bash
    "$CAPTURE_GUARD_IMAGE"
    -c "$commands")
if [[ "${CAPTURE_GUARD_DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' docker pull "$CAPTURE_GUARD_IMAGE"; echo
    printf '%q ' "${run[@]}"; echo
    exit 0
fi
echo "rocm-tier: TP=$tp in $CAPTURE_GUARD_IMAGE: $commands"
docker pull "$CAPTURE_GUARD_IMAGE"
exec "${run[@]}"
