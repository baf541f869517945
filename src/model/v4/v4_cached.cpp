// Cached inference over DeepSeek-V4 (model/v4/v4_cache.h): the generation engine's forward of
// new tokens of several sequences at once. Every part computes a row exactly as the training
// forward computes that row of a whole-sequence forward (the same GEMM chains, per-row norms,
// compressor pooling, indexer scores and attention softmax; see V4Attention::forward_cached), so
// the logits equal DeepSeekV4Model::logits over the whole sequence bit for bit, and a sequence's
// bits do not depend on what is batched with it.
//
// The MTP layer is skipped: it predicts the token after next for training (SPEC §6.8); greedy or
// sampled generation only needs the main head. (Speculative decoding with it would need its own
// cache layer.)
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "model/v4/v4_cache.h"
#include "model/v4/v4_model.h"

namespace moe {

namespace {

// One block over the chunks' new rows X [T, n, D]: the training forward's order of parts, with
// the compressor, indexer and attention reading and extending the layer's cache.
Tensor block_forward_cached(V4Block& block, const Tensor& X, const Tensor& tokens,
                            std::span<const CachedChunk> chunks, const V4LayerCache& cache) {
  const Pass pass = Pass::Inference;
  Tensor a;
  {
    const Tensor x = block.attn_norm.forward(block.hc_attn.pre(X, pass), pass);
    const Tensor qr = block.attn.query_residual(x, pass);
    Tensor picks;
    if (block.compressor) block.compressor->forward_cached(x, chunks, cache.compressor);
    if (block.indexer) picks = block.indexer->forward_cached(x, qr, chunks, cache.indexer);
    a = block.attn.forward_cached(x, qr, chunks, cache, picks);
  }
  Tensor X1 = block.hc_attn.post(a, X);
  a.reset();
  Tensor f;
  {
    const Tensor x = block.ffn_norm.forward(block.hc_ffn.pre(X1, pass), pass);
    f = block.ffn.forward(x, tokens, BatchShape{1, x.dim(0)}, pass, SaveInput::No);
  }
  return block.hc_ffn.post(f, X1);
}

}  // namespace

std::unique_ptr<InferenceCache> DeepSeekV4Model::make_cache(int64_t slots, int64_t max_len) const {
  return std::make_unique<V4KvCache>(cfg_, slots, max_len);
}

Tensor DeepSeekV4Model::forward_cached(const Tensor& tokens, std::span<const CachedChunk> chunks,
                                       InferenceCache& cache, bool all_rows) {
  auto* v4 = dynamic_cast<V4KvCache*>(&cache);
  MOE_CHECK(v4 != nullptr, "cached forward: the cache was not made by a {} model",
            cfg_.model_type);
  MOE_CHECK(v4->fits(cfg_), "cached forward: the cache was made for another deepseek_v4 "
            "configuration (layers, compress ratios, head_dim or sliding_window differ)");
  MOE_CHECK(tokens.dtype() == DType::I32 && tokens.ndim() == 1,
            "cached forward: expected I32 tokens [T], got {}", shape_str(tokens.shape()));
  const int64_t T = tokens.dim(0);
  (void)chunk_first_rows(chunks, T, "cached forward");
  std::vector<bool> seen(static_cast<size_t>(cache.slots()), false);
  for (const CachedChunk& c : chunks) {
    MOE_CHECK(c.slot >= 0 && c.slot < cache.slots(),
              "cached forward: slot {} is outside the cache's {} slots", c.slot, cache.slots());
    MOE_CHECK(c.count >= 0 && c.past >= 0 && c.past + c.count <= cache.max_len(),
              "cached forward: chunk at {} + {} tokens exceeds the cache's {} positions", c.past,
              c.count, cache.max_len());
    if (c.count == 0) continue;
    // Two chunks of one slot would read and write the same rings within one forward.
    MOE_CHECK(!seen[static_cast<size_t>(c.slot)],
              "cached forward: slot {} has two chunks in one forward (expected one per sequence)",
              c.slot);
    seen[static_cast<size_t>(c.slot)] = true;
  }
  lora_runtime_->dropout_active = false;
  const Pass pass = Pass::Inference;
  Tensor X = expand_streams(embed_.forward(tokens, pass), cfg_.hc_mult);
  const std::vector<V4LayerCache>& layers = v4->layers();
  for (size_t l = 0; l < blocks_.size(); ++l)
    X = block_forward_cached(*blocks_[l], X, tokens, chunks, layers[l]);
  // Only the rows that predict a next token go through the head.
  if (!all_rows) X = last_rows_of_chunks(X, chunks);
  return head_.logits(norm_.forward(hc_head_.forward(X, pass), pass));
}

}  // namespace moe
