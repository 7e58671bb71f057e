# The two commands the README starts with: `make train` and `make test`. Both set everything up first.
.PHONY: setup browser train test lint bench mutate gpu-check gpu-check-ray

setup:
	@bash scripts/setup.sh

# Debian's chromium for the MLflow UI test (installed as root with apt-get; otherwise that test is skipped).
browser:
	@bash scripts/browser.sh

# examples/digits.yaml is the built-in default experiment, logged to the MLflow experiment `digits`.
train: setup
	@test -d data/digits/train || .venv/bin/orchestrator prepare digits --out data/digits
	.venv/bin/orchestrator train --config examples/digits.yaml $(ARGS)

# Two pytest-xdist workers, each running whole modules (a module's Ray cluster stays one), the longest first
# (tests/conftest.py orders them; --no-loadscope-reorder keeps that order): most of a Ray test's time is waiting.
test: setup browser
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: setup
	.venv/bin/ruff check orchestrator pipelines tests bench

bench: setup
	.venv/bin/python bench/overhead.py

mutate: setup  # plant known bugs in a copy of the package and check the tests catch each (about a minute)
	.venv/bin/python scripts/mutate.py

# The GPU check (docs/testing.md), two tiers. The torch tier sets nothing up: it runs with this machine's own Python and
# CUDA torch (the .venv's where there is one), a bare GPU machine carrying a few small wheels; 8 minutes on one H100.
GPU_PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py

gpu-check-ray: setup  # a GPU node with the full .venv (a CUDA torch): Ray Train on one GPU, and on two (NCCL)
	.venv/bin/python scripts/gpu_check.py --ray
