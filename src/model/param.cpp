#include "model/param.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/mxfp4.h"

namespace moe {

void quantize_rows_into(const Param& data, const Param& scales,
                        const std::function<void(int64_t row, float* values)>& row) {
  MOE_CHECK(data.format == ParamFormat::Mxfp4Data && scales.format == ParamFormat::Mxfp4Scales &&
                data.value.ndim() == 2 && scales.value.ndim() == 2 &&
                data.value.dim(0) == scales.value.dim(0) &&
                data.value.dim(1) * 2 == scales.value.dim(1) * mxfp4::kBlock,
            "internal: '{}' and '{}' are not one MXFP4 pair", data.name, scales.name);
  const int64_t rows = data.value.dim(0), cols = data.value.dim(1) * 2;
  std::vector<float> values(static_cast<size_t>(cols));  // one row: this routine's whole scratch
  for (int64_t r = 0; r < rows; ++r) {
    row(r, values.data());
    mxfp4::quantize_row(values.data(), cols, data.value.u8() + r * (cols / 2),
                        scales.value.u8() + r * (cols / mxfp4::kBlock));
  }
}

const Param& mxfp4_scales_after(const ParamList& params, size_t data_index) {
  const Param* data = params[data_index];
  MOE_CHECK(data_index + 1 < params.size() &&
                params[data_index + 1]->format == ParamFormat::Mxfp4Scales,
            "internal: MXFP4 weight '{}' is not followed by its scales", data->name);
  return *params[data_index + 1];
}

std::vector<GradPiece> gradient_pieces(const ParamList& params, int64_t chunk) {
  std::vector<GradPiece> pieces;
  for (const Param* p : params) {
    if (!p->grad.defined()) continue;
    float* g = p->g();
    const int64_t n = p->grad.numel();
    for (int64_t i = 0; i < n; i += chunk) pieces.push_back({g + i, std::min(chunk, n - i)});
  }
  return pieces;
}

void zero_grads(const ParamList& params) {
  constexpr int64_t kChunk = int64_t{1} << 18;  // floats per work item (1 MiB)
  const std::vector<GradPiece> pieces = gradient_pieces(params, kChunk);
  parallel_for(0, static_cast<int64_t>(pieces.size()), [&](int64_t i) {
    const GradPiece& q = pieces[static_cast<size_t>(i)];
    std::memset(q.at, 0, sizeof(float) * static_cast<size_t>(q.n));
  });
}

}  // namespace moe
