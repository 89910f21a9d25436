#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU tier (tests/gpu/) on a CUDA GPU host that may reach no package
# registry. Two halves:
#
#   scripts/gpu-tier.sh prepare [DEST]    here, with a package registry: builds
#       DEST (default: .gpu/ in the repo root, ignored by git), under 64 MiB:
#         vllm-py-<V>.tar.xz  vLLM <V>'s pure-Python files and its .dist-info
#                             (no compiled extensions) from the pinned wheel;
#                             also for each release in OTHER_VERSIONS (the
#                             serving benchmark's other tree)
#         wheels/             cp312 wheels of requirements/gpu-tier.txt
#         meta/               .dist-info folders: this package's entry point
#                             (vllm.general_plugins: capture_guard) and the
#                             test-only platform plugin tests/gpu/generic_platform.py
#         repo/               a snapshot of src/, tests/, scripts/, pyproject.toml
#   bash .gpu/repo/scripts/gpu-tier.sh run    on the GPU host (Python 3.12, a
#       CUDA build of torch), from a copy of the checkout with .gpu/: installs
#       DEST into /tmp, runs pytest tests/gpu in one process, and writes
#       $OUT (default .gpu/out)/gpu-results.json, gpu-results.md, gpu-tier.log.
#       GPU_TIER_TESTS picks a part of tests/gpu (default: all of it).
#       Where prepare was given BASELINE_REF (a commit of this repository),
#       the guard's start-up cost is then compared on this host: this
#       checkout's runtime beside that commit's, with this checkout's tools
#       and tests (tests/gpu/compare_start_up.py; start-up-comparison.json).
#   bash .gpu/repo/scripts/gpu-tier.sh compare    the same comparison alone.
#       With GPU_TIER_MUTATIONS=1 it then runs the tests that must catch a
#       broken guard against one (tests/gpu/conftest.py, GPU_TIER_MUTATE) and
#       adds what they said to the results (gpu-mutations.log).
# Then:
#   scripts/render-gpu-results.py .gpu/out/gpu-results.json > docs/gpu-results.md
#
# VLLM_VERSION (default 0.28.0) picks the release; VLLM_WHEEL_DIR (default
# /tmp/wheels) is searched for its wheel before PyPI. OTHER_VERSIONS (default
# 0.33.0 0.34.0) are unpacked on the GPU host as trees of their own, named to
# the tests by GPU_TIER_VLLM_TREES (tests/gpu/test_serving_loop.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:?usage: gpu-tier.sh prepare|run [DEST]}
dest=${2:-$root/.gpu}
if [[ -z ${2:-} && -d $root/../wheels ]]; then
  dest=$(cd "$root/.." && pwd) # this copy is DEST/repo/scripts/gpu-tier.sh
fi
version=${VLLM_VERSION:-0.28.0}
others=${OTHER_VERSIONS-0.33.0 0.34.0}
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
  --platform manylinux1_x86_64)

bundle() {
  local python=$1 v=$2
  local out="$dest/vllm-py-$v.tar.xz"
  [[ -s $out ]] && return 0
  local wheel
  wheel=$(ls "${VLLM_WHEEL_DIR:-/tmp/wheels}"/vllm-"$v"-*.whl 2>/dev/null | head -1 || true)
  if [[ -z $wheel ]]; then
    mkdir -p "$dest/.cache"
    "$python" -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
      -d "$dest/.cache" "vllm==$v"
    wheel=$(ls "$dest"/.cache/vllm-"$v"-*.whl | head -1)
  fi
  "$python" - "$wheel" "$out" <<'PY'
import io, os, sys, tarfile, zipfile
wheel, bundle = sys.argv[1:]
keep_meta = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt", "LICENSE")
n = 0
with zipfile.ZipFile(wheel) as z, tarfile.open(bundle + ".part", "w:xz") as tar:
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
os.replace(bundle + ".part", bundle)
print(f"vllm bundle: {n} files from {os.path.basename(wheel)}")
PY
}

prepare() {
  local python=${PYTHON:-python3}
  mkdir -p "$dest" && dest=$(cd "$dest" && pwd)
  mkdir -p "$dest/wheels" "$dest/meta"

  # 1. vLLM's Python files + .dist-info (without it vLLM cannot read its own
  #    version and replaces Triton by placeholders), for each release.
  local v
  for v in $version $others; do
    bundle "$python" "$v"
  done

  # 2. cp312 wheels the machine lacks (pip matches platform tags exactly).
  "$python" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$dest/wheels" -r "$root/requirements/gpu-tier.txt"

  # 2b. The runtime of BASELINE_REF, for the cost comparison (none by default).
  rm -rf "$dest/baseline"
  if [[ -n ${BASELINE_REF:-} ]]; then
    mkdir -p "$dest/baseline"
    git -C "$root" archive "$BASELINE_REF" src/vllm_capture_guard/runtime |
      tar -xf - -C "$dest/baseline"
    git -C "$root" rev-parse --short "$BASELINE_REF" >"$dest/baseline/COMMIT"
  fi

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
    "$(cd "$dest" && ls vllm-py-*.tar.xz | tr '\n' ' ')meta: $(ls "$dest/meta" | tr '\n' ' ')"
  if ((size > 60)); then
    echo "error: $dest is over 60 MiB; keep it small enough to copy to the GPU host" >&2
    exit 1
  fi
}

# A bundle unpacked by Python's own tarfile (xz needs no tool of the host's).
unpack() {
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"
}

site=/tmp/gpu-tier-site

# The wheels and vLLM's trees unpacked into /tmp, and the environment set.
install() {
  rm -rf "$site" && mkdir -p "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "$dest"/wheels/*.whl
  unpack "$dest/vllm-py-$version.tar.xz" "$site"
  local trees=/tmp/gpu-tier-trees v
  rm -rf "$trees"
  for v in $others; do
    if [[ -s $dest/vllm-py-$v.tar.xz ]]; then
      mkdir -p "$trees/vllm-$v"
      unpack "$dest/vllm-py-$v.tar.xz" "$trees/vllm-$v"
    fi
  done
  export GPU_TIER_VLLM_TREES=$trees
  export PYTHONPATH="$site:$dest/meta:$dest/repo/src:$dest/repo"
  export VLLM_CAPTURE_GUARD=on HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  export GPU_TIER_RESULTS="$out/gpu-results.json"
  GPU_TIER_COMMIT=$(cat "$dest/repo/COMMIT" 2>/dev/null || echo unknown)
  export GPU_TIER_COMMIT
  nvidia-smi -L 2>/dev/null || true
}

run() {
  dest=$(cd "$dest" && pwd)
  local out=${OUT:-$dest/out} t0=$SECONDS
  mkdir -p "$out"
  install
  local rc=0
  # shellcheck disable=SC2086 # GPU_TIER_TESTS: words (a selection of tests/gpu)
  (cd "$dest/repo" && python3 -m pytest ${GPU_TIER_TESTS:-tests/gpu} -v -p no:cacheprovider) \
    >"$out/gpu-tier.log" 2>&1 || rc=$?
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error" "$out/gpu-tier.log" |
    grep -v "^INFO\|^WARNING\|^DEBUG" || true
  ((rc == 0)) || tail -n 120 "$out/gpu-tier.log"
  if [[ -n ${GPU_TIER_MUTATIONS:-} ]]; then
    mutations "$out"
  fi
  if [[ -d $dest/baseline/src ]]; then
    baseline "$out"
  fi
  render "$t0"
  echo "gpu-tier: pytest exit $rc, $((SECONDS - t0)) s"
  return $rc
}

render() {
  local t0=$1
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
}

# The guard's start-up cost: this checkout's runtime beside BASELINE_REF's, on
# this host; only src/vllm_capture_guard/runtime differs between the two.
baseline() {
  local out=$1 overlay=/tmp/gpu-tier-baseline-src ref
  ref=$(cat "$dest/baseline/COMMIT")
  rm -rf "$overlay" && cp -r "$dest/repo/src" "$overlay"
  rm -rf "$overlay/vllm_capture_guard/runtime"
  cp -r "$dest/baseline/src/vllm_capture_guard/runtime" "$overlay/vllm_capture_guard/"
  # Today's tools take their string enum from runtime/logs.py. An older runtime
  # has none; it gets today's, which that runtime itself never imports.
  if [[ ! -e $overlay/vllm_capture_guard/runtime/logs.py ]]; then
    cp "$dest/repo/src/vllm_capture_guard/runtime/logs.py" "$overlay/vllm_capture_guard/runtime/"
  fi
  echo "baseline $ref: start-up cost, this runtime beside that one"
  (cd "$dest/repo" && python3 -m tests.gpu.compare_start_up \
    --baseline-src "$overlay" --head-src "$dest/repo/src" \
    --rounds "${COMPARE_ROUNDS:-5}" --paths "${COMPARE_PATHS:-v1-0.28.0,v2-0.28.0,v2-0.34.0}" \
    --out "$out/start-up-comparison.json") | tail -n 60
  if [[ -s $GPU_TIER_RESULTS && -s $out/start-up-comparison.json ]]; then
    python3 - "$GPU_TIER_RESULTS" "$out/start-up-comparison.json" "$ref" <<'PY'
import json, sys
path, other, ref = sys.argv[1:]
data = json.load(open(path))
found = json.load(open(other))
data["baseline_cost"] = {"ref": ref, "start_up": found["summary"],
                         "rounds": found["rounds"], "repeat": found["repeat"]}
json.dump(data, open(path, "w"), indent=1)
PY
  fi
}

compare() {
  dest=$(cd "$dest" && pwd)
  local out=${OUT:-$dest/out}
  mkdir -p "$out"
  install
  baseline "$out"
}

# Each mutation of the guard, and the tests that must fail against it.
MUTATIONS=(
  "unfollowed tests/gpu/test_pinned_async_copies.py"
  "always-wait tests/gpu/test_guard_cost.py -k dummy"
)

mutations() {
  local out=$1 line name tests summary
  : >"$out/gpu-mutations.log"
  for line in "${MUTATIONS[@]}"; do
    read -r name tests <<<"$line"
    # shellcheck disable=SC2086 # the test selection is words
    summary=$(cd "$dest/repo" && GPU_TIER_MUTATE=$name GPU_TIER_RESULTS= \
      python3 -m pytest $tests -q -p no:cacheprovider 2>&1 |
      tee -a "$out/gpu-mutations.log" | tail -n 1 || true)
    echo "mutation $name: $tests: $summary"
    python3 - "$GPU_TIER_RESULTS" "$name" "$tests" "$summary" <<'PY'
import json, sys
path, name, tests, summary = sys.argv[1:]
data = json.load(open(path))
data.setdefault("mutations", {})[name] = {"tests": tests, "pytest": summary}
json.dump(data, open(path, "w"), indent=1)
PY
  done
}

case $cmd in
prepare) prepare ;;
run) run ;;
compare) compare ;;
*)
  echo "usage: gpu-tier.sh prepare|run|compare [DEST]" >&2
  exit 2
  ;;
esac
