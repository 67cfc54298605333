#!/usr/bin/env bash
# The GPU host's suite, one call: install, correctness on CUDA, then the benchmarks of
# BENCHMARKS.md, each writing JSON under $OUT (or ./bench_results). Usage:
#   bash scripts/gpu_suite.sh [tests] [kernels] [seed] [seed-thread] [http] [ray] [nano]
#   (default: all but seed-thread and ray; ray starts the Ray Serve app: source the bundle first)
set -uo pipefail
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=${*:-tests kernels seed http nano}
python -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for part in $parts; do
  echo "=== $part ($(date +%T))"
  case $part in
    tests)   python -m pytest -q -x tests/test_kernels.py tests/test_gpu_engine.py tests/test_engine_process.py \
                 tests/test_engine_process_clients.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    kernels) python -m roseray.bench kernels --out "$OUT/kernels.json" 2>&1 | tail -30 ;;
    seed)    python -m roseray.bench stream --workload seed --peer-hf --out "$OUT/seed.json" 2>&1 | grep -v " INFO " | tail -25 ;;
    seed-thread) python -m roseray.bench stream --workload seed --no-engine-process --out "$OUT/seed_thread.json" 2>&1 | grep -v " INFO " | tail -25 ;;
    http)    SERVER_LOG="$OUT/http_server.log" python scripts/http_vs_inprocess.py --api-processes 4 \
                 --out "$OUT/http_vs_inprocess.json" 2>&1 | tail -5 ;;
    ray)     OUT="$OUT/ray" bash scripts/ray_vs_inprocess.sh 2>&1 | tail -3 ;;
    nano)    python -m roseray.bench throughput --workload nano --out "$OUT/nano.json" 2>&1 | grep -v "^generate:" | tail -20 ;;
  esac
done
