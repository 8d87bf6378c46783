#!/usr/bin/env bash
# Set up (once) and start the service on its built-in `demo` model at 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/ffn-serve ] || bash scripts/setup.sh
exec .venv/bin/ffn-serve "$@"
