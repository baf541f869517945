#!/usr/bin/env bash
# Builds moe (Release) and runs the whole test suite with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
# Tests run one at a time: each already uses every core.
cd "$BUILD_DIR" && ctest --output-on-failure
