#!/usr/bin/env bash
# The peer benchmark on the lent H200, one command: llama.cpp (CUDA, sm_90) and our engine on the same seeded
# qwen3.5-0.8b weights, same prompts, same GPU, one sitting. Results under $OUT/<card>_<commit>/peer/ (7 files; the
# commit from bench/gpu_commit.txt, see bench/run_folder.sh):
#   peer_log.txt  peer_llamacpp.json  ours.json  fidelity.json  llama_bench.json  peer_table.md  peer_summary.json
#   (+ build_tail.txt when the build failed)
# (kept in build-cuda/results across calls on a warm machine, copied to $OUT by every call).
# Needs the trimmed source as a carry path (bench/peer_llamacpp/llama.cpp, from prepare_source.py) and .whl (as
# bench/h200.sh). Usage: bash bench/peer_llamacpp/run_h200.sh [PHASE...]
#   default phases: build gguf peer ours fidelity table llama-bench
# Each phase leaves a marker in the build folder (kept while the machine stays warm): a second call skips what is
# done (PEER_FORCE=1 reruns it). The CUDA build runs detached (setsid) while the GGUF is written; if it outlasts
# PEER_BUILD_WAIT_S the script exits 3: call it again at once (the machine stays warm only 30 s) and it waits for
# that build instead of starting another. The last log line lists the phases done and left.
# PEER_MODEL=qwen3.6-27b is possible in principle but does not fit: its GGUF is 54 GB on a 64 GiB disk, and writing it
# through numpy plus loading it takes more than a 10-minute call. PEER_DEVICE=cpu (with PEER_MODEL=tiny and a
# PEER_BUILD folder) runs the same script on a CPU, to check it without device time.
set -uo pipefail
cd "$(dirname "$0")/../.."
HERE=bench/peer_llamacpp
DEVICE=${PEER_DEVICE:-cuda}
MODEL=${PEER_MODEL:-qwen3.5-0.8b}
BUILD=${PEER_BUILD:-$HERE/build-$DEVICE}
WORK=$BUILD/work
RES=$BUILD/results                          # results of every call so far; each call copies them all to $OUT
. bench/run_folder.sh || exit 2           # FLASHRT_GIT_COMMIT and RUN, as bench/h200.sh
OUT=${OUT:-/tmp/out}/$RUN/peer
mkdir -p "$OUT" "$WORK" "$RES"
LOG=$RES/peer_log.txt
publish() { cp -f "$RES"/* "$OUT"/ 2>/dev/null; }
trap publish EXIT
START=$(date +%s)
BUDGET_S=${PEER_BUDGET_S:-560}              # no phase starts with under 30 s of this left (the call's limit is 600 s)
BUILD_WAIT_S=${PEER_BUILD_WAIT_S:-420}
CONTEXTS=${PEER_CONTEXTS:-2048,8192,16384}
REPEATS=${PEER_REPEATS:-10}
DECODE=${PEER_DECODE:-64}
JOBS=${PEER_JOBS:-16}
if [ "$DEVICE" = cuda ]; then
  NGL=99 THREADS=16 DTYPE=bfloat16 KV=bf16
  CMAKE_DEVICE="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_QUANTS=f16-f16,bf16-bf16"
else
  NGL=0 THREADS=$(nproc) DTYPE=float32 KV=f32 CMAKE_DEVICE=""
fi
GGUF=$WORK/$MODEL.gguf
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

if [ "${PEER_WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then   # PEER_WHEELS=0: use what is installed
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
commit=${FLASHRT_GIT_COMMIT:0:7}

build_done() { [ -x "$BUILD/bin/peer_timing" ] && [ -f "$BUILD/.built" ]; }
building() { [ -f "$BUILD/.building" ] && kill -0 "$(cat "$BUILD/.building")" 2>/dev/null; }
start_build() {
  build_done && return 0
  if building; then log "build: already running (pid $(cat "$BUILD/.building")), waiting for it"; return 0; fi
  local launcher=""
  command -v ccache >/dev/null && launcher="-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
  log "build: $(cmake --version | head -1), $(nvcc --version 2>/dev/null | grep release || echo no nvcc), ccache ${launcher:+yes}"
  # llama-bench is built with -k 0: if it fails, peer_timing (what the timed phases need) is still built.
  setsid bash -c "echo \$\$ > $BUILD/.building
    cmake -S $HERE -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON $CMAKE_DEVICE $launcher &&
    cmake --build $BUILD -j$JOBS --target peer_timing llama-bench -- -k 0
    [ -x $BUILD/bin/peer_timing ] && touch $BUILD/.built
    rm -f $BUILD/.building" > "$BUILD/build.log" 2>&1 < /dev/null &
  echo $! > "$BUILD/.building"
}
wait_build() {
  local waited=0
  until build_done; do
    if ! building; then
      build_done && break
      log "build: FAILED (tail in build_tail.txt)"; tail -60 "$BUILD/build.log" > "$RES/build_tail.txt"; return 1
    fi
    if [ "$waited" -ge "$BUILD_WAIT_S" ]; then
      log "build: still running after ${waited}s ($(grep -c '^\[' "$BUILD/build.log") steps logged): call again"
      tail -2 "$BUILD/build.log" >> "$LOG"; return 3
    fi
    sleep 5; waited=$((waited + 5))
  done
  log "build: done ($(grep -E '^\[[0-9]+/' "$BUILD/build.log" | tail -1 | cut -c1-100))"
}
write_gguf() {
  [ -f "$GGUF" ] && { log "gguf: $GGUF present"; return 0; }
  log "gguf: writing $MODEL"
  python3 $HERE/gguf_writer.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --out "$GGUF.tmp" > "$WORK/gguf.log" 2>&1
  local rc=$?
  tail -1 "$WORK/gguf.log" | tee -a "$LOG"
  [ $rc = 0 ] && mv "$GGUF.tmp" "$GGUF"
}

run_phase() {
  case "$1" in
    build) start_build; write_gguf; wait_build ;;
    gguf) write_gguf ;;
    peer)
      build_done || { log "peer: no build"; return 1; }
      python3 $HERE/tokens.py --model "$MODEL" --longest "${CONTEXTS##*,}" --out "$WORK/tokens.i32" || return 1
      log "peer: llama.cpp, contexts $CONTEXTS"
      "$BUILD/bin/peer_timing" bench --model "$GGUF" --tokens "$WORK/tokens.i32" --contexts "$CONTEXTS" \
        --repeats "$REPEATS" --decode "$DECODE" --ngl $NGL --threads "$THREADS" --ubatch 2048 \
        --out "$RES/peer_llamacpp.json" 2>&1 | tail -4 | tee -a "$LOG" ;;
    ours)
      log "ours: bench rows, contexts $CONTEXTS; then the fidelity check on the same engine"
      local check=""
      build_done && [ -f "$GGUF" ] && check="--fidelity $RES/fidelity.json --gguf $GGUF --binary $BUILD/bin/peer_timing
        --ngl $NGL --kv $KV --fidelity-prompt 256 --fidelity-gen 64 --fidelity-work $WORK/fidelity"
      python3 $HERE/ours.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --contexts "$CONTEXTS" \
        --repeats "$REPEATS" --decode-tokens "$DECODE" --out "$RES/ours.json" $check 2>&1 >/dev/null \
        | { grep -v -i warn || true; } | tail -6 | tee -a "$LOG" ;;
    fidelity)
      [ -f "$RES/fidelity.json" ] || {
        log "fidelity: 256-token prompt, 64 greedy tokens, llama.cpp KV $KV"
        python3 $HERE/fidelity.py --model "$MODEL" --dtype "$DTYPE" --device "$DEVICE" --gguf "$GGUF" \
          --binary "$BUILD/bin/peer_timing" --ngl $NGL --kv $KV --prompt-len 256 --gen 64 --workdir "$WORK/fidelity" --reference \
          --out "$RES/fidelity.json" > /dev/null 2>> "$LOG" || return 1; }
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [d.pop(k) for k in ('our_tokens','peer_tokens')]; print(d)" \
        "$RES/fidelity.json" | tee -a "$LOG" ;;
    llama-bench)
      [ -x "$BUILD/bin/llama-bench" ] || { log "llama-bench: not built (see build.log)"; return 1; }
      log "llama-bench: pp $CONTEXTS; tg $DECODE at depth 2048"
      "$BUILD/bin/llama-bench" -m "$GGUF" -ngl $NGL -t "$THREADS" -fa 1 -ub 2048 -b 16384 -r 2 -p "$CONTEXTS" -n 0 \
        -o json > "$WORK/pp.json" 2>> "$LOG" &&
      "$BUILD/bin/llama-bench" -m "$GGUF" -ngl $NGL -t "$THREADS" -fa 1 -r 2 -p 0 -n "$DECODE" -d 2048 -o json \
        > "$WORK/tg.json" 2>> "$LOG" || return 1
      python3 -c "import json,sys; a=json.load(open(sys.argv[1]))+json.load(open(sys.argv[2])); json.dump(a,open(sys.argv[3],'w'),indent=1); [print('llama-bench', r['n_prompt'],r['n_gen'],r['n_depth'],round(r['avg_ts'],1),'tok/s') for r in a]" \
        "$WORK/pp.json" "$WORK/tg.json" "$RES/llama_bench.json" | tee -a "$LOG" ;;
    table)
      local gpu; gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/, / (driver /;s/$/)/')
      python3 $HERE/results.py --peer "$RES/peer_llamacpp.json" --ours "$RES/ours.json" --fidelity "$RES/fidelity.json" \
        --commit "$commit" --command "bash $HERE/run_h200.sh" --device "one ${gpu:-CPU ($(nproc) cores)}" \
        --summary "$RES/peer_summary.json" --readme-row > "$RES/peer_table.md" && cat "$RES/peer_table.md" ;;
    *) log "unknown phase $1"; return 1 ;;
  esac
}

log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "$DEVICE"); model $MODEL; commit $commit; disk $(df -h . | tail -1 | awk '{print $4}') free"
# Seconds a phase needs on the H200 (estimates, 0.8B): one is not started with less left, so that a call is never
# killed mid-phase (a second call carries on).
declare -A NEEDS=([build]=0 [gguf]=60 [peer]=90 [ours]=240 [fidelity]=150 [table]=5 [llama-bench]=90)
done_list="" left_list=""
for phase in ${*:-build gguf peer ours fidelity table llama-bench}; do
  if [ -z "${PEER_FORCE:-}" ] && [ -f "$BUILD/.done_$phase" ]; then done_list+=" $phase"; continue; fi
  if [ "$(left)" -lt "${NEEDS[$phase]:-60}" ]; then
    log "$phase: not started, $(left)s of the budget left (needs ~${NEEDS[$phase]:-60}s)"; left_list+=" $phase"; continue
  fi
  run_phase "$phase"; rc=$?; publish
  if [ $rc = 0 ]; then touch "$BUILD/.done_$phase"; done_list+=" $phase"
  else log "$phase: rc=$rc"; left_list+=" $phase"; [ "$phase" = build ] && { log "left:${left_list} (and the rest)"; exit $rc; }
  fi
done
log "done:${done_list:- none}; left:${left_list:- none} ($(left)s of the budget unused)"
