#!/usr/bin/env bash
# A single-replica request-rate sweep on the GPU host: one `roseray serve` engine (Qwen3-0.6B
# geometry), Poisson arrivals, prompts 128-4096 tokens, outputs 64-512, at several rates,
# with chunked prefill (a small token budget) and with chunking effectively off (a budget
# above the longest prompt). Usage: bash scripts/locust_sweep.sh "RATES" SECONDS BUDGETS
set -uo pipefail
OUT=${OUT:-bench_results}; rates=${1:-"2 4 8"}; secs=${2:-40}; budgets=${3:-"512 16384"}
port=8013
for budget in $budgets; do
  python -m roseray.cli serve --model ${MODEL:-random:qwen3-0.6b} --port $port --max-model-len ${MAXLEN:-4608} \
      --max-num-batched-tokens $budget --no-enable-prefix-caching > "$OUT/server-$budget.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$port/ready >/dev/null && break; sleep 1; done
  for rate in $rates; do
    dir="$OUT/b$budget-r$rate"
    timeout $((secs + 60)) python -m locust -f locustfile.py --headless -H http://127.0.0.1:$port \
        -u 512 -r 512 -t ${secs}s --warmup 5 --request-rate $rate --prompt-tokens ${PROMPTS:-128:4096} \
        --output-tokens ${OUTPUTS:-64:512} --token-ids 0:${MAXID:-10000} --drain-timeout 30 --report-dir "$dir" \
        --itl-events off --processes ${PROCS:-1} > "$dir.log" 2>&1
    python - "$dir/summary.json" "$budget" "$rate" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); t = s["total"]
f = lambda m: f"{t[m]['p50']:.1f}/{t[m]['p99']:.1f}"
print(f"budget {sys.argv[2]:>5} rate {sys.argv[3]:>4}: sent {s['request_rate']['sent_per_s']:.2f}/s "
      f"ok {s['request_rate']['succeeded_per_s']:.2f}/s, out {s['throughput']['output_tokens_per_s']:.0f} tok/s, "
      f"TTFT {f('ttft_ms')} ITL {f('itl_ms')} TPOT {f('tpot_ms')} E2E {f('e2e_ms')} ms (p50/p99), "
      f"failures {s['failures'].get('total', s['failures'])}" + (" [client CPU-bound]" if s["client"]["cpu_bound"] else ""))
PY
  done
  kill $server; wait $server 2>/dev/null
done
