# Two entry points, both self-bootstrapping: `make demo` and `make test`; `make docs` builds the site the same way.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The transformers adapter is also tested on the newest transformers 5.x, which is what `pip install
# lightning-async-pp[hf]` resolves for users; `.venv` pins 4.x because litgpt caps huggingface-hub below 5's needs.
VENV_HF5 ?= .venv-hf5
PY_HF5 := $(VENV_HF5)/bin/python
STAMP_HF5 := $(VENV_HF5)/.installed
STAMP_DOCS := $(VENV)/.installed-docs

.PHONY: demo test test-quick test-hf5 docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(STAMP_HF5): pyproject.toml
	test -x $(PY_HF5) || $(PYTHON) -m venv $(VENV_HF5)
	$(PY_HF5) -m pip install -q -e '.[test-hf5]'
	touch $(STAMP_HF5)

# mkdocs and its plugins go into .venv only here, after the test environment: `make test` does not wait for them.
$(STAMP_DOCS): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $(STAMP_DOCS)

demo: $(STAMP)
	$(VENV)/bin/lightning-async-pp fit --config configs/demo.yaml

# The transformers adapter's single-process tests (marked `hf`) on 5.x, then the whole suite (4.x and litgpt).
test: $(STAMP) test-hf5
	$(PY) -m pytest -q --durations=40 tests

test-hf5: $(STAMP_HF5)
	$(PY_HF5) -m pytest -q -m "hf and not multiprocess" tests

# While working: the tests that start no processes and take seconds (unmarked by `multiprocess` and `slow`).
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not multiprocess and not slow" tests

# The documentation site into site/, strictly: a broken link or a reference to a renamed name fails.
docs: $(STAMP_DOCS)
	$(VENV)/bin/mkdocs build --strict

# Throughput against torch's schedules, then eager vs compiled layers (BENCHMARKS.md).
bench: $(STAMP)
	$(PY) benchmarks/pipeline_throughput.py
	$(PY) benchmarks/pipeline_throughput.py --compile

clean:
	rm -rf $(VENV) $(VENV_HF5) lightning_logs .cache site
