#!/bin/sh
# Container entry: start ffn-serve (or run the command given), reading $MODELS_DIR/config.toml
# when one is mounted and FFN_CONFIG is not set; with neither, ffn-serve serves its built-in `demo`.
# `exec` keeps one process: the server itself gets the SIGTERM of `docker stop` and drains.
set -eu

models_dir="${MODELS_DIR:-/models}"
if [ -z "${FFN_CONFIG:-}" ] && [ -f "$models_dir/config.toml" ]; then
    export FFN_CONFIG="$models_dir/config.toml"
fi

# No command, or only flags (`docker run IMAGE --port 9000`): they are ffn-serve's.
case "${1:-}" in
    "" | -*) set -- ffn-serve "$@" ;;
esac
exec "$@"
