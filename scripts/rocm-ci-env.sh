#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepare a ROCm host (MI300/MI325/MI355) for the ROCm test tier, in the
# current Python environment:
#   1. the pinned vLLM, as a ROCm build. A ROCm vLLM of that release already
#      installed (the vLLM ROCm image of the release) is kept; otherwise the
#      release's ROCm wheel is installed from vLLM's ROCm wheel index
#      (https://wheels.vllm.ai/rocm/<version>/<variant>). Never the PyPI
#      wheel, which is a CUDA build;
#   2. this package, editable, with its test extras, as a vLLM plugin.
# It does not touch torch or vLLM otherwise, and prints what it found.
#
#   VLLM_VERSION=0.28.0 scripts/rocm-ci-env.sh
#   VLLM_ROCM_VARIANT=rocm721   ROCm variant of the wheel index (default)
#   PYTHON=python3              the interpreter to install into
set -euo pipefail
version=${VLLM_VERSION:?set VLLM_VERSION, e.g. VLLM_VERSION=0.28.0}
variant=${VLLM_ROCM_VARIANT:-rocm721}
python=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
pip=("$python" -m pip install --disable-pip-version-check)

# "<version>" or "<version>+<local tag>" of the installed vLLM, or nothing.
installed=$("$python" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
try:
    print(version("vllm"))
except PackageNotFoundError:
    print("")
PY
)
if [[ "${installed%%+*}" == "$version" ]]; then
    echo "vLLM $installed is installed: keeping it"
else
    echo "vLLM '${installed:-none}' is installed; installing vLLM $version ($variant)"
    "${pip[@]}" "vllm==${version}+${variant}" \
        --extra-index-url "https://wheels.vllm.ai/rocm/${version}/${variant}"
fi

"$python" - <<'PY'
import torch
from importlib.metadata import version

assert torch.version.hip, f"torch {torch.__version__} is not a ROCm build"
print(
    f"vllm {version('vllm')}, torch {torch.__version__}, HIP {torch.version.hip}, "
    f"{torch.cuda.device_count()} GPU(s)"
)
PY

"${pip[@]}" -e "${root}[test]"
HF_HUB_OFFLINE=1 "$python" -m vllm_capture_guard status
