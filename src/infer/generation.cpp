#include "infer/generation.h"

#include <algorithm>

#include "core/error.h"

namespace moe {

namespace {

// The one integer rank 0 sends before each forward (an all-reduce in which the others add 0).
constexpr int64_t kRunForward = 1;
constexpr int64_t kStopServing = -1;

}  // namespace

int64_t default_context(const ModelConfig& cfg) {
  return std::min<int64_t>(cfg.max_position_embeddings, 4096);
}

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
  }
  return "?";
}

struct GenerationEngine::Sequence {
  int64_t id = 0;
  GenerationRequest request;
  UpdateSink sink;
  std::vector<int32_t> tokens;  // prompt, then every sampled token
  int64_t cached = 0;           // tokens already in the KV cache
  int64_t slot = -1;
  int64_t generated = 0;
  Rng rng;
  TextStream text;
  bool cancelled = false;

  int64_t prompt_tokens() const { return static_cast<int64_t>(request.prompt.size()); }
};

GenerationEngine::GenerationEngine(CausalLM& model, const Tokenizer& tokenizer,
                                   EngineOptions options, std::shared_ptr<Communicator> ep_group)
    : model_(model),
      tokenizer_(tokenizer),
      options_([&] {
        EngineOptions o = options;
        const int64_t model_context = model.config().max_position_embeddings;
        if (o.context <= 0) o.context = default_context(model.config());
        MOE_CHECK(o.context <= model_context,
                  "context {} exceeds the model's max_position_embeddings {}", o.context,
                  model_context);
        MOE_CHECK(o.max_sequences >= 1, "max sequences must be >= 1, got {}", o.max_sequences);
        MOE_CHECK(o.prefill_chunk >= 1, "prefill chunk must be >= 1, got {}", o.prefill_chunk);
        // A full prompt chunk always fits beside every other sequence's decode token, so
        // prompts are never starved by decoding.
        MOE_CHECK(o.max_step_tokens >= o.prefill_chunk + o.max_sequences - 1,
                  "tokens per step ({}) must be at least the prefill chunk ({}) + the sequences "
                  "({}) - 1",
                  o.max_step_tokens, o.prefill_chunk, o.max_sequences);
        MOE_CHECK(o.max_queued >= 0, "max queued must be >= 0, got {}", o.max_queued);
        return o;
      }()),
      ep_group_(std::move(ep_group)),
      cache_(model.make_cache(options_.max_sequences, options_.context)) {
  model_.reserve_positions(options_.context);
}

GenerationEngine::~GenerationEngine() { shutdown(); }

int64_t GenerationEngine::submit(GenerationRequest request, UpdateSink sink) {
  const int64_t n = static_cast<int64_t>(request.prompt.size());
  MOE_CHECK(n >= 1, "a generation request needs at least one prompt token");
  MOE_CHECK(n < options_.context,
            "the prompt has {} tokens, which leaves no room in the context of {} tokens", n,
            options_.context);
  MOE_CHECK(request.max_tokens >= 1, "max_tokens must be >= 1, got {}", request.max_tokens);
  request.sampling.validate("sampling");
  for (int32_t id : request.prompt)
    MOE_CHECK(id >= 0 && id < model_.config().vocab_size,
              "prompt token id {} is outside the model's vocabulary [0, {})", id,
              model_.config().vocab_size);
  auto s = std::make_unique<Sequence>();
  s->tokens = request.prompt;
  s->rng = Rng(request.seed);
  s->text = TextStream(request.stop);
  s->request = std::move(request);
  s->sink = std::move(sink);
  std::lock_guard lock(mutex_);
  if (static_cast<int64_t>(incoming_.size() + waiting_.size()) >= options_.max_queued +
                                                                     cache_->free_slots())
    return -1;
  s->id = next_id_++;
  const int64_t id = s->id;
  incoming_.push_back(std::move(s));
  wake_.notify_all();
  return id;
}

void GenerationEngine::cancel(int64_t id) {
  std::lock_guard lock(mutex_);
  cancels_.push_back(id);
  wake_.notify_all();
}

void GenerationEngine::wait_for_work(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  wake_.wait_for(lock, timeout, [&] { return !incoming_.empty() || !cancels_.empty(); });
}

bool GenerationEngine::idle() const {
  std::lock_guard lock(mutex_);
  return incoming_.empty() && waiting_.empty() && active_.empty();
}

int64_t GenerationEngine::active() const {
  std::lock_guard lock(mutex_);
  return static_cast<int64_t>(active_.size());
}

int64_t GenerationEngine::queued() const {
  std::lock_guard lock(mutex_);
  return static_cast<int64_t>(incoming_.size() + waiting_.size());
}

EngineStats GenerationEngine::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void GenerationEngine::drain_incoming() {
  std::vector<int64_t> cancels;
  {
    std::lock_guard lock(mutex_);
    // Left by a step that a throwing sink interrupted.
    std::erase_if(active_, [](const auto& s) { return s == nullptr; });
    std::erase_if(waiting_, [](const auto& s) { return s == nullptr; });
    while (!incoming_.empty()) {
      waiting_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
    cancels.swap(cancels_);
  }
  for (int64_t id : cancels) {
    for (auto& s : active_)
      if (s->id == id) s->cancelled = true;
    for (auto& s : waiting_)
      if (s->id == id) s->cancelled = true;
  }
  // Cancelled sequences end before the forward: their slots go to waiting requests at once.
  for (auto& s : active_)
    if (s->cancelled) finish(*s, FinishReason::Cancelled, "");
  for (auto& s : waiting_)
    if (s->cancelled) finish(*s, FinishReason::Cancelled, "");
  std::lock_guard lock(mutex_);
  std::erase_if(active_, [](const auto& s) { return s == nullptr; });
  std::erase_if(waiting_, [](const auto& s) { return s == nullptr; });
  while (!waiting_.empty() && cache_->free_slots() > 0) {
    waiting_.front()->slot = cache_->acquire();
    active_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

void GenerationEngine::finish(Sequence& s, FinishReason reason, std::string text) {
  if (reason != FinishReason::Cancelled && !s.text.stopped()) text += s.text.finish();
  GenerationUpdate u;
  u.request = s.id;
  u.text = std::move(text);
  u.finished = true;
  u.reason = reason;
  u.prompt_tokens = s.prompt_tokens();
  u.completion_tokens = s.generated;
  u.completion_ids.assign(s.tokens.begin() + s.prompt_tokens(), s.tokens.end());
  const UpdateSink sink = std::move(s.sink);
  {
    // submit() reads the free slots under the lock.
    std::lock_guard lock(mutex_);
    if (s.slot >= 0) cache_->release(s.slot);
    ++stats_.requests_finished;
  }
  s.slot = -1;
  // The owner drops the sequence: find it in whichever list holds it.
  const int64_t id = s.id;
  for (auto& p : active_)
    if (p && p->id == id) p.reset();
  for (auto& p : waiting_)
    if (p && p->id == id) p.reset();
  if (sink) sink(u);
}

bool GenerationEngine::step() {
  drain_incoming();
  if (active_.empty()) return false;

  // Decode tokens first (one row each), then prompt chunks in arrival order while rows remain.
  // A prompt chunk is never cut to fit: its boundaries stay at multiples of prefill_chunk.
  std::vector<Sequence*> order;
  for (auto& s : active_)
    if (static_cast<int64_t>(s->tokens.size()) - s->cached == 1) order.push_back(s.get());
  for (auto& s : active_)
    if (static_cast<int64_t>(s->tokens.size()) - s->cached > 1) order.push_back(s.get());
  std::vector<CachedChunk> chunks;
  std::vector<Sequence*> members;
  std::vector<int32_t> ids;
  int64_t rows = 0, prompt_rows = 0;
  for (Sequence* s : order) {
    const int64_t pending = static_cast<int64_t>(s->tokens.size()) - s->cached;
    const int64_t count = std::min(pending, options_.prefill_chunk);
    if (rows + count > options_.max_step_tokens) continue;
    chunks.push_back({s->slot, s->cached, count});
    members.push_back(s);
    ids.insert(ids.end(), s->tokens.begin() + s->cached, s->tokens.begin() + s->cached + count);
    rows += count;
    if (s->cached < s->prompt_tokens()) prompt_rows += count;
  }
  Tensor input = Tensor::empty({rows}, DType::I32, MemCategory::Activations);
  std::copy(ids.begin(), ids.end(), input.i32());

  const auto t0 = std::chrono::steady_clock::now();
  if (ep_group_ && ep_group_->size() > 1) {
    int64_t signal = kRunForward;
    ep_group_->all_reduce_sum(&signal, 1);
  }
  in_forward_ = true;
  const Tensor logits = model_.forward_cached(input, chunks, *cache_);
  in_forward_ = false;
  input.reset();

  const int64_t V = model_.config().vocab_size;
  const int64_t allowed = tokenizer_.vocab_size();
  int64_t sampled = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    Sequence& s = *members[i];
    s.cached += chunks[i].count;
    if (s.cached < static_cast<int64_t>(s.tokens.size())) continue;  // more prompt to go
    const int32_t next = sample_token(logits.f32() + static_cast<int64_t>(i) * V, allowed,
                                      s.request.sampling, s.rng, s.tokens,
                                      static_cast<size_t>(s.prompt_tokens()));
    ++s.generated;
    ++sampled;
    const std::vector<int32_t>& stop_ids = s.request.stop_ids;
    if (std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end()) {
      finish(s, FinishReason::Stop, "");
      continue;
    }
    s.tokens.push_back(next);
    std::string text = s.text.push(tokenizer_.token_bytes(next));
    if (s.text.stopped()) {
      finish(s, FinishReason::Stop, std::move(text));
    } else if (s.generated >= s.request.max_tokens ||
               static_cast<int64_t>(s.tokens.size()) >= options_.context) {
      finish(s, FinishReason::Length, std::move(text));
    } else if (!text.empty() && s.sink) {
      GenerationUpdate u;
      u.request = s.id;
      u.text = std::move(text);
      u.prompt_tokens = s.prompt_tokens();
      u.completion_tokens = s.generated;
      s.sink(u);
    }
  }
  {
    std::lock_guard lock(mutex_);
    std::erase_if(active_, [](const auto& s) { return s == nullptr; });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double prompt_share = static_cast<double>(prompt_rows) / static_cast<double>(rows);
    stats_.prompt_seconds += seconds * prompt_share;
    stats_.generate_seconds += seconds * (1.0 - prompt_share);
    stats_.prompt_tokens += prompt_rows;
    stats_.generated_tokens += sampled;
    ++stats_.steps;
  }
  return true;
}

void GenerationEngine::run_until_idle() {
  while (!idle()) step();
}

void GenerationEngine::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (ep_group_ && ep_group_->size() > 1) {
    // A forward that threw left the other ranks inside one of its collectives, where the stop
    // signal would never match: end the job instead of hanging every rank.
    if (in_forward_) ep_group_->abort(1);
    int64_t signal = kStopServing;
    ep_group_->all_reduce_sum(&signal, 1);
  }
}

void serve_experts(CausalLM& model, Communicator& ep_group,
                   const std::function<void(int64_t)>& after_forward) {
  // A one-position cache: this rank never holds a sequence, but the forward wants every layer.
  const std::unique_ptr<InferenceCache> cache = model.make_cache(1, 1);
  const Tensor none = Tensor::empty({0}, DType::I32, MemCategory::Activations);
  for (int64_t n = 1;; ++n) {
    int64_t signal = 0;
    ep_group.all_reduce_sum(&signal, 1);
    if (signal == kStopServing) return;
    MOE_CHECK(signal == kRunForward, "expert-parallel serving: unexpected signal {} from rank 0",
              signal);
    (void)model.forward_cached(none, {}, *cache);
    if (after_forward) after_forward(n);
  }
}

}  // namespace moe
