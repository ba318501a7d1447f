# One command per habit. `make run` and `make test` work on a fresh machine.
PY_SYS ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.miles-installed
RECIPE ?= recipes/default.yaml
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: setup run test test-verifiers check lint fmt bench guard slurm-up slurm-down clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch pinned to the CPU build on disk here; GPU machines bring their own torch
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,wandb]'
	# OpenEnv's client for the environment adapter's test, without its UI stack (gradio would pin pillow back)
	$(PIP) install -q fastmcp websockets && $(PIP) install -q --no-deps 'openenv-core>=0.3,<0.4'
	# bubblewrap runs agent sandboxes (a Debian package; installed here when run as root)
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -q bubblewrap; } || echo "miles: install bubblewrap for local sandboxes"
	touch $(STAMP)

run: setup
	$(VENV)/bin/miles train $(RECIPE) --overwrite
	$(VENV)/bin/miles plot runs/default

# The in-process tests (unit, protocol, security) run on two workers; the ones that start runs, engines
# and Slurm jobs of their own (e2e, integration) on two workers too, a file's tests on one worker
# (--dist loadfile: a module's fixtures, engines and clusters are not shared across workers).
test: setup lint
	$(PYTEST) -n 2 --durations=20 tests/unit tests/protocol tests/security
	$(PYTEST) -n 2 --dist loadfile --durations=30 tests/e2e tests/integration tests/gpu
	$(MAKE) test-verifiers

# The Verifiers adapter's contract test runs in an environment of its own: verifiers 0.4 pins
# openai 2.x and an older mcp than the rest of the dev environment (OpenEnv's client) uses.
VF_VENV := .venv-verifiers
test-verifiers: $(VF_VENV)/.installed
	PATH="$(CURDIR)/$(VF_VENV)/bin:$$PATH" PYTHONPATH="$(CURDIR)" $(VF_VENV)/bin/python -m pytest -q \
		-p no:cacheprovider tests/unit/test_env_adapters.py -k verifiers

$(VF_VENV)/.installed:
	test -x $(VF_VENV)/bin/python || $(PY_SYS) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install -q 'verifiers>=0.4,<0.5' uv pytest pytest-timeout aiohttp
	touch $@

check: setup lint
	$(PYTEST) -m "not slow and not slurm and not gpu" tests

lint: setup
	$(VENV)/bin/ruff check miles tests bench launchers
	$(VENV)/bin/ruff format --check miles tests bench launchers

fmt: setup
	$(VENV)/bin/ruff check --fix miles tests bench launchers
	$(VENV)/bin/ruff format miles tests bench launchers

bench: setup
	$(PY) -m bench

# The headline speed figures against bench/baseline.json; exits non-zero naming a figure >10% worse.
# Run before submitting a change to the engine, trainer, weights or loop hot paths (GPU: on one H200).
guard: setup
	$(PY) -m bench.guard $(if $(CPU),--cpu)

slurm-up:
	bash slurm/up.sh

slurm-down:
	bash slurm/down.sh

clean:
	rm -rf runs .pytest_cache
