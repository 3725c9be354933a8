#!/usr/bin/env bash
# One device call: the GPU tests, then the shipped H200 profiles (sim/data/profiles/).
#   bash benchmarks/device_profile.sh [tests|profiles|ship|all]      results under $OUT
# ship: the profiles, then the fidelity benchmark with the new Moonlight profile (what a
# change to the real executor's speed must re-measure before it lands; about 7 minutes,
# so give the call the whole 600 s; the fidelity run is skipped if Moonlight's profile failed).
# At most 8 files come back from $OUT: ship writes 5.
# Then, back on the repo's machine, for each profile: deepinfer profile install FILE
# --commit HASH (how each step kind moved against the shipped profile; the device's
# copied .git cannot tell the commit measured: its meta says commit_dirty).
# The profiles speculate (3 drafts, through an MTP layer added in each model's shapes:
# neither ships one): besides the plain grid (measured with the drafter detached) they
# hold verify steps of 1 + k tokens a request, k = 1..3, each with the drafter's proposal.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
what=${1:-all}
if [[ $what == all || $what == tests ]]; then
  timeout 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider --durations=15 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -30
fi
if [[ $what == all || $what == profiles || $what == ship ]]; then
  for model in moonlight-16b-a3b deepseek-v2-lite; do
    timeout 280 python3 -m deepinfer profile --model "$model" --device cuda \
      --num-gpu-blocks 20000 --max-num-seqs 512 --max-num-batched-tokens 16384 \
      --num-speculative-tokens 3 --add-mtp-layer \
      --out "$OUT/${model}__h200.json" 2>&1 | grep -v "profiling:" | tail -5
  done
fi
if [[ $what == ship && -f "$OUT/moonlight-16b-a3b__h200.json" ]]; then
  timeout 240 python3 -m deepinfer --debug bench fidelity --out "$OUT/fidelity" --profile "$OUT/moonlight-16b-a3b__h200.json" \
    --model moonlight-16b-a3b --device cuda --num-requests 200 --traces azure_code_small.json \
    --num-gpu-blocks 20000 --max-num-seqs 256 --max-num-batched-tokens 8192 \
    --async-scheduling true 2>&1 | grep -v Warning | tail -30
fi
