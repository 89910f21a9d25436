#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU tier (tests/gpu/) on a CUDA GPU host that may reach no package
# registry. Two halves:
#
#   scripts/gpu-tier.sh prepare [DEST]    here, with a package registry: builds
#       DEST (default: .gpu/ in the repo root, ignored by git), under 64 MiB:
#         vllm-py-<V>.tar.gz  vLLM <V>'s pure-Python files and its .dist-info
#                             (no compiled extensions) from the pinned wheel
#         wheels/             cp312 wheels of requirements/gpu-tier.txt
#         meta/               .dist-info folders: this package's entry point
#                             (vllm.general_plugins: capture_guard) and the
#                             test-only platform plugin tests/gpu/generic_platform.py
#         repo/               a snapshot of src/, tests/, scripts/, pyproject.toml
#   bash .gpu/repo/scripts/gpu-tier.sh run    on the GPU host (Python 3.12, a
#       CUDA build of torch), from a copy of the checkout with .gpu/: installs
#       DEST into /tmp, runs pytest tests/gpu in one process, and writes
#       $OUT (default .gpu/out)/gpu-results.json, gpu-results.md, gpu-tier.log.
# Then:
#   scripts/render-gpu-results.py .gpu/out/gpu-results.json > docs/gpu-results.md
#
# VLLM_VERSION (default 0.28.0) picks the release; VLLM_WHEEL_DIR (default
# /tmp/wheels) is searched for its wheel before PyPI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:?usage: gpu-tier.sh prepare|run [DEST]}
dest=${2:-$root/.gpu}
if [[ -z ${2:-} && -d $root/../wheels ]]; then
  dest=$(cd "$root/.." && pwd) # this copy is DEST/repo/scripts/gpu-tier.sh
fi
version=${VLLM_VERSION:-0.28.0}
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
  --platform manylinux1_x86_64)

prepare() {
  local python=${PYTHON:-python3}
  mkdir -p "$dest" && dest=$(cd "$dest" && pwd)
  mkdir -p "$dest/wheels" "$dest/meta"

  # 1. vLLM's Python files + .dist-info (without it vLLM cannot read its own
  #    version and replaces Triton by placeholders).
  local bundle="$dest/vllm-py-$version.tar.gz"
  if [[ ! -s $bundle ]]; then
    local wheel
    wheel=$(ls "${VLLM_WHEEL_DIR:-/tmp/wheels}"/vllm-"$version"-*.whl 2>/dev/null | head -1 || true)
    if [[ -z $wheel ]]; then
      mkdir -p "$dest/.cache"
      "$python" -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
        -d "$dest/.cache" "vllm==$version"
      wheel=$(ls "$dest"/.cache/vllm-"$version"-*.whl | head -1)
    fi
    "$python" - "$wheel" "$bundle" <<'PY'
import io, sys, tarfile, zipfile
wheel, bundle = sys.argv[1:]
keep_meta = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt", "LICENSE")
n = 0
with zipfile.ZipFile(wheel) as z, tarfile.open(bundle + ".part", "w:gz") as tar:
    for info in z.infolist():
        name = info.filename
        top = name.split("/", 1)[0]
        if top == "vllm" and name.endswith(".py"):
            pass
        elif top.endswith(".dist-info") and name.rsplit("/", 1)[-1] in keep_meta:
            pass
        else:
            continue
        data = z.read(info)
        member = tarfile.TarInfo(name)
        member.size = len(data)
        member.mode = 0o644
        tar.addfile(member, io.BytesIO(data))
        n += 1
import os
os.replace(bundle + ".part", bundle)
print(f"vllm bundle: {n} files from {os.path.basename(wheel)}")
PY
  fi

  # 2. cp312 wheels the machine lacks (pip matches platform tags exactly).
  "$python" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$dest/wheels" -r "$root/requirements/gpu-tier.txt"

  # 3. A snapshot of the code under test.
  rm -rf "$dest/repo" && mkdir -p "$dest/repo"
  (cd "$root" && tar -cf - --exclude=__pycache__ src tests scripts pyproject.toml) |
    tar -xf - -C "$dest/repo"
  # which code this snapshot is, for the results (a "+" marks local changes)
  local commit
  commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
  git -C "$root" diff --quiet HEAD 2>/dev/null || commit="$commit+"
  echo "$commit" >"$dest/repo/COMMIT"

  # 4. Entry points, as an installed package would have them.
  rm -rf "$dest/meta" && mkdir -p "$dest/meta"
  "$python" - "$root/pyproject.toml" "$dest/meta" <<'PY'
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]
meta = pathlib.Path(sys.argv[2])

def dist_info(name, version, groups):
    d = meta / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in entries.items()]
        lines.append("")
    (d / "entry_points.txt").write_text("\n".join(lines))

dist_info(project["name"], project["version"], project["entry-points"])
# Test-only: makes every vLLM process use vLLM's generic platform on the
# NVIDIA GPU host (see tests/gpu/generic_platform.py). Never in pyproject.toml.
dist_info(
    "vllm-capture-guard-gpu-tier-platform",
    "0",
    {"vllm.platform_plugins": {
        "capture_guard_gpu_tier": "tests.gpu.generic_platform:generic_platform"}},
)
PY
  rm -rf "$dest/.cache"
  local size
  size=$(du -sm "$dest" | cut -f1)
  echo "prepared $dest (${size} MiB): $(ls "$dest/wheels" | wc -l) wheels," \
    "$(basename "$bundle"), meta: $(ls "$dest/meta" | tr '\n' ' ')"
  if ((size > 60)); then
    echo "error: $dest is over 60 MiB; keep it small enough to copy to the GPU host" >&2
    exit 1
  fi
}

run() {
  dest=$(cd "$dest" && pwd)
  local out=${OUT:-$dest/out} t0=$SECONDS site=/tmp/gpu-tier-site
  mkdir -p "$out"
  rm -rf "$site" && mkdir -p "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "$dest"/wheels/*.whl
  tar -xzf "$dest"/vllm-py-*.tar.gz -C "$site"
  export PYTHONPATH="$site:$dest/meta:$dest/repo/src:$dest/repo"
  export VLLM_CAPTURE_GUARD=on HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  export GPU_TIER_RESULTS="$out/gpu-results.json"
  GPU_TIER_COMMIT=$(cat "$dest/repo/COMMIT" 2>/dev/null || echo unknown)
  export GPU_TIER_COMMIT
  nvidia-smi -L 2>/dev/null || true
  local rc=0
  (cd "$dest/repo" && python3 -m pytest tests/gpu -v -p no:cacheprovider) \
    >"$out/gpu-tier.log" 2>&1 || rc=$?
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error" "$out/gpu-tier.log" |
    grep -v "^INFO\|^WARNING\|^DEBUG" || true
  ((rc == 0)) || tail -n 120 "$out/gpu-tier.log"
  if [[ -s $GPU_TIER_RESULTS ]]; then
    python3 - "$GPU_TIER_RESULTS" $((SECONDS - t0)) <<'PY'
import json, sys
path, seconds = sys.argv[1], int(sys.argv[2])
data = json.load(open(path))
data["run_seconds"] = seconds  # install + pytest, on the machine
json.dump(data, open(path, "w"), indent=1)
PY
    python3 "$dest/repo/scripts/render-gpu-results.py" "$GPU_TIER_RESULTS" |
      tee "$out/gpu-results.md"
  fi
  echo "gpu-tier: pytest exit $rc, $((SECONDS - t0)) s"
  return $rc
}

case $cmd in
prepare) prepare ;;
run) run ;;
*)
  echo "usage: gpu-tier.sh prepare|run [DEST]" >&2
  exit 2
  ;;
esac
