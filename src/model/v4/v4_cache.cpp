#include "model/v4/v4_cache.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

namespace {

constexpr int64_t kFloat = static_cast<int64_t>(sizeof(float));

// The rows of one compressor's entries and state ring per slot, and their width.
struct CompressorLayout {
  int64_t head_dim = 0, features = 0, max_entries = 0, state_rows = 0;
  int64_t floats_per_slot() const { return max_entries * head_dim + 2 * state_rows * features; }
};

// The same overlap rule as V4Compressor: ratio 4 pools two windows' tokens, two halves each.
CompressorLayout compressor_layout(int64_t head_dim, int64_t ratio, int64_t max_len) {
  const int64_t coff = ratio == 4 ? 2 : 1;
  return {head_dim, coff * head_dim, max_len / ratio, std::min(coff * ratio, max_len)};
}

int64_t floats_per_slot(const ModelConfig& cfg, int64_t layer, int64_t max_len) {
  const int64_t ratio = cfg.compress_ratio(layer);
  int64_t n = std::min(cfg.sliding_window, max_len) * cfg.head_dim;
  if (ratio > 0) n += compressor_layout(cfg.head_dim, ratio, max_len).floats_per_slot();
  if (ratio == 4) n += compressor_layout(cfg.index_head_dim, ratio, max_len).floats_per_slot();
  return n;
}

}  // namespace

int64_t V4KvCache::bytes_for(const ModelConfig& cfg, int64_t slots, int64_t max_len) {
  int64_t floats = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) floats += floats_per_slot(cfg, l, max_len);
  return slots * floats * kFloat;
}

double V4KvCache::entry_bytes_per_token(const ModelConfig& cfg) {
  double bytes = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const int64_t r = cfg.compress_ratio(l);
    if (r > 0) bytes += static_cast<double>(cfg.head_dim * kFloat) / static_cast<double>(r);
    if (r == 4) bytes += static_cast<double>(cfg.index_head_dim * kFloat) / 4.0;
  }
  return bytes;
}

int64_t V4KvCache::ring_bytes_per_sequence(const ModelConfig& cfg) {
  int64_t floats = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const int64_t r = cfg.compress_ratio(l);
    floats += cfg.sliding_window * cfg.head_dim;
    // A length of 2·ratio is long enough for the full state ring (ratio or 2·ratio rows).
    auto ring = [&](int64_t head_dim) {
      const CompressorLayout c = compressor_layout(head_dim, r, 2 * r);
      return 2 * c.state_rows * c.features;
    };
    if (r > 0) floats += ring(cfg.head_dim);
    if (r == 4) floats += ring(cfg.index_head_dim);
  }
  return floats * kFloat;
}

V4KvCache::V4KvCache(const ModelConfig& cfg, int64_t slots, int64_t max_len)
    : InferenceCache(slots, max_len),
      head_dim_(cfg.head_dim),
      index_head_dim_(cfg.index_head_dim),
      window_(cfg.sliding_window) {
  MOE_CHECK(cfg.is_v4(), "V4 KV cache: needs a deepseek_v4 config, got model_type \"{}\"",
            cfg.model_type);
  // Refuse sizes whose byte count would overflow before asking the allocator for them.
  int64_t per_slot = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const int64_t f = floats_per_slot(cfg, l, max_len);
    MOE_CHECK(f <= (int64_t{1} << 40) / kFloat / slots - per_slot,
              "V4 KV cache: {} sequences x {} tokens is too large", slots, max_len);
    per_slot += f;
  }
  // Zeroed, so every page is resident from the start: the cache's memory is taken when the
  // engine starts, not page by page as sequences grow (which would look like a leak in RSS).
  auto buffer = [&](int64_t rows, int64_t width) {
    buffers_.push_back(Tensor::zeros({slots, rows, width}, DType::F32, MemCategory::KvCache));
    return buffers_.back().f32();
  };
  auto compressor = [&](int64_t head_dim, int64_t ratio) {
    const CompressorLayout c = compressor_layout(head_dim, ratio, max_len);
    V4CompressorCache v;
    v.max_entries = c.max_entries;
    v.state_rows = c.state_rows;
    v.entries = buffer(c.max_entries, c.head_dim);
    v.kv_state = buffer(c.state_rows, c.features);
    v.gate_state = buffer(c.state_rows, c.features);
    return v;
  };
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    V4LayerCache layer;
    layer.ratio = cfg.compress_ratio(l);
    layer.window_rows = std::min(cfg.sliding_window, max_len);
    layer.window = buffer(layer.window_rows, cfg.head_dim);
    if (layer.ratio > 0) layer.compressor = compressor(cfg.head_dim, layer.ratio);
    if (layer.ratio == 4) layer.indexer = compressor(cfg.index_head_dim, layer.ratio);
    layers_.push_back(layer);
  }
}

int64_t V4KvCache::bytes() const {
  int64_t b = 0;
  for (const Tensor& t : buffers_) b += t.nbytes();
  return b;
}

bool V4KvCache::fits(const ModelConfig& cfg) const {
  if (!cfg.is_v4() || cfg.num_hidden_layers != static_cast<int64_t>(layers_.size()) ||
      cfg.head_dim != head_dim_ || cfg.sliding_window != window_)
    return false;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const int64_t r = cfg.compress_ratio(l);
    if (r != layers_[static_cast<size_t>(l)].ratio) return false;
    if (r == 4 && cfg.index_head_dim != index_head_dim_) return false;
  }
  return true;
}

std::vector<int64_t> chunk_first_rows(std::span<const CachedChunk> chunks, int64_t rows,
                                      const std::string& who) {
  std::vector<int64_t> first;
  first.reserve(chunks.size());
  int64_t row = 0;
  for (const CachedChunk& c : chunks) {
    first.push_back(row);
    row += c.count;
  }
  MOE_CHECK(row == rows, "{}: the chunks hold {} tokens but the input has {} rows", who, row,
            rows);
  return first;
}

}  // namespace moe
