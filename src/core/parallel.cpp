#include "core/parallel.h"

#include <cblas.h>
#include <omp.h>

namespace moe {

void set_num_threads(int n) {
  if (n < 1) n = 1;
  // OpenBLAS's own threading changes rounding with the thread count, so it always runs
  // single-threaded and the engine parallelises over shape-only tiles. The OpenMP build of
  // OpenBLAS resets OpenMP's thread count in this call, hence the order.
  openblas_set_num_threads(1);
  omp_set_num_threads(n);
}


int num_threads() { return omp_get_max_threads(); }

}  // namespace moe
