#!/usr/bin/env bash
# Create .venv and install the project with its dev tools. Idempotent: a second run only checks a stamp.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}   # the CPU build pip finds locally; GPU users install their CUDA torch first

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.orchestrator-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: otherwise the unpinned range below would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION}"
fi
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "$want" > "$stamp"
echo "set-up done: .venv ready"
