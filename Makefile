# SPDX-License-Identifier: Apache-2.0
# `make check` and `make test` do all the set-up they need on a fresh machine.
VLLM_VERSION ?= 0.28.0
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: env check status test lint bench clean audit bench-audit

env: $(VENV)/.ready

$(VENV)/.ready: requirements/cpu.txt pyproject.toml scripts/make-env.sh
	scripts/make-env.sh $(VENV) $(VLLM_VERSION)

# The main job on the embedded default: the MiniMax-M3 capture scenario against
# vLLM $(VLLM_VERSION) on the CPU, through vLLM's own plugin loader.
check: env
	$(VENV)/bin/vllm-capture-guard status
	$(VENV)/bin/vllm-capture-guard check

status: env
	$(VENV)/bin/vllm-capture-guard status

lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest

bench: env
	$(PY) benchmarks/bench_guard.py

# Every registered attention backend's capture on shared metadata (issue 4).
audit: env
	$(VENV)/bin/vllm-capture-guard audit

bench-audit: env
	$(PY) benchmarks/bench_audit.py

clean:
	rm -rf $(VENV) .envs
