#!/usr/bin/env bash
# Expert-parallel dispatch + combine vs raw MPI_Alltoallv of the same bytes at 1, 2 and 4 ranks,
# one table. Usage: bench/dispatch_vs_alltoallv.sh [bench_dispatch options, e.g. --tokens 2048]
# BUILD_DIR (default build-release) must be an already configured build directory; NPS
# (default "1 2 4") picks the rank counts. One OpenMP thread per rank, so np ranks ask for np
# cores: above the machine's core count the ranks are oversubscribed (and timings say so).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-release}
[ -f "$BUILD_DIR/CMakeCache.txt" ] || {
  echo "configure first: cmake -S . -B $BUILD_DIR -DCMAKE_BUILD_TYPE=Release"
  exit 1
}
cmake --build "$BUILD_DIR" --target bench_dispatch
bin="$BUILD_DIR/bench/bench_dispatch"
echo "cores: $(nproc)"
header=()
for np in ${NPS:-1 2 4}; do
  OMP_NUM_THREADS=1 \
    mpirun --allow-run-as-root --oversubscribe -np "$np" "$bin" --threads 1 "${header[@]}" "$@"
  header=(--no-header)
done
