#!/usr/bin/env bash
# The GPU host's suite, one call: install, correctness on CUDA, then the benchmarks of
# BENCHMARKS.md, each writing JSON under $OUT (or ./bench_results). Usage:
#   bash scripts/gpu_suite.sh [tests] [kernels] [seed] [seed-thread] [http] [ray] [nano]
#   (default: all but seed-thread and ray)
# ray: the serving comparison through the Ray Serve app (serve_config.yaml with W-seed's
# engine), in pairs with an in-process engine beside the replica's (both with a fixed KV size).
set -uo pipefail
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=${*:-tests kernels seed http nano}
python -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

ray_comparison() {
  local engine='{"num_kv_blocks": 16384}'  # two GPT-2 engines share the GPU: far more than 128 x 129 tokens each
  python - "$OUT/ray_config.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open("serve_config.yaml"))
args = config["applications"][0]["args"]
args["engine"].update(model="random:gpt2", max_num_seqs=128, max_waiting_requests=1024, num_kv_blocks=16384,
                      enable_prefix_caching=False)
args["num_replicas"] = 1
yaml.safe_dump(config, open(sys.argv[1], "w"))
PY
  (eval "$(python -m roseray.ray_serve.haproxy_env)" && exec serve run "$OUT/ray_config.yaml") > "$OUT/ray_serve.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 1; done
  python -m roseray.bench serving --server-port 8000 --passes 16 --engine-args "$engine" \
      --out "$OUT/ray_vs_inprocess.json" 2>&1 | grep -v " INFO " | tail -4
  kill -INT $server; wait $server
}

for part in $parts; do
  echo "=== $part ($(date +%T))"
  case $part in
    tests)   GPU_REPORT="$OUT/gpu_models.jsonl" python -m pytest -q -x tests/kernels tests/engine/test_gpu_engine.py \
                 tests/models tests/runtime/test_engine_process.py tests/runtime/test_engine_process_clients.py 2>&1 \
                 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    kernels) python -m roseray.bench kernels --out "$OUT/kernels.json" 2>&1 | tail -30
             python -m roseray.bench kernels --moe --out "$OUT/moe.json" 2>&1 | tail -16
             python -m roseray.bench kernels --fp8 --out "$OUT/fp8.json" 2>&1 | tail -17 ;;
    seed)    python -m roseray.bench stream --workload seed --peer-hf --out "$OUT/seed.json" 2>&1 | grep -v " INFO " | tail -25 ;;
    seed-thread) python -m roseray.bench stream --workload seed --no-engine-process --out "$OUT/seed_thread.json" 2>&1 | grep -v " INFO " | tail -25 ;;
    http)    python -m roseray.bench serving --api-processes 4 --server-log "$OUT/http_server.log" \
                 --out "$OUT/http_vs_inprocess.json" 2>&1 | grep -v " INFO " | tail -4 ;;
    ray)     ray_comparison ;;
    nano)    python -m roseray.bench throughput --workload nano --out "$OUT/nano.json" 2>&1 | grep -v "^generate:" | tail -20 ;;
  esac
done
