# Two entry points that work on a fresh machine with Python >= 3.10:
#   make quickstart   set up .venv and simulate scenarios/quickstart.yaml into runs/quickstart
#   make test         set up .venv with the test extras (dev, predict) and run the test suite
#                   (the light suite, then test-vllm)
# Optional: make compiled (a mypyc-compiled install in .venv-fast), make test-compiled, make bench,
#           make test-vllm (the heavy suite against real vLLM in .venv-vllm, built by scripts/setup_vllm_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
FAST := .venv-fast
HOT := $(shell sed -n 's/^ *"\(twin\/.*\.py\)",$$/\1/p' setup.py)

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# the test venv also has the predictor, live, plan (statsmodels) and ray extras (torch CPU first, from the local wheel: never a CUDA build)
$(VENV)/.dev: $(VENV)/.base
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,predict,live,plan,ray]'
	touch $@

$(FAST)/.compiled: pyproject.toml setup.py $(shell find twin -name "*.py" -o -name "*.yaml")
	python3 -m venv $(FAST)
	$(FAST)/bin/python -m pip install -q --upgrade pip setuptools wheel mypy
	LLMTWIN_COMPILE=1 $(FAST)/bin/python -m pip install -q --no-build-isolation '.[dev,plan]'
	touch $@

.PHONY: quickstart test test-vllm compiled test-compiled bench clean
quickstart: $(VENV)/.base
	$(VENV)/bin/twin simulate scenarios/quickstart.yaml --out runs/quickstart

test: $(VENV)/.dev
	$(PY) -m pytest
	$(MAKE) test-vllm

# tests_vllm/ (outside tests/, so the light and compiled suites never collect it) in the heavy env, one process:
# the live tests' missing KV events were a controller rebinding an endpoint whose ZMQ socket had not closed
# yet (live/kv_subscriber.py), not an effect of the parity harness importing vLLM
test-vllm:
	bash scripts/setup_vllm_env.sh
	.venv-vllm/bin/python -m pytest tests_vllm

compiled: $(FAST)/.compiled

# the same suite against the compiled install (its pytest script does not put the source tree first)
test-compiled: $(FAST)/.compiled
	LLMTWIN_EXPECT_COMPILED=1 $(FAST)/bin/pytest

bench: $(FAST)/.compiled
	$(FAST)/bin/python benchmarks/bench_speed.py

clean:
	rm -rf $(VENV) $(FAST) .venv-vllm build runs .pytest_cache .hypothesis
