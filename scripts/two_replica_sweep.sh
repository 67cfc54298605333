#!/usr/bin/env bash
# Issue 5's two-replica measurement on a 2-GPU host, through the Ray Serve app (HAProxy ->
# Router -> the engine replica streams itself), one locust run per point:
#   a  1 replica,             Poisson rates RATES1, prompts PROMPTS           (the baseline)
#   b  2 replicas, kv_queue,  Poisson rates RATES2 (default 2 x RATES1)       (saturation >= 1.9x?)
#   c  2 replicas, skewed mix (every 8th prompt LONG_TOKENS, the rest PROMPTS_C) at RATESC,
#      router.policy kv_queue, then power_of_two (Ray Serve's default router), same workload
# Each phase starts its own `serve run` (a local Ray) of a config generated from
# serve_config.yaml into $OUT, waits until every replica answers through :PORT, runs the
# points, and stops it (SIGINT: serve.shutdown(), then its Ray exits). One line per point
# on stdout and in $OUT/summary.txt; locust reports in $OUT/<phase>-<policy>-r<rate>/.
#
#   source .gpubundle/activate.sh           # the caller, on the GPU host
#   OUT=$OUT bash scripts/two_replica_sweep.sh "a b c"      # 7-9 min with the defaults
# (4 app starts, 8 points of WARMUP + SECS = 20 s plus drain; BUDGET_S bounds it). Rates: the
# single-replica Poisson sweep (BENCHMARKS.md) was not saturated at 16 req/s with a 16,384-token
# budget; pick RATESC from phase b's knee (the skewed mix has shorter prompts, PROMPTS_C).
#
# Every setting below can be overridden from the environment. CPU smoke run (random:tiny):
#   MODEL=random:tiny GPUS=0 MAXLEN=1024 ENGINE='{"num_kv_blocks": 512, "max_num_seqs": 16}' \
#   RATES1=1 RATES2=2 RATESC=2 SECS=6 WARMUP=2 DRAIN=5 PROMPTS=16:64 PROMPTS_C=16:32 \
#   LONG_TOKENS=256 OUTPUTS=8:16 MAXID=200 PROCS=1 OUT=/tmp/sweep bash scripts/two_replica_sweep.sh
set -uo pipefail
set -m  # background jobs keep SIGINT (a non-interactive shell ignores it in them): `serve run` stops cleanly
cd "$(dirname "$0")/.."
phases=${1:-"a b c"}
OUT=${OUT:-bench_results/two_replica}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
MODEL=${MODEL:-random:qwen3-0.6b}; MAXLEN=${MAXLEN:-4608}; GPUS=${GPUS:-1}
ENGINE=${ENGINE:-'{}'}                      # JSON merged into args.engine (EngineConfig fields)
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}; MAX_WAITING=${MAX_WAITING:-1024}   # roseray serve's defaults
RATES1=${RATES1:-"8 16 32"}; RATES2=${RATES2:-"16 32 64"}; RATESC=${RATESC:-"40"}
POLICIES_C=${POLICIES_C:-"kv_queue power_of_two"}  # phase c's routers, in order
SECS=${SECS:-15}; WARMUP=${WARMUP:-5}; DRAIN=${DRAIN:-15}   # measured s, warm-up s, drain s per point
PROMPTS=${PROMPTS:-128:4096}; OUTPUTS=${OUTPUTS:-64:512}; MAXID=${MAXID:-10000}
PROMPTS_C=${PROMPTS_C:-128:512}; LONG_EVERY=${LONG_EVERY:-8}; LONG_TOKENS=${LONG_TOKENS:-4096}
USERS=${USERS:-512}; PROCS=${PROCS:-4}; PORT=${PORT:-8000}
START_TIMEOUT=${START_TIMEOUT:-180}         # s for a phase's app to serve on every replica
BUDGET_S=${BUDGET_S:-555}                   # no new point or phase starts past this (s since start)
export PYTHONUNBUFFERED=1 PORT MODEL MAXLEN GPUS ENGINE MAX_NUM_SEQS MAX_WAITING  # read by write_config
: > "$OUT/summary.txt"

left() { echo $((BUDGET_S - SECONDS)); }
python -c "import roseray_kernels" 2>/dev/null \
    || python -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
eval "$(python -m roseray.serve.haproxy_env --router-replicas-per-node "${ROUTERS:-auto}")"  # ROUTERS: Router replicas (auto: 4 with GPUs)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
source "$(dirname "$0")/ray_app.sh"
trap 'stop_server' EXIT
trap 'exit 130' INT; trap 'exit 143' TERM  # through the EXIT trap: no Ray left behind

point() {  # point TAG RATE PROMPTS [locust flags...]: one locust run, one summary line
  local tag=$1 rate=$2 prompts=$3; shift 3
  local dir="$OUT/$tag-r$rate"
  if [ "$(left)" -lt $((WARMUP + SECS + 15)) ]; then
    echo "$tag rate $rate: skipped (BUDGET_S=$BUDGET_S reached)" | tee -a "$OUT/summary.txt"; return
  fi
  local procs=(); [ "$PROCS" -gt 1 ] && procs=(--processes "$PROCS")
  timeout $((WARMUP + SECS + DRAIN + 60)) python -m locust -f locustfile.py --headless -H "$url" \
      -u "$USERS" -r "$USERS" -t $((WARMUP + SECS))s --warmup "$WARMUP" --request-rate "$rate" \
      --prompt-tokens "$prompts" --output-tokens "$OUTPUTS" --token-ids "0:$MAXID" --drain-timeout "$DRAIN" \
      --itl-events off --report-dir "$dir" ${procs[@]+"${procs[@]}"} "$@" > "$dir.log" 2>&1
  python - "$dir/summary.json" "$tag" "$rate" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
path, tag, rate = sys.argv[1:4]
try:
    with open(path) as f:
        s = json.load(f)
except (OSError, ValueError) as error:
    sys.exit(f"{tag} rate {rate}: no summary ({error}); see {path.rsplit('/', 1)[0]}.log")
t = s["total"]
pq = lambda m, metric: (f"{m[metric]['p50']:.0f}/{m[metric]['p99']:.0f}" if metric == "ttft_ms"
                        else f"{m[metric]['p50']:.1f}/{m[metric]['p99']:.1f}") if m.get(metric) else "-"
replicas = ", ".join(f"{name.split('#')[-1]} {m['requests']} req TTFT {pq(m, 'ttft_ms')} ITL {pq(m, 'itl_ms')}"
                     for name, m in s["replicas"].items())
flags = ("  CLIENT CPU-BOUND" if s["client"]["cpu_bound"] else "") + \
    ("  CLIENT LATE" if s["client"].get("timestamps_late") else "") + \
    (f"  warnings {len(s['warnings'])} (summary.json)" if s["warnings"] else "")
print(f"{tag:<17} rate {float(rate):>5g}: sent {s['request_rate']['sent_per_s']:.2f}/s ok "
      f"{s['request_rate']['succeeded_per_s']:.2f}/s, out {s['throughput']['output_tokens_per_s']:.0f} tok/s, "
      f"TTFT {pq(t, 'ttft_ms')} ms, ITL {pq(t, 'itl_ms')} ms (p50/p99), failures {s['failures']['total']}; "
      f"[{replicas}]{flags}")
PY
}

phase() {  # phase TAG REPLICAS POLICY RATES PROMPTS [locust flags...]
  local tag=$1 replicas=$2 policy=$3 rates=$4 prompts=$5; shift 5
  echo "=== $tag: $replicas replica(s) of $MODEL, router $policy, rates $rates ($(date +%T), ${SECONDS}s)"
  if [ "$(left)" -lt $((WARMUP + SECS + 75)) ]; then
    echo "$tag: skipped (BUDGET_S=$BUDGET_S reached)" | tee -a "$OUT/summary.txt"; return
  fi
  local t0=$SECONDS
  start_server "$tag" "$replicas" "$policy" || { echo "$tag: FAILED to start" >> "$OUT/summary.txt"; return; }
  echo "$tag: up in $((SECONDS - t0)) s"
  for rate in $rates; do point "$tag" "$rate" "$prompts" "$@"; done
  stop_server
}

for p in $phases; do
  case $p in
    a) phase a-1r-kv_queue 1 kv_queue "$RATES1" "$PROMPTS" ;;
    b) phase b-2r-kv_queue 2 kv_queue "$RATES2" "$PROMPTS" ;;
    c) for policy in ${POLICIES_C:-kv_queue power_of_two}; do
         phase "c-2r-$policy" 2 "$policy" "$RATESC" "$PROMPTS_C" \
             --long-prompt-every "$LONG_EVERY" --long-prompt-tokens "$LONG_TOKENS"
       done ;;
    *) echo "unknown phase $p (a, b or c)" ;;
  esac
done
echo "=== summary (${SECONDS}s; TTFT ms p50/p99, ITL ms p50/p99; per replica: requests, TTFT, ITL)"
cat "$OUT/summary.txt"
