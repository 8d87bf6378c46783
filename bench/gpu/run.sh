#!/usr/bin/env bash
# The GPU benchmark on a GPU machine, one command, from the repository root:
#   bash bench/gpu/run.sh [bench.gpu options]        # e.g. --seconds 3, --skip-service, --workers 1,8, --shared-engine
# 1. installs the wheels bench/gpu/prepare_wheels.sh put in .whl/ (for this python3) into /tmp/site,
#    and puts .tools/ (wrk) on the PATH, where they are there (a machine that reaches no registry);
# 2. runs the CUDA tests and the GPU path's CPU tests (graphs, streams, the warm-up check, invariance);
# 3. runs `python3 -m bench.gpu --profile` into $OUT (the device tool's folder) or bench/gpu/results.
# Everything printed also goes to $OUT/log.txt, so a run cut short still returns what it did.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench/gpu/results}"
SITE="${SITE:-/tmp/site}"  # where the carried wheels are installed
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1

if [ -d .whl/py3 ]; then
  tag=$(python3 -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
  [ -d ".whl/$tag" ] || { echo "no wheels for $tag in .whl/: PYVERS=... bash bench/gpu/prepare_wheels.sh" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/py3/*.whl ".whl/$tag"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -x .tools/bin/wrk ]; then
  export PATH="$PWD/.tools/bin:$PATH" LD_LIBRARY_PATH="$PWD/.tools/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
# Only our plugin: the image's own pytest plugins need not suit the pytest carried in .whl/.
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -q -p no:cacheprovider -p pytest_asyncio.plugin -rs \
  tests/test_gpu.py tests/test_runner.py tests/test_batch_invariant.py tests/test_fused_gate.py \
  tests/test_wire_dtype.py || echo "SOME TESTS FAILED (above); the benchmark runs anyway"
python3 -m bench.gpu --out "$OUT" --profile "$@"
