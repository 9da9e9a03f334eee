#!/usr/bin/env bash
# Runs on the lent H200 (device tool): GPU tests, verify, and the runtime benchmarks. Writes results under $OUT.
# Usage: bash bench/h200.sh PHASE...   (PHASE: bench-0.8b | bench-27b | quant-tune | quant-tests | quant | profile |
# delta-sweep (DELTA_PRESETS, DELTA_LENGTHS, DELTA_SWEEP_S: its seconds, shared by the lengths) | attention-sweep
# (ATTENTION_PRESETS, ATTENTION_LENGTHS, ATTENTION_SWEEP_S; ATTENTION_SWEEP=0: the own launch alone) |
# check (CHECK_FILES, CHECK_S: its GPU tests) |
# capsules | load | gemv | vision | constraint | spec | spec-27b (DENSE_GEMV: cublas or triton for the last three; spec takes
# SPEC_MODEL, SPEC_VOCABS, spec-27b SPEC_ACCEPTANCE); quant-tune takes TUNE_ARGS, quant QUANT_PRESETS, profile PROFILE_PRESET, PROFILE_FORMAT, PROFILE_CONTEXTS,
# PROFILE_DRAFTS, PROFILE_DRAFT_VOCAB, PROFILE_DENSE_GEMV, gemv GEMV_TUNE_S and GEMV_TUNE_27B_S (tuning budgets; 0 skips)
# and GEMV_SPEC (0 skips its bench-spec runs))
# Every phase keeps its whole log under $OUT/<card>_<commit>/ (the device tool returns only the output's tail).
# The wheels in .whl, where there are any (what the machine lacks: fla-core 0.6.0 and einops, llguidance 1.9.1; `pip download
# --no-deps` them here), are installed first.
# Runs on an H100 as well: every result records the card's name.
set -uo pipefail
if compgen -G '.whl/*.whl' > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# The commit the results are of (bench/gpu_commit.txt) and one folder for the run: bench/results/<card>_<commit>/
# once copied back.
. "$(dirname "${BASH_SOURCE[0]}")/run_folder.sh" || exit 2
OUT=${OUT:-/tmp/out}/$RUN; mkdir -p "$OUT"; echo "results in $RUN/"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "commit $FLASHRT_GIT_COMMIT" | tee -a "$OUT/gpu.txt"
spec_run() {  # seconds name label args...: bench-spec with args into $OUT/name.json, its log beside it
  local seconds=$1 name=$2 label=$3; shift 3
  timeout "$seconds" python3 -m flashrt_ros.tools bench-spec "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "bench-spec $label rc=$?"; grep -v -i warn "$OUT/$name.log" | grep "^|"
}
length_budget() {  # seconds lengths: a sweep's seconds for each of its lengths, 30 of them kept for the rest
  echo $(( ($1 - 30) / ($(tr -cd , <<< "$2" | wc -c) + 1) ))
}
bench() {  # preset contexts repeats
  timeout "${BENCH_TIMEOUT_S:-540}" python3 -m flashrt_ros.tools bench --model "$1" --device cuda --dtype bfloat16 --contexts "$2" --repeats "$3" \
      --decode-tokens 64 --compare-hf --profile --out "$OUT/bench_$1.json" > "$OUT/bench_$1.log" 2>&1
  echo "bench $1 rc=$?"; grep -v -i warn "$OUT/bench_$1.log" | tail -8
}
for phase in "$@"; do
  echo "===== $phase"
  case "$phase" in
    check)
      timeout ${CHECK_S:-420} python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore --maxfail=5 --tb=short \
          ${CHECK_FILES:-test/runtime/test_runtime_gpu.py test/runtime/test_kernels_*.py} > "$OUT/check_pytest.log" 2>&1
      echo "pytest rc=$?"
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/check_pytest.log" | tail -25
      for kernels in triton reference; do
        python3 -m flashrt_ros.tools verify --model qwen3.5-0.8b --device cuda --dtype bfloat16 --kernels $kernels \
            --prefix-len 2048 --suffix-len 24 --gen 32 --kv-only > "$OUT/verify_0.8b_$kernels.json"; echo "verify rc=$?"
        python3 -c "import json; d=json.load(open('$OUT/verify_0.8b_$kernels.json')); [d.pop(k,None) for k in ('tokens_a','kv_only_tokens')]; print(d)"
      done
      ;;
    delta-sweep)  # the delta rule's launch configurations, at decode and capsule-suffix lengths
      for preset in ${DELTA_PRESETS:-qwen3.5-0.8b qwen3.6-27b}; do
        timeout ${DELTA_SWEEP_S:-240} python3 bench/time_delta_rule.py $preset ${DELTA_LENGTHS:-1,24} --sweep \
            --budget-s $(length_budget ${DELTA_SWEEP_S:-240} ${DELTA_LENGTHS:-1,24}) \
            --out "$OUT/delta_rule_sweep_$preset.json" > "$OUT/delta_rule_sweep_$preset.log" 2>&1
        echo "delta sweep $preset rc=$?"
        grep -v -i warn "$OUT/delta_rule_sweep_$preset.log"
      done
      ;;
    attention-sweep)  # the decode attention's launch configurations, at decode and capsule-suffix lengths at 16k
      for preset in ${ATTENTION_PRESETS:-qwen3.5-0.8b}; do
        timeout ${ATTENTION_SWEEP_S:-240} python3 bench/time_attention.py $preset ${ATTENTION_LENGTHS:-1,24} \
            --context 16384 $([ "${ATTENTION_SWEEP:-1}" = 1 ] && echo --sweep) \
            --budget-s $(length_budget ${ATTENTION_SWEEP_S:-240} ${ATTENTION_LENGTHS:-1,24}) \
            --out "$OUT/attention_sweep_$preset.json" > "$OUT/attention_sweep_$preset.log" 2>&1
        echo "attention sweep $preset rc=$?"; grep -v -i warn "$OUT/attention_sweep_$preset.log"
      done
      ;;
    bench-0.8b) bench qwen3.5-0.8b 2048,8192,16384 20 ;;
    bench-27b) bench qwen3.6-27b 2048,8192,16384 5 ;;
    quant-tune)
      timeout 270 python3 bench/tune_quant_gemv.py --out "$OUT/tune.json" --write-table "$OUT/quant_gemv_configs.py" \
          ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1; rc=$?; echo "tune rc=$rc"; grep -v -i warn "$OUT/tune.log" | tail -40
      [ $rc -eq 0 ] && cp "$OUT/quant_gemv_configs.py" flashrt_ros/runtime/kernels/quant_gemv_configs.py
      ;;
    vision)  # issue 32: the 0.8B tower per camera size, and image-to-first-token cold vs from a post-image capsule
      timeout 120 python3 -m flashrt_ros.tools bench-vision --model qwen3.5-0.8b --device cuda --dtype bfloat16 \
          --repeats 10 --out "$OUT/bench_vision_qwen3.5-0.8b.json" > "$OUT/bench_vision.log" 2>&1
      echo "bench-vision rc=$?"; grep "^|" "$OUT/bench_vision.log"
      for grid in 16x16 32x32; do
        timeout 120 python3 -m flashrt_ros.tools bench-image-ttft --model qwen3.5-0.8b --device cuda --dtype bfloat16 \
            --kernels triton --dense-gemv "${DENSE_GEMV:-cublas}" --grid $grid --repeats 10 \
            --out "$OUT/bench_image_ttft_qwen3.5-0.8b_$grid.json" > "$OUT/bench_image_ttft_$grid.log" 2>&1
        echo "bench-image-ttft $grid rc=$?"; grep "^|" "$OUT/bench_image_ttft_$grid.log"
      done
      ;;
    constraint)  # issue 30: decode constrained vs not (the mask overlapped with the forward), plain and speculative
      for drafts in 0 2; do
        timeout 150 python3 -m flashrt_ros.tools bench-constraint --model qwen3.5-0.8b --device cuda --dtype bfloat16 \
            --kernels triton --dense-gemv "${DENSE_GEMV:-cublas}" --max-context 1024 --decode-tokens 128 --repeats 5 \
            --speculative-tokens $drafts --out "$OUT/bench_constraint_qwen3.5-0.8b_d$drafts.json" \
            > "$OUT/bench_constraint_d$drafts.log" 2>&1
        echo "bench-constraint drafts $drafts rc=$?"; grep "^|" "$OUT/bench_constraint_d$drafts.log"
      done
      ;;
    spec)  # issue 27: the trained model's acceptance and speed here, the 0.8B shape's steps projected at that model's
      # measured tokens per step (full and trimmed draft vocabularies), then exactness on CUDA graphs. SPEC_MODEL: a folder
      # of bench/train_tiny_lm.py (carried: bench/models/ is ignored by git)
      model=${SPEC_MODEL:-bench/models/lm}
      spec_run 150 bench_spec_trained trained --model "$model" --device cuda --kernels triton \
          --text "$model/heldout.txt" --drafts 0,1,2,3,4 --prompts 4 --context 64 --decode-tokens 128 --repeats 5 \
          --max-context 512
      for vocab in ${SPEC_VOCABS:-0 32768}; do
        spec_run 150 "bench_spec_qwen3.5-0.8b_vocab$vocab" "draft_vocab $vocab" --model qwen3.5-0.8b --device cuda \
            --dtype bfloat16 --kernels triton --dense-gemv "${DENSE_GEMV:-cublas}" --draft-vocab $vocab \
            --drafts 0,1,2,3,4 --prompts 2 --context 1024 --decode-tokens 64 --repeats 3 \
            --acceptance-from "$OUT/bench_spec_trained.json"
      done
      FLASHRT_SPEC_MODEL="$model" timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore \
          test/runtime/test_speculative_gpu.py \
          test/runtime/test_kernels_delta_attention.py test/runtime/test_kernels_norms_conv_rope.py \
          -k "speculation or rows or (realistic and conv)" > "$OUT/spec_pytest.log" 2>&1; echo "pytest rc=$?"
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/spec_pytest.log" | tail -12
      ;;
    spec-27b)  # issue 27 and 26: the 27B shape's plain decode (the k = 0 row) and 3-draft step, projected at the
      # tokens per step of SPEC_ACCEPTANCE (a trained model's bench-spec JSON, e.g. this run's or an earlier one's)
      spec_run 480 bench_spec_qwen3.6-27b_vocab32768 27b --model qwen3.6-27b --device cuda --dtype bfloat16 \
          --kernels triton --draft-vocab 32768 --drafts 0,3 --prompts 1 --context 1024 --decode-tokens 32 --repeats 2 \
          --acceptance-from "${SPEC_ACCEPTANCE:-$OUT/bench_spec_trained.json}"
      grep -i "error" "$OUT/bench_spec_qwen3.6-27b_vocab32768.log" | tail -3
      ;;
    gemv)  # the dense GEMV of decode and verify: tune it (rows 1..5, 0.8B then 27B shapes), time each of its fusions
           # against the cuBLAS path's launches, then cuBLAS vs it in the 0.8B decode step
      gemv_tune() {  # presets budget_s name
        [ "$2" = 0 ] && return
        timeout $(( $2 + 60 )) python3 bench/tune_quant_gemv.py --kinds dense --rows 1,2,3,4,5 --presets "$1" --budget-s "$2" \
            --repeats 3 --out "$OUT/tune_dense_$3.json" --write-table "$OUT/quant_gemv_configs.py" > "$OUT/tune_dense_$3.log" 2>&1
        rc=$?; echo "tune dense $3 rc=$rc"; grep -v -i warn "$OUT/tune_dense_$3.log" | tail -12
        [ $rc -eq 0 ] && cp "$OUT/quant_gemv_configs.py" flashrt_ros/runtime/kernels/quant_gemv_configs.py
      }
      timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore test/runtime/test_kernels_dense_gemv.py \
          > "$OUT/gemv_pytest.log" 2>&1; echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gemv_pytest.log" | tail -8
      gemv_tune qwen3.5-0.8b "${GEMV_TUNE_S:-90}" 0.8b
      timeout 120 python3 bench/gemv_fusions.py qwen3.5-0.8b --out "$OUT/gemv_fusions_0.8b.json" > "$OUT/gemv_fusions_0.8b.log" 2>&1
      echo "gemv fusions rc=$?"; grep -v -i warn "$OUT/gemv_fusions_0.8b.log" | tail -24
      timeout 120 python3 -m flashrt_ros.tools bench --model qwen3.5-0.8b --device cuda --dtype bfloat16 --kernels triton \
          --contexts 2048,16384 --repeats 5 --decode-tokens 64 --dense-gemv-paths cublas,triton --decode-only \
          --out "$OUT/gemv_decode_0.8b.json" > "$OUT/gemv_decode_0.8b.log" 2>&1
      echo "bench decode rc=$?"; grep -v -i warn "$OUT/gemv_decode_0.8b.log" | grep "^|"
      for path in $([ "${GEMV_SPEC:-1}" = 1 ] && echo cublas triton); do
        spec_run 100 "gemv_spec_0.8b_$path" "$path" --model qwen3.5-0.8b --device cuda --dtype bfloat16 \
            --kernels triton --dense-gemv $path --drafts 0,1,2,3,4 --prompts 2 --context 1024 --decode-tokens 64 \
            --repeats 3 --assumed-acceptance 0.6
      done
      gemv_tune qwen3.6-27b "${GEMV_TUNE_27B_S:-40}" 27b
      ;;
    quant-tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore test/runtime/test_runtime_quant.py \
          > "$OUT/quant_pytest.log" 2>&1; echo "pytest rc=$?"
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/quant_pytest.log" | tail -15
      ;;
    quant)
      for preset in ${QUANT_PRESETS:-qwen3.5-0.8b qwen3.6-27b}; do
        timeout "${BENCH_TIMEOUT_S:-540}" python3 -m flashrt_ros.tools bench-quant --model $preset --device cuda --dtype bfloat16 \
            --formats dense,fp8,nvfp4 --context 2048 --decode-tokens 64 --prefill-tokens 2048 --fidelity-tokens 32 \
            --repeats 3 --out "$OUT/bench_quant_$preset.json" > "$OUT/bench_quant_$preset.log" 2>&1
        echo "bench-quant $preset rc=$?"; grep -v -i warn "$OUT/bench_quant_$preset.log" | tail -12
      done
      ;;
    profile)
      preset=${PROFILE_PRESET:-qwen3.5-0.8b}; format=${PROFILE_FORMAT:-dense}
      for context in ${PROFILE_CONTEXTS:-16384 8192}; do
        for drafts in ${PROFILE_DRAFTS:-0}; do
          log="$OUT/profile_${preset}_${format}_${context}_d${drafts}${PROFILE_DENSE_GEMV:+_$PROFILE_DENSE_GEMV}.txt"
          timeout "${BENCH_TIMEOUT_S:-540}" python3 bench/profile_step.py $preset $context 24 $format $drafts \
              ${PROFILE_DRAFT_VOCAB:-0} > "$log" 2>&1
          echo "profile $context drafts $drafts rc=$?"; grep -E " ms$|graphs" "$log"
        done
      done
      ;;
    capsules)
      for preset in ${CAPSULE_PRESETS:-qwen3.5-0.8b}; do
        timeout "${BENCH_TIMEOUT_S:-540}" python3 -m flashrt_ros.tools bench-capsules --model $preset --device cuda \
            --dtype bfloat16 --context 16384 --branches 8 --branch-tokens 64 --repeats 10 --capsule-dir /tmp/fc_$preset \
            --capsule-budget-mb 65536 --host-budget-mb 16384 --out "$OUT/bench_capsules_$preset.json" \
            > "$OUT/bench_capsules_$preset.log" 2>&1
        echo "bench-capsules $preset rc=$?"; grep -v -i warn "$OUT/bench_capsules_$preset.log" | tail -8
        timeout 300 python3 bench/profile_restore.py $preset 16384 8 64 200 > "$OUT/profile_restore_$preset.txt" 2>&1
        echo "profile-restore $preset rc=$?"; grep -E "round|sibling restore|aten::|cuda[A-Z]" "$OUT/profile_restore_$preset.txt" | head -15
      done
      timeout 60 python3 bench/restore_copies.py > "$OUT/restore_copies.txt" 2>&1; echo "restore-copies rc=$?"
      grep "^|" "$OUT/restore_copies.txt"
      python3 -m flashrt_ros.tools.bench_files --mib 243 --device cuda --dir /tmp/capsule_files --repeats 5 \
          --json "$OUT/bench_files_cuda.json" > "$OUT/bench_files_cuda.log" 2>&1
      echo "bench_files rc=$?"; tail -8 "$OUT/bench_files_cuda.log"
      ;;
    load)  # issue 25: load time, disk GB/s, peak device memory and RSS against the final bytes, per preset and format
      for preset in ${LOAD_PRESETS:-qwen3.5-0.8b qwen3.6-27b}; do
        for format in dense fp8 nvfp4; do
          timeout 300 python3 bench/load_memory.py --model $preset --format $format --device cuda \
              --out "$OUT/load_${preset}_${format}_preset.json" >> "$OUT/load.log" 2>&1; echo "load $preset $format rc=$?"
        done
      done
      # From disk: synthetic folders of the preset's shape, written on the device, one at a time (64 GB disk).
      for folder in ${LOAD_FOLDERS:-qwen3.5-0.8b:dense qwen3.5-0.8b:fp8 qwen3.5-0.8b:nvfp4 qwen3.6-27b:nvfp4}; do
        preset=${folder%%:*}; format=${folder##*:}; dir=/tmp/ckpt_${preset}_$format
        timeout 400 python3 bench/load_memory.py --write-checkpoint $dir --model $preset --checkpoint-format $format \
            --device cuda > /dev/null 2>&1 && timeout 300 python3 bench/load_memory.py --model $dir --format $format \
            --device cuda --out "$OUT/load_${preset}_${format}_folder.json" >> "$OUT/load.log" 2>&1
        echo "load folder $preset $format rc=$?"; rm -rf $dir
      done
      python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("load_*.json")):
    d = json.loads(f.read_text())
    print(f.name, f"load {d['load_s']:.2f}s", f"disk {d['disk_gb_per_s'] or 0:.2f} GB/s",
          f"peak {d['peak_device_bytes']/1e9:.2f} GB", f"final+arena {(d['final_weight_bytes']+d['arena_bytes'])/1e9:.2f} GB",
          f"ratio {d['peak_over_final']:.4f}", f"rss {d['peak_rss_bytes']/1e9:.2f} GB")
PY
      ;;
  esac
done
