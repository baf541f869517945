#include "model/v4/simulated_precision.h"

#include "core/parallel.h"
#include "kernels/quant_sim.h"

namespace moe {

void simulate_precision(SimulatedPrecision kind, float* rows, int64_t n_rows, int64_t width,
                        int64_t rope_dim) {
  if (kind == SimulatedPrecision::None || n_rows == 0) return;
  parallel_for(0, n_rows, [&](int64_t r) {
    float* row = rows + r * width;
    if (kind == SimulatedPrecision::Fp8NonRope) {
      fp8_e4m3_quant_dequant(row, width - rope_dim, kSimFp8Block);
    } else {
      hadamard_rotate(row, width);
      fp4_e2m1_quant_dequant(row, width, kSimFp4Block);
    }
  });
}

}  // namespace moe
