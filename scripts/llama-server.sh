#!/usr/bin/env bash
# llama.cpp's own server, built from source, as the serving peer of `switchyard serve`.
#
#   scripts/llama-server.sh build                  build $SWITCHYARD_HOME/bin/llama-server once
#   scripts/llama-server.sh run MODEL.gguf [PORT]  serve MODEL on 127.0.0.1:PORT (default 8081)
#   scripts/llama-server.sh version                print the sources' version and build flags
#
# The sources are the llama.cpp tree vendored in llama-cpp-python 0.3.36's source
# distribution on PyPI (sha256 checked); CMake comes from PyPI into a venv. Nothing is
# prebuilt. The build is for this CPU (GGML_NATIVE) without AMX: some virtual machines report
# AMX and fault on it, so the server also runs with --no-repack (llama.cpp's repacked
# buffers are where AMX would be used). Run: 2 threads, PARALLEL slots (default 32) sharing
# a context of PARALLEL x CTX_PER_SLOT tokens (default 2048 each), continuous batching on.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${SWITCHYARD_HOME:-$HOME/.cache/switchyard}
VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION.tar.gz
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SRC=$HOME_DIR/src/llama_cpp_python-$VERSION
BIN=$HOME_DIR/bin/llama-server
CMAKE_VENV=$HOME_DIR/venvs/cmake
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF
  -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)

fetch_sources() {
  [ -d "$SRC/vendor/llama.cpp" ] && return
  mkdir -p "$HOME_DIR/src"
  local tmp
  tmp=$(mktemp -d)
  # The sdist's address from PyPI's simple index (pip would try to build it to read metadata).
  local url
  url=$(curl -fsSL "https://pypi.org/simple/llama-cpp-python/" |
    grep -o "https://[^\"#]*/$SDIST" | head -1)
  [ -n "$url" ] || { echo "no $SDIST on PyPI's index" >&2; exit 1; }
  curl -fsSL -o "$tmp/$SDIST" "$url"
  echo "$SHA256  $tmp/$SDIST" | sha256sum -c --quiet - ||
    { echo "$SDIST: sha256 mismatch" >&2; exit 1; }
  tar xzf "$tmp/$SDIST" -C "$HOME_DIR/src"
  rm -rf "$tmp"
}

build() {
  [ -x "$BIN" ] && return
  fetch_sources
  if [ ! -x "$CMAKE_VENV/bin/cmake" ]; then
    python3 -m venv "$CMAKE_VENV"
    "$CMAKE_VENV/bin/pip" install --quiet cmake
  fi
  local build=$SRC/build-server
  "$CMAKE_VENV/bin/cmake" -S "$SRC/vendor/llama.cpp" -B "$build" "${FLAGS[@]}" >&2
  "$CMAKE_VENV/bin/cmake" --build "$build" --target llama-server -j "$(nproc)" >&2
  mkdir -p "$(dirname "$BIN")"
  cp "$build/bin/llama-server" "$BIN"
}

case "${1:-}" in
  build) build ;;
  version)
    build
    echo "llama.cpp from llama-cpp-python $VERSION ($("$BIN" --version 2>&1 | grep -m1 version || true)); cmake ${FLAGS[*]}"
    ;;
  run)
    build
    model=${2:?model path}
    port=${3:-8081}
    parallel=${PARALLEL:-32}
    ctx=${CTX_PER_SLOT:-2048}
    exec "$BIN" -m "$model" --host 127.0.0.1 --port "$port" -t 2 -tb 2 \
      --parallel "$parallel" -c $((parallel * ctx)) --cont-batching --no-repack \
      --no-webui --log-disable
    ;;
  *)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
