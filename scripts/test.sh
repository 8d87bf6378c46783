#!/usr/bin/env bash
# Set up (once) and run every test: ruff (lint and format), mypy over app, ffn_core and ffn_client,
# then pytest.
# With arguments, only pytest runs, with them (e.g. `bash scripts/test.sh tests/test_http.py -x`);
# a test file or folder is taken relative to the caller's folder, as pytest itself would.
set -euo pipefail
args=()
for arg in "$@"; do
  path="${arg%%::*}" # a node id, tests/test_x.py::test_y, names its file before the ::
  if [ "${arg#-}" = "$arg" ] && [ -e "$path" ]; then
    arg="$(cd "$(dirname "$path")" && pwd)/$(basename "$path")${arg:${#path}}"
  fi
  args+=("$arg")
done
cd "$(dirname "$0")/.."
# A tool of the test extra missing (an older .venv): set up again, which adds what is new.
[ -x .venv/bin/pytest ] && [ -x .venv/bin/mypy ] && [ -x .venv/bin/ruff ] && [ -x .venv/bin/lint-imports ] \
  && [ -x .venv/bin/docker-compose ] || bash scripts/setup.sh --test
if [ $# -eq 0 ]; then
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/mypy
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider ${args[@]+"${args[@]}"}
