#!/usr/bin/env bash
# Create .venv with ffn-serve and its test extra. torch==2.13.0 (the CPU wheel) is installed
# first so that no later requirement pulls the CUDA build. Where PyPI's torch would be the CUDA
# build (plain Linux), set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU one.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[test]'
else
  .venv/bin/python -m pip install -q -e .
fi
