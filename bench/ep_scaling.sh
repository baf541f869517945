#!/usr/bin/env bash
# Training tokens/s of `moe train` at expert-parallel sizes 1, 2 and 4 (np = ep) on this
# machine, each as a ratio to the one-process run measured in the same invocation.
# Usage: bench/ep_scaling.sh [STEPS] [extra moe train overrides...]
# The threads per rank default to cores / ranks, so every size uses the same cores; with more
# ranks than cores the run is oversubscribed (1 thread per rank) and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
STEPS=${1:-12}
shift || true
[ -x "$BUILD_DIR/moe" ] || { echo "build first: cmake --build $BUILD_DIR --target moe"; exit 1; }
[ -f data/kjv.txt ] || bash scripts/prepare_corpus.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cores=$(nproc)
declare -A tps
for np in 1 2 4; do
  out="$work/ep$np"
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" \
    "$BUILD_DIR/moe" train --config configs/small.toml --ep "$np" --schedule.steps "$STEPS" \
    --schedule.warmup_steps 2 --logging.progress none --data.val_fraction 0.001 \
    --data.val_batches 1 --run.out_dir "$out" "$@" > "$work/log$np" 2>&1 ||
    { cat "$work/log$np"; exit 1; }
  # Median step after the first two (allocator and MPI warm-up).
  tps[$np]=$(/usr/bin/python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open('$out/metrics.jsonl')][2:]
print(statistics.median(r['tokens_per_s'] for r in rows))")
  threads=$(( cores / np > 0 ? cores / np : 1 ))
  note=""; [ "$np" -gt "$cores" ] && note=" (oversubscribed: $np ranks on $cores cores)"
  printf "EP %d: %d rank(s) x %d thread(s): %8.0f tokens/s  ratio to EP 1 %.2f%s\n" "$np" "$np" \
    "$threads" "${tps[$np]}" "$(/usr/bin/python3 -c "print(${tps[$np]} / ${tps[1]})")" "$note"
done
