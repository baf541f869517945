#!/usr/bin/env bash
# Regenerates the numerical fixtures in tests/fixtures/ from the PyTorch reference
# (tests/reference/deepseek_ref.py, deepseek_v4_ref.py), then reloads and re-checks them.
# Needs Debian's python3-torch (torch 1.13) and python3-numpy: scripts/setup.sh installs them.
# Extra arguments go to the generator, e.g. --case v2_softmax, or --selftest (float64 checks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=/usr/bin/python3
# OpenBLAS's generic kernels: the same bits on every x86-64 CPU (gen_fixtures.py sets it too).
export OPENBLAS_CORETYPE=Prescott
"$PY" -c "import torch, numpy" 2>/dev/null || { echo "gen_fixtures: $PY lacks torch/numpy (run scripts/setup.sh)" >&2; exit 1; }
if [ $# -gt 0 ]; then
  exec "$PY" tests/reference/gen_fixtures.py "$@"
fi
"$PY" tests/reference/gen_fixtures.py
"$PY" tests/reference/gen_fixtures.py --check
"$PY" tests/reference/gen_released_layouts.py
"$PY" tests/reference/gen_released_layouts.py --check
# DeepSeek-V4 (tests/reference/deepseek_v4_ref.py): per-module and whole-model fixtures.
"$PY" tests/reference/gen_v4_fixtures.py
"$PY" tests/reference/gen_v4_fixtures.py --check
# A tiny DeepSeek-V4 checkpoint in the released layout (FP8 + F8_E8M0 `.scale`, MXFP4 experts,
# BF16, F32, I64 tid2eid) with the reference's logits (tests/fixtures/v4_released).
"$PY" tests/reference/make_v4_checkpoint.py
"$PY" tests/reference/make_v4_checkpoint.py --check
