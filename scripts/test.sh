#!/usr/bin/env bash
# Set up (once) and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pytest ] || bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
