#!/usr/bin/env bash
# The cost of constrained decoding per output token: the same synthetic chat requests (128
# prompt tokens, 128 output tokens, --ignore-eos) with and without a JSON schema that keeps
# every request generating to its limit, against one `switchyard serve`, in alternating rounds.
# A third run per round asks for log-probabilities as well, which makes every constrained
# position compute its full mask (rows whose log-probabilities are read cannot be drawn before
# the mask): it shows what drawing first and checking the token saves.
#
#   scripts/constrained-cost.sh                  (ROUNDS=4 CONCURRENCY="32 1")
#   OUT=reports/constrained ROUNDS=4 scripts/constrained-cost.sh
#
# Writes OUT/c{CONCURRENCY}-{plain,schema,masked}-{ROUND}.json, the server's constrained
# counters before and after each run (OUT/c…-{ROUND}.{before,after}.prom) and at the end
# (OUT/metrics.txt), and prints the mean-TPOT table with each constrained run's share of step
# time spent on constraints, as the server counted it in the same steps.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/constrained}
ROUNDS=${ROUNDS:-4}
CONCURRENCY=${CONCURRENCY:-"32 1"}
PORT=${PORT:-8011}
MODEL=smollm2-135m-instruct
mkdir -p "$OUT"
cargo build --release -p switchyard-cli --quiet
SY=target/release/switchyard
$SY models pull "$MODEL" >&2
cfg=$(mktemp --suffix=.toml)
printf '[server]\nport = %s\n[[models]]\nname = "%s"\nmemory_budget = "2GiB"\n' "$PORT" "$MODEL" >"$cfg"
$SY serve --config "$cfg" >&2 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$cfg"' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 1
done
FORMAT='"response_format":{"type":"json_schema","json_schema":{"name":"list","schema":{"type":"array","items":{"type":"string","maxLength":30},"minItems":200}}}'
SCHEMA="{$FORMAT}"
MASKED="{$FORMAT,\"logprobs\":true}"
run() { # concurrency kind round
  local c=$1 kind=$2 r=$3 n=$(($1 * 2))
  [ "$c" -eq 1 ] && n=6
  local extra=()
  [ "$kind" = schema ] && extra=(--extra-body "$SCHEMA")
  [ "$kind" = masked ] && extra=(--extra-body "$MASKED")
  snapshot >"$OUT/c$c-$kind-$r.before.prom"
  $SY bench serve --url "http://127.0.0.1:$PORT" --model "$MODEL" --dataset synthetic \
    --input-len 128 --output-len 128 --ignore-eos --endpoint chat --num-prompts "$n" \
    --max-concurrency "$c" "${extra[@]}" --json "$OUT/c$c-$kind-$r.json" >/dev/null
  snapshot >"$OUT/c$c-$kind-$r.after.prom"
}
# The server's own account of constrained work (seconds spent on constraints and wall seconds
# of the steps that sampled a constrained row), read before and after each run: measured in
# the same steps, it does not depend on how noisy the runs are against each other.
snapshot() {
  curl -sf "http://127.0.0.1:$PORT/metrics" | grep '^switchyard_constrained_' || true
}
# One warm-up request so the first round does not pay the cold start.
run 1 plain 0 && rm -f "$OUT"/c1-plain-0.*
for c in $CONCURRENCY; do
  for r in $(seq 1 "$ROUNDS"); do
    # Odd rounds run plain first, even rounds last, so that no kind always follows another.
    if [ $((r % 2)) -eq 1 ]; then
      run "$c" plain "$r"
      run "$c" schema "$r"
      run "$c" masked "$r"
    else
      run "$c" masked "$r"
      run "$c" schema "$r"
      run "$c" plain "$r"
    fi
  done
done
curl -sf "http://127.0.0.1:$PORT/metrics" | grep '^switchyard_constrained_' >"$OUT/metrics.txt" || true
cat "$OUT/metrics.txt"
python3 - "$OUT" "$ROUNDS" $CONCURRENCY <<'EOF'
import json, statistics, sys
out, rounds, cs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def counters(path):
    got = {}
    for line in open(path):
        name, value = line.rsplit(" ", 1)
        got[name] = float(value)
    return got

def share(c, kind, r):
    """Constraint seconds over the wall seconds of the steps that sampled a constrained row,
    in this run alone (the server's counters after it less before it)."""
    before = counters(f"{out}/c{c}-{kind}-{r}.before.prom")
    after = counters(f"{out}/c{c}-{kind}-{r}.after.prom")
    delta = lambda k: sum(v - before.get(n, 0.0) for n, v in after.items() if f'kind="{k}"' in n and "seconds" in n)
    step = delta("step")
    return delta("constraint") / step if step > 0 else float("nan")

print("| concurrency | round | plain mean TPOT (ms) | constrained | ratio | share of step | every position masked | ratio | share of step |")
print("|---|---|---|---|---|---|---|---|---|")
for c in cs:
    ratios, masked, shares, mshares = [], [], [], []
    for r in range(1, rounds + 1):
        tpot = lambda kind: json.load(open(f"{out}/c{c}-{kind}-{r}.json"))["mean_tpot_ms"]
        p, s, m = tpot("plain"), tpot("schema"), tpot("masked")
        ratios.append(s / p)
        masked.append(m / p)
        shares.append(share(c, "schema", r))
        mshares.append(share(c, "masked", r))
        print(f"| {c} | {r} | {p:.2f} | {s:.2f} | {s / p:.3f} | {shares[-1]:.2%} | {m:.2f} | {m / p:.3f} | {mshares[-1]:.2%} |")
    print(f"| {c} | median | | | {statistics.median(ratios):.3f} | {statistics.median(shares):.2%} | | {statistics.median(masked):.3f} | {statistics.median(mshares):.2%} |")
EOF
