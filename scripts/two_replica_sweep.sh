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
url=http://127.0.0.1:$PORT
server=""
: > "$OUT/summary.txt"

serve_cli=(python -c 'import sys; sys.argv[0] = "serve"; from ray.serve.scripts import cli; cli()')  # `serve`
left() { echo $((BUDGET_S - SECONDS)); }

python -c "import roseray_kernels" 2>/dev/null \
    || python -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
eval "$(python -m roseray.serve.haproxy_env)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader

write_config() {  # write_config FILE REPLICAS POLICY
  python - "$@" <<'PY'
import json, os, sys
import yaml
from roseray.config import EngineConfig
from roseray.serve.app import AppArgs
path, replicas, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open("serve_config.yaml") as f:
    config = yaml.safe_load(f)
config["http_options"]["port"] = int(os.environ["PORT"])
args = config["applications"][0]["args"]
engine = args["engine"]
engine.pop("num_kv_blocks", None)  # on GPU: sized from gpu_memory_utilization
engine.update(model=os.environ["MODEL"], max_model_len=int(os.environ["MAXLEN"]), enable_prefix_caching=False,
              max_num_seqs=int(os.environ["MAX_NUM_SEQS"]), max_waiting_requests=int(os.environ["MAX_WAITING"]))
engine.update(json.loads(os.environ["ENGINE"]))
args.update(num_replicas=replicas, num_gpus_per_replica=float(os.environ["GPUS"]),
            drain_timeout_s=5)  # at a phase's end: locust has drained; streams left are cut
args.setdefault("router", {})["policy"] = policy
EngineConfig(**AppArgs(**args).engine)  # fail here, not in a replica
with open(path, "w") as f:
    yaml.safe_dump(config, f, sort_keys=False)
PY
}

wait_serving() {  # wait_serving REPLICAS: every replica answers through HAProxy, then each is warmed up
  python - "$url" "$1" "$START_TIMEOUT" "$MAXID" "$LONG_TOKENS" "$MAXLEN" "$server" <<'PY'
import json, os, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, replicas, timeout_s, server = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[7])
max_id, long_tokens, max_len = int(sys.argv[4].split(":")[-1]), int(sys.argv[5].split(":")[-1]), int(sys.argv[6])

def post(prompt, max_tokens, timeout=60):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()
        return response.headers.get("x-roseray-replica")

start = time.monotonic()
seen, streak = set(), 0
while len(seen) < replicas or streak < 5:  # HAProxy learns the Router and the replicas after they start
    try:
        os.kill(server, 0)
    except OSError:
        sys.exit("serve run exited")
    if time.monotonic() - start > timeout_s:
        sys.exit(f"not serving on {replicas} replica(s) after {timeout_s:.0f} s (seen {sorted(seen)})")
    try:
        seen.add(post([1, 2, 3], 2, timeout=30))
        streak += 1
    except Exception:  # not up yet: connection refused, 503 while starting
        streak = 0
        time.sleep(1)
# warm-up, outside the measurement: long prompts on every replica, a few at once
n = min(long_tokens, max_len - 16)
with ThreadPoolExecutor(4 * replicas) as pool:
    warmed = set(pool.map(lambda i: post([(7 * i + j) % max_id for j in range(n)], 8, timeout=300),
                          range(4 * replicas)))
print(f"serving on {len(seen)} replica(s) after {time.monotonic() - start:.0f} s; "
      f"warm-up ({n}-token prompts) reached {len(warmed)}")
PY
}

start_server() {  # start_server TAG REPLICAS POLICY
  local tag=$1
  if curl -s -m 2 -o /dev/null "$url/"; then  # never measure a server left over from something else
    echo "$tag: $url already answers (a server left running?)"; return 1
  fi
  write_config "$OUT/$tag.yaml" "$2" "$3" || return 1
  # a simple command, so that $! is serve run itself (a local Ray of its own); replicas stop
  # within 2 s when it shuts down (by default Ray keeps a draining replica's own port open 30 s)
  RAY_ADDRESS=local RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=2 "${serve_cli[@]}" run "$OUT/$tag.yaml" \
      > "$OUT/$tag-serve.log" 2>&1 &
  server=$!
  if ! wait_serving "$2"; then
    echo "$tag: the app did not come up; last lines of $OUT/$tag-serve.log:"; tail -25 "$OUT/$tag-serve.log"
    stop_server; return 1
  fi
}

stop_server() {
  [ -n "$server" ] || return 0
  kill -INT "$server" 2>/dev/null
  for _ in $(seq 90); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; sleep 10; fi
  kill -0 "$server" 2>/dev/null && kill -KILL "$server"
  wait "$server" 2>/dev/null
  server=""
  for _ in $(seq 30); do curl -s -m 1 -o /dev/null "$url/" || break; sleep 1; done  # port closed
  command -v nvidia-smi >/dev/null || return 0
  local apps=""
  for _ in $(seq 30); do  # GPU memory back before the next phase sizes its KV cache
    apps=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null)
    [ -z "$apps" ] && break; sleep 1
  done
  [ -z "$apps" ] || echo "warning: processes still on the GPUs: $apps"
}
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
