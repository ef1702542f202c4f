# Two commands on a fresh machine: `make run` and `make test`. Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch (the dev machines keep a copy on disk); GPU hosts install their own torch first.
TORCH ?= torch==2.13.0
# The versions the suite last passed with (scripts/lock_constraints.sh sets it empty to re-resolve freely).
CONSTRAINTS ?= constraints.txt

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test]"
	touch $@

.PHONY: install run generate test bench-engine
install: $(BIN)/.installed

# The main job: the Serve app (ingress + prefill + decode) on the embedded tiny model.
run: install
	$(BIN)/serve run serve_app:app

# Generation from the command line, without Ray.
generate: install
	$(BIN)/gptoss generate --prompt "Hello, who are you?" --max-tokens 16

test: install
	$(BIN)/python -m pytest -q -ra tests

# Engine benchmark (tiny model): throughput, host overhead per step, KV saved by window freeing.
bench-engine: install
	$(BIN)/python -m bench.engine
