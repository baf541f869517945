#include "core/error.h"
#include "model/v4/v4_model.h"

namespace moe {

std::unique_ptr<InferenceCache> DeepSeekV4Model::make_cache(int64_t, int64_t) const {
  fail("cached inference over DeepSeek-V4 is not built yet");
}

Tensor DeepSeekV4Model::forward_cached(const Tensor&, std::span<const CachedChunk>, InferenceCache&,
                                       bool) {
  fail("cached inference over DeepSeek-V4 is not built yet");
}

}  // namespace moe
