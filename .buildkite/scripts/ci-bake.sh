#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The template's "AMD: build image" steps call `bash .buildkite/scripts/ci-bake.sh
# <target>` (on the amd-cpu queue) and every test step waits for them. Nothing
# is built for this repository: the ROCm tier runs in an existing, affected
# image. This pulls that image (.buildkite/scripts/image.env) and checks, without
# a GPU, that it holds Python 3.12, a ROCm torch and a ROCm build of the vLLM
# the steps expect (VLLM_VERSION, default 0.28.0; "installed": any release, for
# an image builder's own image), so that a wrong pin fails here, once, instead
# of in every GPU step.
# CAPTURE_GUARD_DRY_RUN=1 prints the docker commands instead of running them.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=image.env
source "$root/.buildkite/scripts/image.env"
echo "target ${1:-?}: using $CAPTURE_GUARD_IMAGE (not building)"
check='
import os, sys
from importlib.metadata import version
import torch
v = version("vllm")
print("python", sys.version.split()[0], "vllm", v, "torch", torch.__version__,
      "hip", torch.version.hip)
assert sys.version_info[:2] == (3, 12), "expected Python 3.12"
assert torch.version.hip, "torch is not a ROCm build"
want = os.environ.get("VLLM_VERSION") or "0.28.0"
assert "rocm" in v, "vLLM is not a ROCm build"
assert want == "installed" or v.split("+")[0] == want, f"expected vllm {want}+rocm..."
'
run=(docker run --rm -e "VLLM_VERSION=${VLLM_VERSION:-0.28.0}"
    --entrypoint python3 "$CAPTURE_GUARD_IMAGE" -c "$check")
if [[ "${CAPTURE_GUARD_DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' docker pull "$CAPTURE_GUARD_IMAGE"; echo
    printf '%q ' "${run[@]}"; echo
    exit 0
fi
docker pull "$CAPTURE_GUARD_IMAGE"
"${run[@]}"
