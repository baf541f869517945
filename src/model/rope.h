#pragma once
// Rotary position embedding of MLA's rope dims, with DeepSeek's YaRN context extension.
// Pairs are adjacent (2i, 2i+1), as in the reference implementation's complex view; HF's
// de-interleave + rotate-half gives the same attention scores on the same weights.
// Positions are passed per row so training (position = index in sequence) and a KV-cache
// decode (position = cache offset + index) share one table and one kernel.
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace moe {

// HF's yarn_get_mscale: 1 for factor <= 1, else 0.1 * mscale * ln(factor) + 1.
double yarn_mscale(double factor, double mscale);

// Softmax scale of MLA: (nope + rope)^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 when
// YaRN is on and mscale_all_dim != 0 (the temperature YaRN needs at long context).
double mla_softmax_scale(const ModelConfig& cfg);

class RopeTable {
 public:
  RopeTable() = default;
  // dim = qk_rope_head_dim (even); the cos/sin rows exist for positions [0, max_len).
  RopeTable(const ModelConfig& cfg, int64_t max_len);

  // Grows the table to at least `len` positions. Entries are computed independently per
  // position, so the values never depend on the growth history.
  void ensure(int64_t len);

  int64_t dim() const { return dim_; }
  int64_t max_len() const { return max_len_; }
  // Per-pair inverse frequencies (after YaRN blending) and the cos/sin multiplier m.
  const std::vector<double>& inv_freq() const { return inv_freq_; }
  double mscale() const { return mscale_; }
  // [max_len, dim/2] tables of m*cos(pos*inv_freq[i]) and m*sin(pos*inv_freq[i]).
  const float* cos_row(int64_t pos) const { return cos_.f32() + pos * (dim_ / 2); }
  const float* sin_row(int64_t pos) const { return sin_.f32() + pos * (dim_ / 2); }

 private:
  int64_t dim_ = 0;
  int64_t max_len_ = 0;
  double mscale_ = 1.0;
  std::vector<double> inv_freq_;
  Tensor cos_, sin_;  // MemCategory::Weights: a constant model buffer, not an activation
};

// In place on `rows` rows of `heads` vectors each: the rope dims of head h of row r start at
// x + r * row_stride + h * head_stride (so q_pe can be rotated inside the packed q rows).
// positions[r] must lie in [0, table.max_len()).
void rope_forward(const RopeTable& table, float* x, int64_t rows, int64_t heads,
                  int64_t row_stride, int64_t head_stride, const int32_t* positions);
// The transpose rotation: maps the gradient of the rotated vectors to that of the inputs.
void rope_backward(const RopeTable& table, float* dx, int64_t rows, int64_t heads,
                   int64_t row_stride, int64_t head_stride, const int32_t* positions);

// Positions of sequence-major rows (row = b * seq + s has position offset + s): I32 [batch*seq].
Tensor sequence_positions(int64_t batch, int64_t seq, int64_t offset = 0);

}  // namespace moe
