#!/usr/bin/env bash
# Set up (once) and start the service on its built-in `demo` model at 127.0.0.1:8000.
# It stays in the caller's folder, so a relative `--config my.toml` or FFN_CONFIG is the caller's file.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
[ -x "$ROOT/.venv/bin/ffn-serve" ] || bash "$ROOT/scripts/setup.sh"
exec "$ROOT/.venv/bin/ffn-serve" "$@"
