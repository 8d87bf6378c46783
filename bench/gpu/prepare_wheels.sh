#!/usr/bin/env bash
# Run where pip and apt-get reach their registries (this machine), before bench/gpu/run.sh runs on
# a GPU machine that reaches nothing. Its image has torch, numpy, httpx, safetensors, uvloop,
# prometheus-client, rich, matplotlib and pytest, but not the service's web stack; this fetches:
#   .whl/py3/    pure-Python wheels: fastapi, starlette, pydantic, pydantic-settings, uvicorn, their
#                small dependencies, fastapi-offline, the gRPC door's (tritonclient, grpcio-health-checking,
#                grpcio-reflection), OpenTelemetry's, pytest and pytest-asyncio (the versions of this
#                checkout's .venv, which the test suite ran with);
#   .whl/cpXY/   the compiled ones (pydantic-core, httptools, orjson, msgspec, grpcio, protobuf, python-rapidjson) for each Python in PYVERS,
#                manylinux x86_64; run.sh installs the folder matching the GPU machine's python3;
#   .tools/      wrk and its libluajit (Debian bookworm, glibc 2.36: runs on newer glibc too).
# Both folders are git-ignored; pass them to the GPU machine along with the working tree.
#   PYVERS="3.12 3.11" bash bench/gpu/prepare_wheels.sh      # (the default)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVERS="${PYVERS:-3.12 3.11}"
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run scripts/setup.sh --test first" >&2; exit 2; }

PURE="fastapi starlette pydantic pydantic-settings python-dotenv annotated-types typing-inspection typing-extensions
      annotated-doc opentelemetry-api uvicorn h11 click pytest pluggy pytest-asyncio fastapi-offline
      grpcio-health-checking grpcio-reflection tritonclient googleapis-common-protos opentelemetry-sdk
      opentelemetry-semantic-conventions opentelemetry-proto opentelemetry-exporter-otlp-proto-http
      opentelemetry-exporter-otlp-proto-common"
# grpcio and protobuf too, although the image has them: the generated code of tritonclient and of
# the gRPC health service wants the versions the suite ran with.
COMPILED="pydantic-core httptools orjson msgspec grpcio protobuf python-rapidjson"
pinned() {  # "name==version" for each name, as installed in .venv
  "$PY" -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "$@"
}

rm -rf .whl .tools
mkdir -p .whl/py3
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl/py3 $(pinned $PURE)
for version in $PYVERS; do
  tag="cp${version/./}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d ".whl/$tag" $(pinned $COMPILED)
done

debs=$(mktemp -d)
(cd "$debs" && apt-get download wrk libluajit-5.1-2 >/dev/null 2>&1)
for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$debs/root"; done
mkdir -p .tools/bin .tools/lib
cp "$debs/root/usr/bin/wrk" .tools/bin/
cp -a "$debs"/root/usr/lib/x86_64-linux-gnu/libluajit-5.1.so.2* .tools/lib/
rm -rf "$debs"

du -sh .whl .tools
ls .whl/*
