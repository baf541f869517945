#!/usr/bin/env bash
# The main job: build moe (Release), prepare the King James Bible corpus, pretrain the `small`
# MoE model on the CPU (configs/small.toml, about ten minutes on two cores) and let the trained
# model continue a prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
RUN_DIR=${RUN_DIR:-runs/small}
start=$SECONDS

bash scripts/setup.sh
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target moe
bash scripts/prepare_corpus.sh

# A fresh run each time: the trainer refuses to start over a directory that holds checkpoints.
if [ -d "$RUN_DIR" ]; then
  echo "demo: removing the previous demo run $RUN_DIR"
  rm -rf "$RUN_DIR"
fi
"$BUILD_DIR/moe" train --config configs/small.toml --run.out_dir "$RUN_DIR"

CKPT=$(ls -d "$RUN_DIR"/checkpoints/step_* | sort -V | tail -n 1)
echo
echo "demo: sampling from $CKPT"
"$BUILD_DIR/moe" sample --model "$CKPT" --prompt "And God said" --max-tokens 300 \
  --temperature 0.6 --top-k 40 --seed 1
echo
echo "demo: done in $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s; metrics in $RUN_DIR/metrics.jsonl"
