#!/usr/bin/env bash
# Issue 4's measurement through the Ray Serve app: one engine replica of serve_config.yaml
# (HAProxy -> the Router picks the replica -> the replica's own HTTP server streams), 128
# W-seed-like streams from scripts/http_vs_inprocess.py, each burst paired with one of the same
# requests on an in-process engine beside the replica's, back to back, the two taking turns at
# going first (INTERLEAVE=1, the default: both engines get a fixed num_kv_blocks; each pair meets
# the same state of the machine); INTERLEAVE=0: all the HTTP bursts, then, with Ray stopped and the GPU
# free, the in-process ones. One comparison line
# and JSON in $OUT.
#
#   source .gpubundle/activate.sh                        # on the GPU host
#   OUT=$OUT bash scripts/ray_vs_inprocess.sh
# CPU smoke run: MODEL=random:gpt2 GPUS=0 ENGINE='{"num_kv_blocks": 256}' NUM_REQUESTS=4 MAX_TOKENS=4 ...
set -uo pipefail
set -m  # background jobs keep SIGINT: `serve run` stops cleanly
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_results/ray_vs_inprocess}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
INTERLEAVE=${INTERLEAVE:-1}
# ENGINE: EngineConfig fields as JSON, for the replica and the in-process engine alike. Interleaved, two
# engines share the GPU: 16,384 blocks of 16 tokens each (~9.4 GB for GPT-2), far more than 128 x 129 tokens
if [ "$INTERLEAVE" = 1 ]; then ENGINE=${ENGINE:-'{"num_kv_blocks": 16384}'}; else ENGINE=${ENGINE:-'{}'}; fi
MODEL=${MODEL:-random:gpt2}; MAXLEN=${MAXLEN:-1024}; GPUS=${GPUS:-1}
NUM_REQUESTS=${NUM_REQUESTS:-128}; MAX_TOKENS=${MAX_TOKENS:-128}
# PASSES: HTTP bursts one after another; the first warms the server, the median of the rest is compared
# with the median of as many in-process bursts (a burst lasts ~0.1 s on an H100: one is noisy). Interleaved,
# each pair's bursts run back to back and the median of the pairs' ratios is the measure: on the H100
# host a pair's ratio spreads over ~65-130% (which vCPU each engine runs on, and its speed that second),
# so 32 pairs (~1 min) rather than a few
PASSES=${PASSES:-32}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-$NUM_REQUESTS}; MAX_WAITING=${MAX_WAITING:-1024}
PORT=${PORT:-8000}; START_TIMEOUT=${START_TIMEOUT:-180}; MAXID=${MAXID:-10000}; LONG_TOKENS=${LONG_TOKENS:-64}
export PYTHONUNBUFFERED=1 PORT MODEL MAXLEN GPUS ENGINE MAX_NUM_SEQS MAX_WAITING  # read by write_config

python -c "import roseray_kernels" 2>/dev/null \
    || python -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
eval "$(python -m roseray.serve.haproxy_env --router-replicas-per-node "${ROUTERS:-auto}")"  # ROUTERS: Router replicas (auto: 4 with GPUs)
# HAPROXY_THREADS: HAProxy's nbthread (Ray 2.60's default: 4), read when Ray starts
if [ -n "${HAPROXY_THREADS:-}" ]; then export RAY_SERVE_HAPROXY_NBTHREAD=$HAPROXY_THREADS; fi
# SPLICE=0: HAProxy copies the streams with recv/send instead of Ray's splice options (haproxy_env.py)
if [ "${SPLICE:-1}" = 0 ]; then export ROSERAY_HAPROXY_SPLICE=0; fi
# REUSE=never: HAProxy opens a connection to the replica per request (haproxy_env.py), instead of reusing
if [ -n "${REUSE:-}" ]; then export ROSERAY_HAPROXY_REUSE=$REUSE; fi
# ADD_FLUSH=iteration: the API processes hold every add to the end of its loop iteration (async_engine.py)
if [ -n "${ADD_FLUSH:-}" ]; then export ROSERAY_ADD_FLUSH=$ADD_FLUSH; fi
source scripts/ray_app.sh
trap 'stop_server' EXIT
trap 'exit 130' INT; trap 'exit 143' TERM  # through the EXIT trap: no Ray left behind

# CLIENT_PROCS: client processes sharing the streams (see http_vs_inprocess.py --help)
sizes=(--model "$MODEL" --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --client-processes "${CLIENT_PROCS:-4}")
# TRACE=1: every request's timeline (roseray/server/request_trace.py) from the load generator, the
# Routers and the API processes into $OUT/trace, then scripts/burst_timeline.py prints where each
# burst's time went (set before Ray starts: its workers inherit it)
if [ "${TRACE:-0}" = 1 ]; then export ROSERAY_REQUEST_TRACE_DIR=$OUT/trace; rm -rf "$OUT/trace"; fi
timeline() { [ "${TRACE:-0}" = 1 ] || return 0; sleep 1; python scripts/burst_timeline.py "$OUT/trace" --json "$OUT/burst_timeline.json"; }
# PROBE=1: before the measure, where a burst's TTFT goes (scripts/ray_burst_probe.py: the whole path
# through HAProxy, the Router's decisions alone, the replica's own port with tickets signed here)
if [ "${PROBE:-0}" = 1 ]; then export TICKET_SECRET=${TICKET_SECRET:-$(python -c "import secrets; print(secrets.token_hex(16))")}; fi
start_server ray 1 kv_queue || exit 1
if [ "${PROBE:-0}" = 1 ]; then
  python scripts/ray_burst_probe.py --port "$PORT" -n "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --rounds 5 \
      --ticket-secret "$TICKET_SECRET" --out "$OUT/burst_probe.json" 2>&1 | grep -E "^n=" || echo "the probe failed"
fi
# (each pass also records the replica's engine process's CPU use: the one engine process here)
# ENGINE_CPU=K: both engine children on vCPU K (ISOLATE=1: every other thread moved off it; root)
placement=()
if [ -n "${ENGINE_CPU:-}" ]; then placement=(--engine-cpu "$ENGINE_CPU"); fi
if [ "${ISOLATE:-0}" = 1 ]; then placement+=(--isolate-engine-cpu); fi
if [ "$INTERLEAVE" = 1 ]; then
  python scripts/http_vs_inprocess.py "${sizes[@]}" --server-port "$PORT" --passes "$PASSES" --interleave \
      "${placement[@]}" --engine-args "$ENGINE" --out "$OUT/ray_vs_inprocess.json" 2>&1 | grep -v " INFO "
  status=${PIPESTATUS[0]}
  timeline
  exit "$status"
fi
python scripts/http_vs_inprocess.py "${sizes[@]}" --server-port "$PORT" --passes "$PASSES" --out "$OUT/ray_http.json" \
    || { echo "the HTTP half failed"; exit 1; }
timeline
stop_server
python scripts/http_vs_inprocess.py "${sizes[@]}" --against-http "$OUT/ray_http.json" --engine-args "$ENGINE" \
    --out "$OUT/ray_vs_inprocess.json" 2>&1 | grep -v " INFO "
