#!/usr/bin/env bash
# The peer benchmark on the lent H200, one command: llama.cpp (CUDA, sm_90) and our engine on the same seeded
# qwen3.5-0.8b weights, same prompts, same GPU, one sitting. Results under $OUT:
#   peer_log.txt  peer_llamacpp.json  ours_0.8b.json  fidelity_0.8b.json  llama_bench.json  peer_table.md  peer_summary.json
#   build_tail.txt (only when the build failed)
# Needs the trimmed source as a carry path (bench/peer_llamacpp/llama.cpp, from prepare_source.py) and .whl (as
# bench/h200.sh). Usage: bash bench/peer_llamacpp/run_h200.sh [PHASE...]
#   default phases: build gguf peer ours fidelity llama-bench table
#   27B (not in the default: the GGUF alone is 54 GB on a 64 GiB disk): gguf-27b peer-27b ours-27b
# Each phase leaves a marker in the build folder (kept while the machine stays warm): a second call skips what is
# done (PEER_FORCE=1 reruns it). The CUDA build runs detached (setsid); if it outlasts PEER_BUILD_WAIT_S the script says so and exits 3: call
# it again on the same warm machine and it waits for that build instead of starting another.
set -uo pipefail
cd "$(dirname "$0")/../.."
HERE=bench/peer_llamacpp
BUILD=$HERE/build-cuda
WORK=$BUILD/work
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/peer_log.txt
START=$(date +%s)
BUDGET_S=${PEER_BUDGET_S:-560}              # stop starting timed phases after this (the call's limit is 600 s)
BUILD_WAIT_S=${PEER_BUILD_WAIT_S:-420}
CONTEXTS=${PEER_CONTEXTS:-2048,8192,16384}
REPEATS=${PEER_REPEATS:-10}
DECODE=${PEER_DECODE:-64}
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

build_done() { [ -x "$BUILD/bin/peer_timing" ] && [ -f "$BUILD/.built" ]; }
start_build() {
  if build_done; then return 0; fi
  if [ -f "$BUILD/.building" ] && kill -0 "$(cat "$BUILD/.building")" 2>/dev/null; then
    log "build: already running (pid $(cat "$BUILD/.building")), waiting for it"; return 0
  fi
  local launcher=""; command -v ccache >/dev/null && launcher="-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
  log "build: cmake $(cmake --version | head -1), $(nvcc --version | tail -2 | head -1), ccache: ${launcher:+yes}"
  setsid bash -c "
    cmake -S $HERE -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_QUANTS='f16-f16;bf16-bf16' -DGGML_NATIVE=ON $launcher &&
    cmake --build $BUILD -j16 --target peer_timing llama-bench -- -k 0
    [ -x $BUILD/bin/peer_timing ] && touch $BUILD/.built
    rm -f $BUILD/.building" > "$BUILD/build.log" 2>&1 < /dev/null &
  echo $! > "$BUILD/.building"
}
wait_build() {
  local waited=0
  while ! build_done; do
    if ! { [ -f "$BUILD/.building" ] && kill -0 "$(cat "$BUILD/.building")" 2>/dev/null; }; then
      build_done && break
      log "build: FAILED (tail in build_tail.txt)"; tail -60 "$BUILD/build.log" > "$OUT/build_tail.txt"; return 1
    fi
    if [ "$waited" -ge "$BUILD_WAIT_S" ]; then
      log "build: still running after ${waited}s ($(grep -c '^\[' "$BUILD/build.log") steps logged): call again"
      tail -3 "$BUILD/build.log" >> "$LOG"; return 3
    fi
    sleep 5; waited=$((waited + 5))
  done
  log "build: done ($(tail -1 "$BUILD/build.log" | cut -c1-120))"
}

gguf() {  # preset file
  [ -f "$WORK/$2" ] && { log "gguf: $2 present"; return 0; }
  log "gguf: writing $2"
  python3 $HERE/gguf_writer.py --model "$1" --device cuda --dtype bfloat16 --out "$WORK/$2.tmp" > "$WORK/gguf.log" 2>&1
  local rc=$?
  tail -1 "$WORK/gguf.log" | tee -a "$LOG"
  [ $rc = 0 ] && mv "$WORK/$2.tmp" "$WORK/$2"
}
peer() {  # preset file out
  [ -f "$WORK/tokens_$1.i32" ] || python3 $HERE/tokens.py --model "$1" --longest "${CONTEXTS##*,}" --out "$WORK/tokens_$1.i32"
  log "peer: llama.cpp bench $1 contexts $CONTEXTS"
  "$BUILD/bin/peer_timing" bench --model "$WORK/$2" --tokens "$WORK/tokens_$1.i32" --contexts "$CONTEXTS" \
    --repeats "$REPEATS" --decode "$DECODE" --ngl 99 --threads 16 --ubatch 2048 --out "$OUT/$3" 2>&1 | tail -5 | tee -a "$LOG"
}
ours() {  # preset out
  log "ours: flashrt-runtime bench $1"
  python3 -m flashrt_ros.runtime bench --model "$1" --device cuda --dtype bfloat16 --contexts "$CONTEXTS" \
    --repeats "$REPEATS" --decode-tokens "$DECODE" --out "$OUT/$2" 2>&1 >/dev/null | { grep -v -i warn || true; } \
    | tail -6 | tee -a "$LOG"
}

log "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader); commit $commit; disk $(df -h . | tail -1 | awk '{print $4}') free"
phases=${*:-build gguf peer ours fidelity llama-bench table}
for phase in $phases; do
  [ -z "${PEER_FORCE:-}" ] && [ -f "$BUILD/.done_$phase" ] && { log "$phase: done in an earlier call"; continue; }
  if [ "$phase" != build ] && [ "$(left)" -lt 30 ]; then log "$phase: skipped, $(left)s of the budget left"; continue; fi
  rc=0
  case "$phase" in
    build) start_build; gguf qwen3.5-0.8b qwen3.5-0.8b.gguf; wait_build; rc=$? ;;
    gguf) gguf qwen3.5-0.8b qwen3.5-0.8b.gguf; rc=$? ;;
    peer) build_done && peer qwen3.5-0.8b qwen3.5-0.8b.gguf peer_llamacpp.json; rc=$? ;;
    ours) ours qwen3.5-0.8b ours_0.8b.json; rc=$? ;;
    fidelity)
      log "fidelity: qwen3.5-0.8b bf16, 256-token prompt, 64 greedy tokens"
      python3 $HERE/fidelity.py --model qwen3.5-0.8b --dtype bfloat16 --device cuda --gguf "$WORK/qwen3.5-0.8b.gguf" \
        --binary "$BUILD/bin/peer_timing" --ngl 99 --kv bf16 --prompt-len 256 --gen 64 --workdir "$WORK/fidelity" \
        --out "$OUT/fidelity_0.8b.json" > /dev/null 2>> "$LOG"; rc=$?
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [d.pop(k) for k in ('our_tokens','peer_tokens')]; print(d)" \
        "$OUT/fidelity_0.8b.json" 2>&1 | tee -a "$LOG" ;;
    llama-bench)
      [ -x "$BUILD/bin/llama-bench" ] || { log "llama-bench: not built (see build.log)"; rc=1; continue; }
      log "llama-bench: pp ${CONTEXTS}, tg ${DECODE} at depth 2048"
      "$BUILD/bin/llama-bench" -m "$WORK/qwen3.5-0.8b.gguf" -ngl 99 -fa 1 -ub 2048 -b 16384 -r 3 -p "$CONTEXTS" -n 0 \
        -o json > "$OUT/llama_bench.json" 2>> "$LOG" && \
      "$BUILD/bin/llama-bench" -m "$WORK/qwen3.5-0.8b.gguf" -ngl 99 -fa 1 -r 3 -p 0 -n "$DECODE" -d 2048 -o json \
        > "$OUT/llama_bench_tg.json" 2>> "$LOG"; rc=$?
      python3 -c "import json,sys; a=json.load(open(sys.argv[1]))+json.load(open(sys.argv[2])); json.dump(a,open(sys.argv[1],'w'),indent=1); [print(r['n_prompt'],r['n_gen'],r['n_depth'],round(r['avg_ts'],1),'tok/s') for r in a]" \
        "$OUT/llama_bench.json" "$OUT/llama_bench_tg.json" 2>&1 | tee -a "$LOG"; rm -f "$OUT/llama_bench_tg.json" ;;
    table)
      python3 $HERE/results.py --peer "$OUT/peer_llamacpp.json" --ours "$OUT/ours_0.8b.json" \
        --fidelity "$OUT/fidelity_0.8b.json" --commit "$commit" --command "bash $HERE/run_h200.sh" \
        --device "one $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/, / (driver /;s/$/)/')" \
        --summary "$OUT/peer_summary.json" > "$OUT/peer_table.md"; rc=$?; cat "$OUT/peer_table.md" ;;
    gguf-27b) [ "$(df --output=avail -B1G . | tail -1)" -gt 60 ] || { log "gguf-27b: under 60 GB free"; rc=1; }
      [ $rc = 0 ] && { gguf qwen3.6-27b qwen3.6-27b.gguf; rc=$?; } ;;
    peer-27b) peer qwen3.6-27b qwen3.6-27b.gguf peer_llamacpp_27b.json; rc=$? ;;
    ours-27b) ours qwen3.6-27b ours_27b.json; rc=$? ;;
    *) log "unknown phase $phase"; rc=1 ;;
  esac
  if [ "$rc" = 0 ]; then touch "$BUILD/.done_$phase"; else log "$phase: rc=$rc"; [ "$phase" = build ] && exit "$rc"; fi
done
log "end ($(left)s of the budget left)"
