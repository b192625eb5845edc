# Two entry points that work on a fresh machine with Python >= 3.10:
#   make quickstart   set up .venv and simulate scenarios/quickstart.yaml into runs/quickstart
#   make test         set up .venv with the test extras and run the test suite
# Optional: make compiled (a mypyc-compiled install in .venv-fast), make test-compiled, make bench.
VENV ?= .venv
PY := $(VENV)/bin/python
FAST := .venv-fast
HOT := $(shell sed -n 's/^ *"\(twin\/.*\.py\)",$$/\1/p' setup.py)

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PY) -m pip install -q -e '.[dev,plan]'
	touch $@

$(FAST)/.compiled: pyproject.toml setup.py $(HOT)
	python3 -m venv $(FAST)
	$(FAST)/bin/python -m pip install -q --upgrade pip setuptools wheel mypy
	LLMTWIN_COMPILE=1 $(FAST)/bin/python -m pip install -q --no-build-isolation '.[dev]'
	touch $@

.PHONY: quickstart test compiled test-compiled bench clean
quickstart: $(VENV)/.base
	$(VENV)/bin/twin simulate scenarios/quickstart.yaml --out runs/quickstart

test: $(VENV)/.dev
	$(PY) -m pytest

compiled: $(FAST)/.compiled

# the same suite against the compiled install (its pytest script does not put the source tree first)
test-compiled: $(FAST)/.compiled
	LLMTWIN_EXPECT_COMPILED=1 $(FAST)/bin/pytest

bench: $(FAST)/.compiled
	$(FAST)/bin/python benchmarks/bench_speed.py

clean:
	rm -rf $(VENV) $(FAST) build runs .pytest_cache .hypothesis
