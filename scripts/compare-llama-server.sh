#!/usr/bin/env bash
# `switchyard serve` and llama.cpp's `llama-server` under the same load: the same GGUF, the same
# ShareGPT trace (NUM_PROMPTS prompts, default 200, --ignore-eos so both generate the same
# lengths), 2 threads each, one server at a time, measured by `switchyard bench serve`.
#
#   scripts/compare-llama-server.sh [RATE...]     (default: inf)
#   OUT=reports/serve-peer NUM_PROMPTS=200 scripts/compare-llama-server.sh inf 0.3
#
# Writes OUT/{switchyard,llama-server}-rate-RATE.{json,md} and OUT/peer.txt (the peer's
# version and flags). llama-server is built from source on first use (scripts/llama-server.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${SWITCHYARD_HOME:-$HOME/.cache/switchyard}
OUT=${OUT:-reports/serve-peer}
NUM_PROMPTS=${NUM_PROMPTS:-200}
BUDGET=${BUDGET:-2GiB}
MODEL_NAME=smollm2-135m-instruct
SY_PORT=8011
LL_PORT=8081
[ $# -gt 0 ] || set -- inf
mkdir -p "$OUT"
cargo build --release -p switchyard-cli --quiet
SY=target/release/switchyard
$SY models pull "$MODEL_NAME" sharegpt >&2
MODEL=$HOME_DIR/models/$MODEL_NAME.gguf
scripts/llama-server.sh version >"$OUT/peer.txt"
echo "PARALLEL=${PARALLEL:-32} CTX_PER_SLOT=${CTX_PER_SLOT:-2048}; see scripts/llama-server.sh run" >>"$OUT/peer.txt"

server_pid=
stop() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
  fi
}
trap stop EXIT

wait_ready() {
  for _ in $(seq 1 240); do
    curl -fs "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server on port $1 did not come up" >&2
  exit 1
}

measure() {
  local name=$1 port=$2 rate
  shift 2
  for rate in "$@"; do
    echo "== $name, rate $rate" >&2
    $SY bench serve --url "http://127.0.0.1:$port" --model "$MODEL_NAME" \
      --tokenizer "$MODEL_NAME" --dataset sharegpt --num-prompts "$NUM_PROMPTS" \
      --request-rate "$rate" --ignore-eos --threads 1 \
      --json "$OUT/$name-rate-$rate.json" --markdown "$OUT/$name-rate-$rate.md" >&2
  done
}

$SY serve --model "$MODEL_NAME" --port "$SY_PORT" --threads 2 --memory-budget "$BUDGET" \
  >"$OUT/switchyard-server.log" 2>&1 &
server_pid=$!
wait_ready "$SY_PORT"
measure switchyard "$SY_PORT" "$@"
stop

scripts/llama-server.sh run "$MODEL" "$LL_PORT" >"$OUT/llama-server.log" 2>&1 &
server_pid=$!
wait_ready "$LL_PORT"
measure llama-server "$LL_PORT" "$@"
stop
