#!/usr/bin/env bash
# Every GPU test and benchmark in one device call; logs and JSON land in $OUT.
#   bash benchmarks/run_device.sh [tests|model|kernels|profile|structured|binv|all]   (default: all)
#   bash benchmarks/run_device.sh dp [ARGS of deepinfer bench data-parallel]   (several GPUs;
#     not in all: NCCL tests, the all-to-all sweep, DP + EP throughput against the simulator)
#   bash benchmarks/run_device.sh async   (not in all: async scheduling's tests and figures)
#   bash benchmarks/run_device.sh decode  (not in all: decode-path tests, tok/s, kernel profile)
#   bash benchmarks/run_device.sh spec [ARGS of deepinfer bench speculative]   (not in all: the
#     whole sweep takes longer than one device call; e.g. spec --ks 3 --acceptance 0.85)
#   bash benchmarks/run_device.sh first   (not in all: start-up, then the first burst on the
#     fresh engine against the same-sized bursts after it; about 1.5 min)
#   bash benchmarks/run_device.sh serve   (not in all: `deepinfer serve` on Moonlight shapes,
#     the bundled Azure code trace over HTTP at 70% of the offline capacity beside the same
#     requests offline and the simulator; about 7 min)
#   bash benchmarks/run_device.sh fp8gemv   (not in all: the FP8 GEMV at 1-2 rows, its tests,
#     probe and decode rows, then the FP8 profile and an FP8 real run priced by it; ~10 min)
#   bash benchmarks/run_device.sh gc   (not in all: the collector's pauses in a served run,
#     the start-up heap frozen and not, Moonlight shapes; about 2 min)
#   bash benchmarks/run_device.sh fp8   (not in all: the FP8 kernels' and FP8 model's GPU
#     tests, then model-speed rows of Moonlight shapes in bf16 and FP8 side by side)
#   bash benchmarks/run_device.sh mutation [MUTANT GLOBS]   (not in all: no GPU, the device's
#     CPU cores: mutmut over tests/property, tests/property/MUTATION.md; its wheels travel in
#     .whl/mut/ (pip download mutmut==3.8.1 and its dependencies, hypothesis, for Python 3.12);
#     results and per-module counts land in $OUT/mutation/)
#   bash benchmarks/run_device.sh fidelity46a|fidelity46b|fidelity46c   (not in all: the
#     held-out fidelity workloads, each run 3 times by the real engine beside the simulator;
#     a: Moonlight, own arrivals at 1x / 2x / saturated / 2x overload, Poisson async and
#     sync, the conversation trace (~7 min); b: Moonlight, small KV cache, prefix reuse at
#     50/70/90%, speculation k = 3 and varlen with an added MTP layer (~7 min); c:
#     DeepSeek-V2-Lite, long prompts (16k-64k), offline, saturated, conversation, prefix
#     reuse 70%, k = 3 (~6 min). Profiles ship for the H200 and the H100: on another card
#     the simulator prices with the analytic model (the tables' "cost model" line says
#     which); pass --step-log DIR to keep the real runs' step logs for `profile --from-log`.
#     SAME_LEASE_PROFILE=1 first measures the model's profile on this card (about 2 min)
#     and prices with it: the real engine's speed drifts between leases by more than the
#     errors measured, so a profile from another lease is not the floor of the error.
#     With it a recipe outlasts one 10-minute device call: pass fewer workloads and
#     repeats (e.g. --workloads offline,conversation --repeats 1; the last flags win).
#   bash benchmarks/run_device.sh kv45 [ARGS of deepinfer bench kv-tiers]   (not in all: the
#     host KV tier's GPU tests, then Moonlight shapes on a Mooncake slice with prefix reuse,
#     HBM holding a quarter of the shared prefixes, without and with the host tier, and 1P1D
#     in one process on the GPU, each beside the simulator; about 5 min)
# The model sweep's JSON plots here with python -m benchmarks.plot_model_speed (matplotlib).
# Missing pure-Python packages (simpy) travel as wheels in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The benchmarks run as `deepinfer bench NAME`; --debug keeps a failure's traceback.
bench=(python3 -m deepinfer --debug bench)
what=${1:-all}
shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
status=0
# Decode speed and async scheduling (not in all): the GPU tests of the decode path (decode:
# its kernels too; async: speculation too), decode tok/s sync and async, then a kernel
# profile of decode at batch 1 and 256 (decode), or the served Azure trace against the
# simulator (async).
if [[ $what == decode || $what == async ]]; then
  tests=(tests/executors/test_async_overlap.py tests/executors/test_cuda_graphs.py
    tests/executors/test_piecewise_graphs.py tests/executors/test_torch_executor.py)
  if [[ $what == decode ]]; then
    tests+=(tests/kernels/test_fused_moe.py tests/kernels/test_moe_router.py
      tests/kernels/test_mla_decode.py tests/executors/test_projection_fusion.py)
  else
    tests+=(tests/executors/test_speculative_llm.py tests/executors/test_spec_chain.py)
  fi
  python3 -m pytest -q -m gpu "${tests[@]}" -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -8
  status=${PIPESTATUS[0]}
  "${bench[@]}" model-speed --no-hf --async-scheduling --prefill "" --contexts 1024 \
    --served-rate 20 --json "$OUT/model_speed_async.json" 2>&1 | grep -v Warning \
    | tee "$OUT/model_speed_async.log" | tail -24
fi
if [[ $what == decode ]]; then
  python3 -m benchmarks.profile_step --prefill "" --batches 1,256 --rows 30 2>&1 \
    | grep -v "^-" | cut -c1-60,100-240 > "$OUT/profile.log"
  grep "^==" "$OUT/profile.log"
fi
if [[ $what == async ]]; then
  "${bench[@]}" fidelity --out "$OUT/fidelity_async" --model moonlight-16b-a3b \
    --device cuda --num-requests 200 --traces azure_code_small.json --num-gpu-blocks 20000 \
    --max-num-seqs 256 --max-num-batched-tokens 8192 --async-scheduling true --repeats 1 \
    2>&1 | grep -v Warning | tee "$OUT/fidelity_async.log" | tail -30
  # The served prompt steps replayed as the profiler replays its points: is the gap
  # between the price of a mixed step and its served time in its shape or its context?
  python3 benchmarks/investigations/step_variance.py --served "$OUT/fidelity_async/fidelity.json" \
    --steps 12 2>&1 | grep -v Warning | tee "$OUT/served_replay.log" | tail -15
fi
if [[ $what == mutation ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mut .whl/mut/*.whl
  mkdir -p "$OUT/mutation"
  # Stop short of the device's per-command limit so the results are written either way.
  PYTHONPATH="/tmp/mut:$PYTHONPATH" HYPOTHESIS_PROFILE=mutation timeout "${MUTMUT_SECONDS:-480}" \
    python3 -m mutmut run --max-children "$(nproc)" "$@" > "$OUT/mutation/run.log" 2>&1
  echo "mutmut run exit $?"
  PYTHONPATH="/tmp/mut:$PYTHONPATH" python3 -m mutmut results --all true \
    > "$OUT/mutation/results.txt" 2>&1
  python3 tests/property/mutation_counts.py "$OUT/mutation/results.txt" \
    | tee "$OUT/mutation/counts.md"
fi
if [[ $what == fidelity46a || $what == fidelity46b || $what == fidelity46c ]]; then
  # benchmarks/fidelity_workloads.py names the recipes; the engine of run A in RESULTS.md
  # (async scheduling on unless a recipe says otherwise).
  model=moonlight-16b-a3b
  extra=()
  case $what in
    fidelity46a) workloads=offline,own-arrivals,own-arrivals-x2,saturated,overload-2x,async,sync,conversation ;;
    fidelity46b) workloads=small-kv,prefix-reuse-50,prefix-reuse-70,prefix-reuse-90,spec-k3,spec-varlen
      extra=(--add-mtp-layer) ;;
    fidelity46c) model=deepseek-v2-lite
      workloads=long-context,offline,saturated,conversation,prefix-reuse-70,spec-k3
      extra=(--add-mtp-layer) ;;
  esac
  if [[ ${SAME_LEASE_PROFILE:-0} == 1 ]]; then
    hw=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" \
      | tr 'H' 'h')
    profile="$OUT/${model}__${hw:-gpu}.json"
    rm -f "$profile"
    timeout 300 python3 -m deepinfer profile --model $model --device cuda --add-mtp-layer \
      --num-speculative-tokens 3 --reps 3 --block-size 64 --max-num-seqs 512 \
      --max-num-batched-tokens 16384 --num-gpu-blocks 20000 --out "$profile" 2>&1 \
      | grep -v "profiling:" | tail -5 | tee "$OUT/$what.profile.log"
    if [[ ${PIPESTATUS[0]} != 0 || ! -f $profile ]]; then
      echo "SAME_LEASE_PROFILE: the profile failed (see $what.profile.log): no real runs" >&2
      exit 1
    fi
    extra+=(--profile "$profile")
  fi
  "${bench[@]}" fidelity --out "$OUT/$what" --model $model --device cuda --repeats 3 \
    --workloads $workloads "${extra[@]}" --num-gpu-blocks 20000 --max-num-seqs 256 \
    --max-num-batched-tokens 8192 "$@" 2>&1 | grep -v Warning | tee "$OUT/$what.log" | tail -60
  status=${PIPESTATUS[0]}
fi
if [[ $what == kv45 ]]; then
  python3 -m pytest -q -m gpu tests/executors/test_host_kv_tier.py tests/executors/test_kv_handover.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
  "${bench[@]}" kv-tiers --out "$OUT/kv45" --model moonlight-16b-a3b --device cuda \
    --num-requests 60 --max-prompt 8192 --max-output 32 --prefix-hit 0.7 --documents 8 \
    --hbm-fraction 0.25 --pd-requests 16 --max-num-seqs 64 --max-num-batched-tokens 8192 "$@" 2>&1 | grep -v Warning \
    | tee "$OUT/kv45.log" | tail -45
  status=${PIPESTATUS[0]}
fi
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider --durations=10 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if [[ $what == all || $what == kernels ]]; then
  "${bench[@]}" kernels 2>&1 | tee "$OUT/kernels_bench.log" | tail -40
fi
if [[ $what == all || $what == model ]]; then
  "${bench[@]}" model-speed --eager --json "$OUT/model_speed.json" 2>&1 \
    | grep -v Warning | tee "$OUT/model_speed.log" | tail -20
fi
if [[ $what == all || $what == profile ]]; then
  python3 -m benchmarks.profile_step --prefill 16384 --batches 1,64 --rows 20 2>&1 \
    | grep -v "^-" | cut -c1-60,100-240 > "$OUT/profile.log"
  grep "^==" "$OUT/profile.log"
fi
# The grammar mask's cost (so_args): needs xgrammar and its dependencies, as wheels in .whl/.
if [[ $what == all || $what == structured ]]; then
  if python3 -c "import xgrammar" 2>/dev/null; then
    "${bench[@]}" structured-outputs --batches 1,64 --json "$OUT/structured_mask.json" 2>&1 \
      | grep -v Warning | tee "$OUT/structured_mask.log" | tail -5
    "${bench[@]}" structured-outputs --mask-only --batches 1,64,256 2>&1 \
      | grep -v Warning | tee -a "$OUT/structured_mask.log" | tail -4
  else
    echo "structured: xgrammar is not installed (put its wheels in .whl/)" | tee "$OUT/structured_mask.log"
  fi
fi
# Batch-invariant mode: its GPU tests with their diagnostics printed (-s), then the cost.
if [[ $what == all || $what == binv ]]; then
  python3 -m pytest -q -s -m gpu tests/kernels/test_batch_invariant.py \
    tests/executors/test_batch_invariant.py -p no:cacheprovider 2>&1 \
    | grep -v Warning | tee "$OUT/batch_invariant_tests.log" | tail -40
  rc=${PIPESTATUS[0]}
  [[ $what == binv ]] && status=$rc
  "${bench[@]}" batch-invariant --json "$OUT/batch_invariant.json" 2>&1 \
    | grep -v Warning | tee "$OUT/batch_invariant.log" | tail -12
  # Where batch 256 goes: a kernel profile in each mode, and the decode attention's fixed
  # pieces (256/512/1024 keys) against the normal split choice.
  for mode in --batch-invariant ""; do
    python3 -m benchmarks.profile_step $mode --prefill "" --batches 256 --rows 40 2>&1 \
      | grep -v "^-" | cut -c1-60,100-240 > "$OUT/profile_b256${mode:+_binv}.log"
  done
  grep -h "^==" "$OUT"/profile_b256*.log
  "${bench[@]}" kernels --only binv_mla 2>&1 | grep -v Warning \
    | tee "$OUT/binv_mla.log" | grep "mla_decode" | tail -24
fi
if [[ $what == spec ]]; then
  # Speculation: the GPU tests of verify steps (chained on the step in flight under async
  # scheduling, graphs captured), then decode tok/s with over without, Moonlight shapes +
  # an MTP layer, the benchmark-only corrupted-greedy drafter; the simulator beside.
  python3 -m pytest -q -m gpu tests/executors/test_spec_chain.py \
    tests/executors/test_speculative_llm.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/spec_tests.log" | tail -6
  status=${PIPESTATUS[0]}
  "${bench[@]}" speculative --json "$OUT/speculative.json" "$@" 2>&1 \
    | grep -v Warning | tee "$OUT/speculative.log" | tail -70
fi
if [[ $what == fp8 ]]; then
  # FP8 block-scaled weights: kernel vs twin (GEMM, fused MoE), then the FP8 model on the
  # GPU; then decode/prefill rows in bf16 and FP8 (roofline with 1-byte weights).
  python3 -m pytest -q -m gpu tests/kernels/test_fp8_linear.py \
    tests/executors/test_fp8_checkpoint.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/fp8_tests.log" | tail -10
  status=${PIPESTATUS[0]}
  for quant in "" fp8; do
    "${bench[@]}" model-speed --no-hf ${quant:+--quantization $quant} --batches 1,8,64,256 \
      --json "$OUT/model_speed${quant:+_$quant}.json" 2>&1 | grep -v Warning \
      | tee "$OUT/model_speed${quant:+_$quant}.log" | tail -20
  done
fi
if [[ $what == fp8gemv ]]; then
  # The FP8 GEMV at 1-2 rows: its GPU tests, the probe against the fused GEMM, decode at
  # batches 1-8 in bf16 and FP8, then (what a speed change re-measures) the FP8 profile
  # and FP8 real runs priced with it, within one call (LIMIT: the call's seconds).
  t0=$SECONDS
  python3 -m pytest -q -m gpu tests/kernels/test_fp8_linear.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/fp8_tests.log" | tail -4
  status=${PIPESTATUS[0]}
  python3 -m benchmarks.investigations.fp8_gemv --rows 1,2,4,8 2>&1 | grep -v Warning \
    | tee "$OUT/gemv_probe.log"
  for quant in "" fp8; do
    "${bench[@]}" model-speed --no-hf ${quant:+--quantization $quant} --batches 1,2,4,8 \
      --contexts 1024 --prefill "" --mixed "" --short-prompts "" \
      --json "$OUT/model_speed${quant:+_$quant}.json" 2>&1 | grep -v Warning \
      | tee "$OUT/model_speed${quant:+_$quant}.log" | tail -7
  done
  hw=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" \
    | tr 'H' 'h')
  prof="$OUT/moonlight-16b-a3b__fp8__${hw:-gpu}.json"
  timeout $((${LIMIT:-585} - SECONDS + t0)) python3 -m deepinfer profile \
    --model moonlight-16b-a3b --quantization fp8 --add-mtp-layer --num-speculative-tokens 3 \
    --reps 3 --block-size 64 --max-num-seqs 512 --max-num-batched-tokens 16384 \
    --num-gpu-blocks 20000 --out "$prof" 2>&1 | grep -v "profiling:" | tail -4
  if [[ -f $prof && $((${LIMIT:-585} - SECONDS + t0)) -gt 120 ]]; then
    timeout $((${LIMIT:-585} + 5 - SECONDS + t0)) "${bench[@]}" fidelity \
      --model moonlight-16b-a3b --device cuda --quantization fp8 --repeats 1 --bands 0 \
      --workloads own-arrivals --num-gpu-blocks 20000 --max-num-seqs 256 \
      --max-num-batched-tokens 8192 --step-log "$OUT/steps" --out "$OUT/fidfp8" \
      --profile "$prof" 2>&1 | grep -v Warning | tee "$OUT/fidfp8.log" | tail -30
  fi
fi
if [[ $what == gc ]]; then
  python3 benchmarks/investigations/gc_pauses.py --model moonlight-16b-a3b --device cuda \
    --json "$OUT/gc_pauses.json" 2>&1 | grep -v Warning | tee "$OUT/gc_pauses.log" | tail -4
fi
if [[ $what == first ]]; then
  # First use (issue 12): the engine's start-up, then 3 bursts of 128 requests; the first
  # within 10% of the later ones means no served step paid a compile or a capture.
  "${bench[@]}" first-burst --json "$OUT/first_burst.json" 2>&1 \
    | grep -v Warning | tee "$OUT/first_burst.log" | tail -8
  status=${PIPESTATUS[0]}
fi
if [[ $what == serve ]]; then
  # The offline replay first: its capacity sets the served rate (70%), the same Poisson
  # arrivals (seed 0) then go over HTTP, the simulator predicting them beside. A rate
  # given (serve RATE, requests/s) skips the offline replay.
  engine=(--num-gpu-blocks 20000 --max-num-seqs 256 --max-num-batched-tokens 8192)
  rate=${1:-}
  if [[ -z $rate ]]; then
    "${bench[@]}" fidelity --out "$OUT/fidelity_offline" --model moonlight-16b-a3b \
      --device cuda --num-requests 200 --traces azure_code_small.json --rates 0.7 \
      --repeats 1 "${engine[@]}" 2>&1 | grep -v Warning | tee "$OUT/fidelity_offline.log" | tail -30
    capacity=$(grep -o "capacity [0-9.]* req/s" "$OUT/fidelity_offline.log" | head -1 \
      | cut -d' ' -f2)
    rate=$(python3 -c "print(0.7 * float('${capacity:-0}'))")
  fi
  hw=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" \
    | tr 'H' 'h')
  python3 -m deepinfer serve moonlight-16b-a3b --load-format dummy --port 8011 \
    --log-level warning "${engine[@]}" > "$OUT/serve.log" 2>&1 &
  server=$!
  python3 - "$server" <<'PY'
import os, sys, time, urllib.request
for _ in range(600):  # until the server answers, or its process is gone
    try:
        urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=1)
        break
    except OSError:
        try:
            os.kill(int(sys.argv[1]), 0)
        except OSError:
            sys.exit("the server exited: see serve.log")
        time.sleep(1)
PY
  "${bench[@]}" serve traces/azure_code_small.json --base-url http://127.0.0.1:8011 \
    --max-requests 200 --request-rate "$rate" --seed 0 --compare-sim --hardware "${hw:-h200}" \
    --out "$OUT/bench_serve.json" --no-progress 2>&1 | grep -v Warning \
    | tee "$OUT/bench_serve.log" | tail -40
  status=${PIPESTATUS[0]}
  python3 -c "import urllib.request; print(urllib.request.urlopen(\
'http://127.0.0.1:8011/metrics').read().decode())" > "$OUT/serve_metrics.txt" 2>&1
  kill -TERM $server
  wait $server
  tail -5 "$OUT/serve.log"
fi
if [[ $what == dp ]]; then
  # Several GPUs (a multi-GPU kind): expert/data-parallel tests over NCCL, the all-to-all
  # against message size, then throughput per GPU at 1/2/4/8 GPUs beside the simulator.
  python3 -m pytest -q -m gpu tests/executors/test_expert_parallel.py \
    tests/executors/test_data_parallel_gpu.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/dp_tests.log" | tail -15
  status=${PIPESTATUS[0]}
  python3 benchmarks/investigations/all_to_all.py --json "$OUT/all_to_all.json" 2>&1 \
    | grep -v Warning | tee "$OUT/all_to_all.log" | tail -30
  "${bench[@]}" data-parallel --json "$OUT/data_parallel.json" "$@" 2>&1 \
    | grep -v Warning | tee "$OUT/data_parallel.log" | tail -12
fi
# The device call brings back at most 8 files of $OUT, 16 MiB each: past 8 files,
# everything travels as one archive in parts of 15 MiB (cat results.tgz.* | tar xz here).
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
  tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete \
    && split -b 15M /tmp/results.tgz "$OUT/results.tgz." && rm /tmp/results.tgz
fi
exit $status
