#!/usr/bin/env bash
# Create .venv with ffn-serve and its test extra. torch==2.13.0 (the CPU wheel) is installed
# first so that no later requirement pulls the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[test]'
else
  .venv/bin/python -m pip install -q -e .
fi
