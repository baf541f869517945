#!/usr/bin/env bash
# Engine vs PyTorch on the same model, data shape and thread count: tokens/s and peak memory of
# both, and their ratios. Usage: bench/e2e_vs_pytorch.sh [--config small --batch 8 --seq 256
# --steps 10 --threads 2 --vocab N]  (every option goes to both sides)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
[ -x "$BUILD_DIR/bench/bench_e2e_train" ] || { echo "build first: cmake --build $BUILD_DIR"; exit 1; }
engine=$("$BUILD_DIR/bench/bench_e2e_train" "$@")
torch=$(/usr/bin/python3 bench/pytorch_train.py "$@")
echo "$engine"
echo "$torch"
/usr/bin/python3 - "$engine" "$torch" <<'PY'
import json, sys
e, t = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"tokens/s  moe {e['tokens_per_s']:.0f}  pytorch {t['tokens_per_s']:.0f}  ratio {e['tokens_per_s'] / t['tokens_per_s']:.2f}x")
print(f"peak RSS  moe {e['peak_rss_bytes'] / 2**20:.0f} MiB  pytorch {t['peak_rss_bytes'] / 2**20:.0f} MiB  ratio {e['peak_rss_bytes'] / t['peak_rss_bytes']:.2f}x")
print(f"MFU       moe {e['mfu']:.1%} of the {e['fma_peak_gflops']:.0f} GFLOP/s fp32 FMA peak ({e['simd']}, {e['cpu']}); "
      f"{e['of_gemm_peak']:.1%} of the engine's {e['gemm_peak_gflops']:.0f} GFLOP/s GEMM peak")
PY
