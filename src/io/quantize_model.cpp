#include "io/quantize_model.h"

#include "core/error.h"
#include "io/convert_model.h"
#include "io/hf_config.h"
#include "model/config.h"

namespace moe {

QuantizeReport quantize_model_experts(const std::filesystem::path& in,
                                      const std::filesystem::path& out,
                                      const std::function<void(const QuantizeLayerStats&)>& on_layer) {
  const ModelConfig cfg = read_hf_config(in);
  MOE_CHECK(!cfg.mxfp4_experts(), "{}: the routed experts are already MXFP4 (config.json "
            "quantization_config, or DeepSeek-V4's expert_dtype \"fp4\")", in.string());
  MOE_CHECK(cfg.n_routed_experts > 0, "{}: the model has no routed experts to quantize",
            in.string());
  ConvertOptions opt;
  opt.dtype = "keep";
  opt.experts = "mxfp4";
  opt.max_shard_bytes = 0;  // the input's files, same names
  return convert_model(in, out, opt, on_layer);
}

}  // namespace moe
