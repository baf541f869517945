#include "core/parallel.h"

#include <omp.h>

namespace moe {

void set_num_threads(int n) { omp_set_num_threads(n < 1 ? 1 : n); }

int num_threads() { return omp_get_max_threads(); }

}  // namespace moe
