# SPDX-License-Identifier: Apache-2.0
# `make check` and `make test` do all the set-up they need on a fresh machine.
VLLM_VERSION ?= 0.28.0
# The release the venv itself holds (requirements/cpu.txt is pinned for it);
# VLLM_VERSION only picks the release that check and test run on.
VENV_VLLM ?= 0.28.0
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: env envs check status test lint bench oracle matrix clean audit bench-audit wheel upstream-hooks newest

env: $(VENV)/.ready

$(VENV)/.ready: requirements/cpu.txt requirements/cpu-nodeps.txt pyproject.toml scripts/make-env.sh
	scripts/make-env.sh $(VENV) $(VENV_VLLM)

# VLLM_VERSION picks the release that check and test run on. The venv holds
# VENV_VLLM (its .ready stamp says which); another release is put in front of
# it from $(ENVS)/vllm-X, built on first use, as the version matrix does
# (scripts/with-vllm.sh). Each command says which release it ran.
WITH_VLLM = scripts/with-vllm.sh $(PY) $(CAPTURE_GUARD_ENVS) $(VLLM_VERSION)

# The main job on the embedded default: the MiniMax-M3 capture scenario against
# vLLM $(VLLM_VERSION) on the CPU, through vLLM's own plugin loader.
check: env
	$(WITH_VLLM) $(VENV)/bin/vllm-capture-guard status
	$(WITH_VLLM) $(VENV)/bin/vllm-capture-guard check
	@echo "make check: checked vLLM $(VLLM_VERSION)"

status: env
	$(WITH_VLLM) $(VENV)/bin/vllm-capture-guard status

# The installable artifacts: dist/vllm_capture_guard-<version>-py3-none-any.whl
# and the sdist. No dependencies: install the wheel into the vLLM environment,
# e.g. `pip install --no-index --find-links dist vllm-capture-guard`.
wheel: env
	$(PY) -m build --no-isolation --outdir dist .

lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# vLLM 0.33.0's own pre-commit hooks (check-spdx-header, ruff-check,
# ruff-format, typos, check-test-tethering) on upstream/vllm/, in a copy of its
# sdist tree; the tools pinned in requirements/upstream-hooks.txt, installed
# once into .tools/. `make test` runs the same (tests/vllm_tree/test_upstream_hooks.py).
upstream-hooks: env
	$(PY) -m tests.vllm_tree.precommit

# --- version matrix and differential oracle (other releases beside the venv) --
# Each other release: `pip install --no-deps --target $(ENVS)/vllm-X vllm==X`,
# put first on PYTHONPATH by the scripts (scripts/make-envs.sh).
ENVS ?= .envs
ALL_VERSIONS := 0.27.1 0.28.0 0.29.0 0.33.0 0.34.0
# Releases that get `make check` (status and check) in `make test`, beside the
# matrix (tests/test_makefile.py runs it, in the matrix's release-independent
# job): 0.27.0 is the release ROCm images still pin.
CHECK_VERSIONS := 0.27.0
export CAPTURE_GUARD_ENVS := $(abspath $(ENVS))

# `make test`: every release, and the version table of docs/version-matrix.md
# must be what the run found. `VLLM_VERSION=X make test`: the suite on release X only (no table).
ifeq ($(origin VLLM_VERSION),file)
TEST_VERSIONS := $(ALL_VERSIONS)
TEST_CHECKS := $(CHECK_VERSIONS)
MATRIX_MODE := --check
else
TEST_VERSIONS := $(VLLM_VERSION)
TEST_CHECKS :=
MATRIX_MODE :=
endif

# Every release the matrix or VLLM_VERSION names, except the venv's own (each
# folder has its own .ready stamp, so this is quick once built).
envs: env
	scripts/make-envs.sh $(PY) $(ENVS) $(sort $(ALL_VERSIONS) $(CHECK_VERSIONS) $(VLLM_VERSION))

# The test suite on each release (the oracle tests once, in the venv; `make
# check` on each of CHECK_VERSIONS among the release-independent tests).
test: lint envs
	$(PY) scripts/version_matrix.py $(MATRIX_MODE) --versions $(TEST_VERSIONS)
	@echo "make test: tested vLLM $(TEST_VERSIONS)$(if $(TEST_CHECKS), and checked $(TEST_CHECKS))"

# Rewrite the version table of docs/version-matrix.md from a real run.
matrix: lint envs
	$(PY) scripts/version_matrix.py --write --versions $(ALL_VERSIONS)

# Patched 0.28.0 and 0.27.1 against unpatched 0.29.0, field by field.
oracle: envs
	$(PY) -m vllm_capture_guard.lab.oracle run

# A new vLLM release, checked the day it ships (docs/newest.md): the newest
# release on the package registry (NEWEST_VLLM=X names one) against the last of
# ALL_VERSIONS: status, check, the audit and vLLM's generic capture test on
# each, one drift report; exit 1 on any drift. Not part of `make test`: a new
# vLLM release must not turn an unrelated commit's CI red.
newest: env
	$(PY) scripts/newest.py --pinned $(lastword $(ALL_VERSIONS))

bench: env
	$(PY) benchmarks/bench_guard.py
	$(PY) benchmarks/bench_tree.py

# Every registered attention backend's capture on shared metadata.
audit: env
	$(VENV)/bin/vllm-capture-guard audit

bench-audit: env
	$(PY) benchmarks/bench_audit.py

clean:
	rm -rf $(VENV) .envs dist build
