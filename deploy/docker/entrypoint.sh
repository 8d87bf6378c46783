#!/bin/sh
# Container entry: start ffn-serve (or run the command given), reading $MODELS_DIR/config.toml
# when FFN_CONFIG is not set. ffn-serve serves its built-in `demo` only when that folder is empty:
# a folder it cannot read, or one holding files but no config.toml (a misnamed config), stops the
# start with a message, instead of a healthy `demo` that hides the mistake.
# `exec` keeps one process: the server itself gets the SIGTERM of `docker stop` and drains.
set -eu

models_dir="${MODELS_DIR:-/models}"

# No command, or only flags (`docker run IMAGE --port 9000`): they are ffn-serve's.
case "${1:-}" in
    "" | -*) set -- ffn-serve "$@" ;;
esac

refuse() {
    echo "ffn-entrypoint: $*" >&2
    exit 2  # ffn-serve's exit code for unusable settings
}

if [ "$1" = ffn-serve ] && [ -z "${FFN_CONFIG:-}" ] && [ -e "$models_dir" ]; then
    if [ ! -r "$models_dir" ] || [ ! -x "$models_dir" ]; then
        refuse "cannot read the model folder $models_dir as uid $(id -u), gid $(id -g):" \
            "make it readable by that user (e.g. chmod -R a+rX on the host) or run as its owner (--user)"
    fi
    config="$models_dir/config.toml"
    if [ -e "$config" ] || [ -L "$config" ]; then
        export FFN_CONFIG="$config"  # unreadable or broken: ffn-serve says why and exits 2
    else
        # Hidden files (the glob skips them), READMEs and a file system's lost+found do not make
        # a folder hold models.
        found="" count=0
        for path in "$models_dir"/*; do
            [ -e "$path" ] || [ -L "$path" ] || continue  # an empty folder: the pattern itself
            case "${path##*/}" in
                README* | lost+found) ;;
                *)
                    count=$((count + 1))
                    if [ "$count" -le 5 ]; then found="$found${path##*/} "; else found="${found%... }... "; fi
                    ;;
            esac
        done
        if [ -n "$found" ]; then
            refuse "the model folder $models_dir holds ${found}but no config.toml:" \
                "name the config file config.toml, or set FFN_CONFIG to it (the built-in demo model is" \
                "served only from an empty folder)"
        fi
    fi
fi
exec "$@"
