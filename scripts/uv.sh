#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Print the path of the uv that the set-up uses: the one on PATH, else a pinned
# uv from the package registry, installed once by pip into .tools/uv of this
# checkout (ignored by git). Exit 1 when CAPTURE_GUARD_NO_UV is set or no uv
# can be had, so the caller falls back to pip.
#   scripts/uv.sh
set -euo pipefail
UV_PIN=0.13.9
root=$(cd "$(dirname "$0")/.." && pwd)
[ -z "${CAPTURE_GUARD_NO_UV:-}" ] || exit 1
if command -v uv >/dev/null 2>&1; then
    command -v uv
    exit 0
fi
tools="$root/.tools/uv-$UV_PIN"
if [ ! -x "$tools/bin/uv" ]; then
    echo "uv: not on PATH; installing uv $UV_PIN into ${tools#"$root"/}" >&2
    rm -rf "$tools"
    "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check \
        --no-deps --target "$tools" "uv==$UV_PIN" 2> >(grep -v -e 'is ignored: it is neither' -e "as the 'root' user" >&2) \
        || { echo "uv: could not install uv $UV_PIN; using pip" >&2; exit 1; }
fi
echo "$tools/bin/uv"
