#pragma once
// Shared set-up for the MoE-layer tests (single process and expert parallel).
#include <cmath>

#include "moe/moe_layer.h"
#include "test_util.h"

namespace moe::testing {

// Random parameters: gate rows scaled so the routing is far from uniform, bias small but
// large enough to change some selections.
inline void randomize_moe(MoELayer& m, Rng& rng) {
  ParamList ps;
  m.collect(ps);
  for (Param* p : ps) {
    const int64_t in = p->value.dim(-1);
    float s = 1.0f / std::sqrt(static_cast<float>(in));
    if (p == &m.gate_weight) s = 2.0f / std::sqrt(static_cast<float>(in));
    if (p == &m.gate_bias) s = 0.05f;
    fill_random(p->value, rng, s);
  }
}

}  // namespace moe::testing
