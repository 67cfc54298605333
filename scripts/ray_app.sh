# The Ray Serve app of serve_config.yaml on the GPU host, for the scripts that measure through
# it (two_replica_sweep.sh, ray_vs_inprocess.sh): write a config, start `serve run` (a local
# Ray of its own), wait until every replica answers through HAProxy, stop it and wait for the
# GPUs to be free. Source it after setting OUT PORT MODEL MAXLEN GPUS ENGINE MAX_NUM_SEQS
# MAX_WAITING START_TIMEOUT MAXID LONG_TOKENS (the warm-up's prompt length); optional:
# API_PROCS (api_processes_per_replica), ROUTERS (router.num_replicas, a number or auto; the caller evals haproxy_env
# with --router-replicas-per-node $ROUTERS before Ray starts), TICKET_SECRET (the app's).
url=http://127.0.0.1:$PORT
server=""
serve_cli=(python -c 'import sys; sys.argv[0] = "serve"; from ray.serve.scripts import cli; cli()')  # `serve`

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
if os.environ.get("API_PROCS"):  # the engine replicas' API processes (default: auto, 4 on GPU)
    args["api_processes_per_replica"] = int(os.environ["API_PROCS"])
if os.environ.get("TICKET_SECRET"):  # known to a probe that signs its own tickets (ray_burst_probe.py)
    args["ticket_secret"] = os.environ["TICKET_SECRET"]
if os.environ.get("ROUTERS"):  # Router replicas (HAProxy's Lua takes turns between them)
    routers = os.environ["ROUTERS"]
    args["router"]["num_replicas"] = int(routers) if routers.isdigit() else routers
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
