#!/usr/bin/env bash
# Builds moe (Release) and runs the whole test suite with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
# As many tests at a time as there are cores. Most of a test is single-threaded setup and
# checking even where its kernels use both threads: on a 2-core Zen 3, from a build directory
# without ctest's timing data (as in CI), the suite took 0.87-0.89 of the time of one at a time
# (two alternated pairs: 307 and 334 s against 352 and 374 s). The MPI and command-line tests
# claim their ranks' cores (PROCESSORS in tests/CMakeLists.txt), so they never share them.
cd "$BUILD_DIR" && ctest --output-on-failure -j "$(nproc)"
