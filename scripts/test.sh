#!/usr/bin/env bash
# Set up (once) and run every test: ruff (lint and format), mypy over app, ffn_core, ffn_client and ffn_testing,
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
# Bytecode is written, whatever the caller's PYTHONDONTWRITEBYTECODE: a run starts some 200 Python
# processes (servers, workers, CLI runs), and without it each would compile anew what it imports
# (torch, FastAPI, ...: seconds of CPU each). scripts/setup.sh --test compiles nothing for that
# reason: the first process to import a module compiles it for the rest. __pycache__ is ignored by git.
unset PYTHONDONTWRITEBYTECODE
# Compiled before the run, each once: the project's modules (half a second), and, where torch has
# not been imported yet, what every test process imports, by collecting the tests in one process
# (torch, the server's stack and the test tools, some 1,500 files, and the test modules as pytest
# rewrites their asserts: about 20 s of CPU on a fresh clone). Else the four test processes would
# each compile all of it at once, for itself: each then spent 15 to 21 s of CPU collecting, and
# 11 s with everything compiled.
compile_project() {
  .venv/bin/python -m compileall -q app ffn_core ffn_client ffn_testing bench >/dev/null || true
  compgen -G ".venv/lib/python3*/site-packages/torch/__pycache__/__init__.*.pyc" >/dev/null \
    || .venv/bin/python -m pytest --collect-only -q -p no:cacheprovider >/dev/null \
    || true
}
# A tool of the test extra missing (an older .venv): set up again, which adds what is new.
[ -x .venv/bin/pytest ] && [ -x .venv/bin/mypy ] && [ -x .venv/bin/ruff ] && [ -x .venv/bin/lint-imports ] \
  && [ -x .venv/bin/docker-compose ] && .venv/bin/python -c "import xdist" 2>/dev/null || bash scripts/setup.sh --test
if [ $# -eq 0 ]; then
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  # mypy (17 s on a fresh clone, one core) checks beside pytest rather than before it: the
  # suite's processes spend much of their time waiting on servers and sockets.
  mypy_log=$(mktemp)
  .venv/bin/mypy >"$mypy_log" 2>&1 &
  mypy_pid=$!
  # The whole suite, four test files at a time (pytest-xdist): most tests wait on a server
  # process or a socket rather than compute, so four keep two cores busier than three do (386 s
  # against 425-430 s for the whole pytest run on this project's 2-core machine); a file's
  # module-scoped servers stay in one process.
  # Files are handed out in collection order, the longest first (tests/conftest.py, LONGEST_FIRST).
  compile_project
  status=0
  .venv/bin/python -m pytest -q -p no:cacheprovider -n "${FFN_TEST_PROCESSES:-4}" --dist loadfile \
    --no-loadscope-reorder || status=$?
  wait "$mypy_pid" || { cat "$mypy_log"; rm -f "$mypy_log"; echo "mypy failed" >&2; exit 1; }
  cat "$mypy_log"
  rm -f "$mypy_log"
  exit "$status"
fi
compile_project
exec .venv/bin/python -m pytest -q -p no:cacheprovider ${args[@]+"${args[@]}"}
