#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A small venv that sees every package of BASE_VENV (requirements/cpu.txt) and
# adds what vLLM 0.33's Python code imports on top (requirements/audit-0.33.txt),
# without touching BASE_VENV. Used to audit a vLLM 0.33.0 package directory:
#   scripts/make-audit-overlay.sh /tmp/audit-0.33 /work/main/.venv
#   PYTHONPATH=src:/work/envs/vllm-0.33.0 /tmp/audit-0.33/bin/python -m vllm_capture_guard audit
set -euo pipefail
overlay=${1:?usage: make-audit-overlay.sh OVERLAY_DIR [BASE_VENV]}
base=${2:-.venv}
root=$(cd "$(dirname "$0")/.." && pwd)
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'

"$base/bin/python" -m venv "$overlay"
# base packages come after the overlay's own on sys.path, so the overlay's win
"$base/bin/python" -c "$purelib" > "$("$overlay/bin/python" -c "$purelib")/zz_base_venv.pth"
"$overlay/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$root/requirements/audit-0.33.txt"
echo "ready: $overlay (on top of $base)"
