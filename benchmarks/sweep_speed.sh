#!/usr/bin/env bash
# deepinfer sweep wall time against the worker count: the 16-config grid on the bundled
# trace, local worker processes. Usage: bash benchmarks/sweep_speed.sh [WORKERS...]
# Prints one line per run and whether the ranked configs are byte-identical to 1 worker's.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${SWEEP_SPEED_OUT:-/tmp/sweep_speed}
slo=${SWEEP_SLO:-ttft_p99:2000,tpot_p99:150}
rm -rf "$out"
workers=("$@")
[ ${#workers[@]} -eq 0 ] && workers=(1 2 4)
for w in "${workers[@]}"; do
    python3 -m deepinfer sweep --grid benchmarks/sweep_grid.yaml --slo "$slo" \
        --workers "$w" --out "$out/w$w" --no-progress --no-plot | tail -2 | head -1
done
for w in "${workers[@]}"; do
    cmp -s "$out/w1/configs.csv" "$out/w$w/configs.csv" && cmp -s "$out/w1/points.csv" "$out/w$w/points.csv" \
        && echo "workers=$w: configs.csv and points.csv identical to workers=1" \
        || echo "workers=$w: DIFFERENT from workers=1"
done
head -4 "$out/w1/configs.csv" | cut -c1-160
