#!/usr/bin/env bash
# Triton's Performance Analyzer (PyPI perf-analyzer 2.60.0) on a system whose glibc is older than
# the 2.38 its wheel is built for (Debian 12 has 2.36): the binary runs under Debian trixie's own
# loader and C/C++ runtime, unpacked into a private folder. Nothing is installed on the system.
#   bash scripts/perf-analyzer.sh -m demo -u 127.0.0.1:8000 -i http --input-data zero --shape input:1,512
# First run: downloads the wheel (pip) and three Debian packages (apt-get download, with a private
# package list), about 60 MB, into $PERF_ANALYZER_HOME (default ~/.cache/perf-analyzer).
# Needs a Debian-family system with apt-get and dpkg-deb; elsewhere run perf_analyzer from a
# newer distribution's container, or NVIDIA's tritonserver "-py3-sdk" image, which ships it.
set -euo pipefail
W=${PERF_ANALYZER_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/perf-analyzer}
PA=$W/pa/perf_analyzer/bin/perf_analyzer
TX=$W/tx/usr/lib/x86_64-linux-gnu
if [ ! -x "$PA" ] || [ ! -e "$TX/ld-linux-x86-64.so.2" ]; then
  mkdir -p "$W/dl" "$W/apt/lists/partial" "$W/apt/cache/archives/partial" "$W/apt/etc" "$W/debs"
  echo "perf-analyzer.sh: fetching perf-analyzer 2.60.0 and trixie's libc6, libstdc++6, libgcc-s1 into $W" >&2
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
      --python-version 3.11 -d "$W/dl" perf-analyzer==2.60.0 >&2
  python3 -m zipfile -e "$W"/dl/perf_analyzer-2.60.0-*.whl "$W/pa" && chmod +x "$PA"
  MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main" > "$W/apt/etc/sources.list"
  APTO=(-o Dir::Etc::SourceList="$W/apt/etc/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::Lists="$W/apt/lists" -o Dir::Cache="$W/apt/cache")
  apt-get "${APTO[@]}" -qq update >&2
  (cd "$W/debs" && apt-get "${APTO[@]}" -qq download libc6 libstdc++6 libgcc-s1 >&2)
  for d in "$W"/debs/*.deb; do dpkg-deb -x "$d" "$W/tx"; done
fi
exec "$TX/ld-linux-x86-64.so.2" --library-path "$TX:/lib/x86_64-linux-gnu" "$PA" "$@"
