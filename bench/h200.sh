#!/usr/bin/env bash
# Runs on the lent H200 (device tool): GPU tests, verify, and the runtime benchmark. Writes results under $OUT.
# Usage: bash bench/h200.sh PHASE   (PHASE: check | small | large)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
case "$1" in
  check)
    python3 -m pytest -q -p no:cacheprovider test/test_runtime_gpu.py 2>&1 | tail -25
    python3 -m flashrt_ros.runtime verify --model qwen3.5-0.8b --device cuda --dtype bfloat16 --prefix-len 2048 \
        --suffix-len 24 --gen 32 --kv-only > "$OUT/verify_0.8b.json"; echo "verify rc=$?"
    python3 -c "import json; d=json.load(open('$OUT/verify_0.8b.json')); [d.pop(k,None) for k in ('tokens_a','kv_only_tokens')]; print(d)"
    ;;
  small)
    python3 -m flashrt_ros.runtime bench --model qwen3.5-0.8b --device cuda --dtype bfloat16 \
        --contexts 2048,8192,16384 --repeats 30 --decode-tokens 64 --compare-hf --out "$OUT/bench_0.8b.json" > /dev/null
    ;;
  all)
    python3 -m pytest -q -p no:cacheprovider test/test_runtime_gpu.py 2>&1 | tail -4
    for preset in qwen3.5-0.8b qwen3.6-27b; do
      python3 -m flashrt_ros.runtime bench --model $preset --device cuda --dtype bfloat16 \
          --contexts 2048,8192,16384 --repeats 20 --decode-tokens 32 --compare-hf --out "$OUT/bench_$preset.json" \
          2>&1 | grep -v -i warn | tail -6
    done
    ;;
  large)
    python3 -m flashrt_ros.runtime bench --model qwen3.6-27b --device cuda --dtype bfloat16 \
        --contexts 2048,8192,16384 --repeats 10 --decode-tokens 32 --compare-hf --out "$OUT/bench_27b.json" > /dev/null
    ;;
esac
