#!/usr/bin/env bash
# Builds moe with AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer comes with ASan)
# and runs the unit and MPI tests under them. Any report fails the run: UBSan and ASan abort on
# their first finding, LSan fails the process at exit.
#
#   bash scripts/test_sanitizers.sh              # build into build-sanitize/, run the suite
#   BUILD_DIR=... CTEST_ARGS="-R test_io" bash scripts/test_sanitizers.sh
#
# -O1: instrumented code at -O2 builds twice as slowly for little gain in what the checks see.
# The tests' and the command line's own code is built at -O0 (CMakeLists.txt): UBSan at -O1 made
# those files two to three times slower to compile, and the work they drive runs in the engine.
# The SIMD kernels are the exception (-O2, without use-after-scope and UBSan's alignment, null
# and pointer-overflow checks; CMakeLists.txt says why): at -O1
# their register tiles lived on the stack and the suite's tests took 1,705 s on a Zen 3 with
# 2 cores; 677 s with the kernels built so and fast malloc stacks outside the MPI tests, and
# 394 s once those had fast stacks too (tests/sanitizers/keep_plugins_loaded.cpp).
# The tests run side by side, as many as there are cores (ctest -j; the MPI and CLI tests claim
# their ranks' cores through PROCESSORS): most of an instrumented test is single-threaded work,
# and on 2 cores the step's tests took 1,179-1,380 s instead of 1,510 s one at a time (more
# when a fresh build directory has no ctest cost data to start the longest tests first).
# Left to the normal build, to keep this step short on 2 cores: the tests
# that only repeat another test on a forced SIMD target (*_avx2, *_scalar: the same source, and
# the sanitizers find memory and UB errors, not rounding differences); fault_kill9 (20 runs
# killed by SIGKILL: no sanitizer report can come from a killed process); and the Unicode probe
# against Hugging Face's tokenizers (3,000 texts through six tokenizers, 3 minutes instrumented;
# the same code paths run on the fixtures' corpus in the other tests). Memory proofs run 30 steps
# (MOE_MEMORY_STEPS): the quarantine makes each step slower, the check per step is the same.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build-sanitize}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DMOE_SANITIZE=address,undefined \
  -DMOE_BUILD_BENCH=OFF > /dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
SUPP="$PWD/tests/sanitizers"
# OpenMPI and its plugins allocate once per process and never free (hwloc topology, MCA
# components); those are not ours and are suppressed by library name only. The instrumented
# executables keep the plugins loaded until exit (tests/sanitizers/keep_plugins_loaded.cpp), so
# those allocations' frames are named and ASan's fast unwinder suffices everywhere.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export MOE_MEMORY_STEPS=30
export GTEST_FILTER="-HfTokenizerReference.EveryUnicodeCodePointMatchesHuggingFace"
cd "$BUILD_DIR"
# shellcheck disable=SC2086
ctest --output-on-failure -j "$(nproc)" -E '_(avx2|scalar)$|^fault_kill9$' ${CTEST_ARGS:-}
