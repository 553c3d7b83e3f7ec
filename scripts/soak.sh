#!/usr/bin/env bash
# `switchyard bench soak` on SmolLM2: a fresh `switchyard serve` held at 80% of its measured
# saturation rate for DURATION_S seconds (the figure run: 3600), with an overload burst at 10x
# saturation half-way through; the report (JSON, Markdown, two PNGs) and both servers' logs go
# to ${OUT:-reports/soak}.
#
#   scripts/soak.sh                                  (one hour)
#   DURATION_S=120 MAX_TOKENS=64 scripts/soak.sh     (two minutes)
#
# The saturation rate is measured first, on its own server: `bench serve --request-rate inf`
# sends SAT_PROMPTS ShareGPT prompts at once, at most 90% of MAX_IN_FLIGHT in flight (under the
# server's admission limit, so none is refused), and the rate is the requests answered per second:
# completed ones plus those the model ended at once (EOS first), which `bench serve` counts as
# failed for want of text but the server answered all the same (and `bench soak` counts as
# completed). Any other failure stops the script. That server is then stopped and a fresh one
# started, so that the soak's fixed overhead (VmRSS before its first request) is a server's
# memory after start-up, before any traffic. A run at full batch (all prompts at once) is the
# server at its most efficient: if the report shows 429s before the burst, 80% of it was more
# than the server sustains under Poisson arrivals (a 2-minute run on two cores with
# SAT_PROMPTS=64 measured 6.5 req/s and then sustained ~3.8): raise SAT_PROMPTS or lower
# LOAD_FRACTION.
#
# Settings (environment): DURATION_S (3600), OUT (reports/soak), MODEL (smollm2-135m-instruct),
# PORT (8123), MEMORY_BUDGET (512MiB), MAX_IN_FLIGHT (32), MAX_TOKENS (unset: each ShareGPT
# answer's length; set, a cap for both the saturation run and the soak), SAT_PROMPTS (200),
# LOAD_FRACTION (0.8), BURST_FACTOR (10), BURST_S (30, at most 5% of the run), WINDOW_S (300,
# or a sixth of a run shorter than 30 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION_S=${DURATION_S:-3600}
OUT=${OUT:-reports/soak}
MODEL=${MODEL:-smollm2-135m-instruct}
PORT=${PORT:-8123}
MEMORY_BUDGET=${MEMORY_BUDGET:-512MiB}
MAX_IN_FLIGHT=${MAX_IN_FLIGHT:-32}
MAX_TOKENS=${MAX_TOKENS:-}
SAT_PROMPTS=${SAT_PROMPTS:-200}
LOAD_FRACTION=${LOAD_FRACTION:-0.8}
BURST_FACTOR=${BURST_FACTOR:-10}
BURST_S=${BURST_S:-$(python3 -c "print(min(30, max(1, round($DURATION_S * 0.05))))")}
BURST_AT_S=${BURST_AT_S:-$(python3 -c "print(round($DURATION_S / 2))")}
WINDOW_S=${WINDOW_S:-$(python3 -c "print(300 if $DURATION_S >= 1800 else max(1, round($DURATION_S / 6)))")}

cargo build --release --workspace --quiet
SY=target/release/switchyard
$SY models pull "$MODEL" sharegpt >&2
mkdir -p "$OUT"
cat >"$OUT/serve.toml" <<EOF
[server]
port = $PORT
max_in_flight = $MAX_IN_FLIGHT

[[models]]
name = "$MODEL"
memory_budget = "$MEMORY_BUDGET"
EOF
URL=http://127.0.0.1:$PORT

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
  fi
}
trap stop_server EXIT

# Starts a server logging to $1 and waits until it listens.
start_server() {
  $SY serve --config "$OUT/serve.toml" 2>"$1" &
  SERVER_PID=$!
  for _ in $(seq 1 360); do
    if grep -q "listening on http://" "$1"; then
      return 0
    fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "switchyard serve exited; its log:" >&2
      cat "$1" >&2
      exit 1
    fi
    sleep 0.5
  done
  echo "switchyard serve did not start within 180 s (log: $1)" >&2
  exit 1
}

EXTRA=()
SOAK_CAP=()
if [ -n "$MAX_TOKENS" ]; then
  EXTRA=(--extra-body "{\"max_tokens\": $MAX_TOKENS}")
  SOAK_CAP=(--max-tokens "$MAX_TOKENS")
fi

# A little under the admission limit: the server counts a request until its stream is dropped,
# a moment after the client has read [DONE], so a client at exactly the limit gets a few 429s.
SAT_CONCURRENCY=$((MAX_IN_FLIGHT * 9 / 10 > 0 ? MAX_IN_FLIGHT * 9 / 10 : 1))
echo "measuring the saturation rate ($SAT_PROMPTS prompts at once, at most $SAT_CONCURRENCY in flight)" >&2
start_server "$OUT/serve-saturation.log"
$SY bench serve --url "$URL" --model "$MODEL" --request-rate inf \
  --num-prompts "$SAT_PROMPTS" --max-concurrency "$SAT_CONCURRENCY" "${EXTRA[@]}" \
  --json "$OUT/saturation.json" --markdown "$OUT/saturation.md" >/dev/null
stop_server
SATURATION=$(python3 - "$OUT/saturation.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
empty = sum(e["count"] for e in r["errors"]
            if e["message"].startswith("the stream ended before any generated text"))
other = r["failed"] - empty
if other:
    sys.exit(f"the saturation run had {other} failures besides empty answers: {r['errors']}")
print(f"{(r['completed'] + empty) / r['duration_s']:.4f}")
EOF
)
BURST_RATE=$(python3 -c "print(round($SATURATION * $BURST_FACTOR, 4))")
echo "saturation $SATURATION req/s: soaking at $LOAD_FRACTION of it for $DURATION_S s, burst of $BURST_RATE req/s at $BURST_AT_S s for $BURST_S s" >&2

start_server "$OUT/serve.log"
$SY bench soak --url "$URL" --server-pid "$SERVER_PID" --model "$MODEL" "${SOAK_CAP[@]}" \
  --saturation-rate "$SATURATION" --load-fraction "$LOAD_FRACTION" \
  --duration-s "$DURATION_S" --window-s "$WINDOW_S" \
  --burst-at-s "$BURST_AT_S" --burst-s "$BURST_S" --burst-rate "$BURST_RATE" \
  --json "$OUT/soak.json" --markdown "$OUT/soak.md" --plot "$OUT/soak.png"
stop_server
echo "wrote $OUT/soak.json, $OUT/soak.md, $OUT/soak.png, $OUT/soak-latency.png" >&2
