#!/usr/bin/env bash
# Debian's chromium for tests/integration/test_mlflow_ui.py (the MLflow UI in a headless browser), installed when
# missing and this runs as root with apt-get; otherwise one line says that test will be skipped. Idempotent.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium is missing (the MLflow UI test will be skipped): install it with \`apt-get install -y chromium\`"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
  || { apt-get update >/dev/null && apt-get install -y --no-install-recommends chromium >/dev/null; }
echo "installed chromium for the MLflow UI test"
