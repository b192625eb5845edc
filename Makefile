# Two entry points that work on a fresh machine with Python >= 3.10:
#   make quickstart   set up .venv and simulate scenarios/quickstart.yaml into runs/quickstart
#   make test         set up .venv with the test extras and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

.PHONY: quickstart test bench clean
quickstart: $(VENV)/.base
	$(VENV)/bin/twin simulate scenarios/quickstart.yaml --out runs/quickstart

test: $(VENV)/.dev
	$(PY) -m pytest

bench: $(VENV)/.base
	$(PY) benchmarks/bench_speed.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
