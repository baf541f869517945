#include "core/parallel.h"

#include <cblas.h>
#include <omp.h>

#include <cstdlib>
#include <cstring>

// Exported by DYNAMIC_ARCH builds of OpenBLAS only; weak so other builds still link.
extern "C" {
__attribute__((weak)) void gotoblas_dynamic_init(void);
__attribute__((weak)) void gotoblas_dynamic_quit(void);
char* openblas_get_corename(void);
}

namespace moe {

namespace {

// OpenBLAS 0.3.21 (Debian 12) does not know recent Xeons (e.g. family 6 model 207) and falls
// back to its SSE3 "Prescott" kernels, ~5x slower than its AVX-512 ones on the same CPU. When
// the user has not chosen a core type, pick the best one the CPU supports before the first
// BLAS call (nothing is allocated by OpenBLAS until then).
void select_blas_kernels() {
  if (std::getenv("OPENBLAS_CORETYPE") || !gotoblas_dynamic_init || !gotoblas_dynamic_quit) return;
  const char* current = openblas_get_corename();
  const bool fallback = current && (std::strcmp(current, "Prescott") == 0 ||
                                    std::strcmp(current, "Core2") == 0 ||
                                    std::strcmp(current, "Nehalem") == 0);
  if (!fallback) return;
  __builtin_cpu_init();
  const char* best = nullptr;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    best = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    best = "Haswell";
  if (!best) return;
  setenv("OPENBLAS_CORETYPE", best, 1);
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
}

// At program start-up too, for code that calls cblas directly before any wrapper (OpenBLAS is
// a shared library, so its own constructor has already run).
const bool kKernelsAtStartup = (select_blas_kernels(), true);

}  // namespace

void set_num_threads(int n) {
  static const bool kernels_selected = (select_blas_kernels(), true);
  (void)kernels_selected;
  if (n < 1) n = 1;
  // OpenBLAS's own threading changes rounding with the thread count, so the engine only ever
  // calls it from inside its own parallel regions (where the OpenMP build runs it on one
  // thread) and parallelises over shape-only tiles itself.
  openblas_set_num_threads(1);
  omp_set_num_threads(n);
}

int num_threads() { return omp_get_max_threads(); }

const char* blas_kernel_name() { return openblas_get_corename(); }

}  // namespace moe
