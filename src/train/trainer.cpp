#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "core/memory.h"
#include "core/parallel.h"
#include "data/bpe.h"
#include "data/chat_template.h"
#include "data/corpus.h"
#include "data/documents.h"
#include "data/finetune_data.h"
#include "data/sampler.h"
#include "data/tokenizer.h"
#include "parallel/collective_watchdog.h"
#include "parallel/communicator.h"
#include "parallel/ep_training.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "kernels/fma_peak.h"
#include "lora/peft_adapter.h"
#include "model/model.h"
#include "moe/mxfp4_expert_weights.h"
#include "report/training_report.h"
#include "train/adamw.h"
#include "train/evaluation.h"
#include "train/interrupt.h"
#include "train/lr_schedule.h"
#include "train/metrics_log.h"
#include "train/progress.h"

namespace moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string describe_loss(double loss) {
  return std::isfinite(loss) ? fmt::format("{:.4f}, perplexity {:.2f}", loss, std::exp(loss))
                             : std::string("n/a");
}

// "byte" or a tokenizer.json path. A fine-tune reads text the way its base model was trained:
// its tokenizer.json, if any.
std::string configured_tokenizer_spec(const TrainConfig& cfg) {
  std::string spec = cfg.data.tokenizer;
  if (spec.empty()) {
    const fs::path base_tokenizer = fs::path(cfg.model.weights) / kTokenizerFile;
    spec = fs::is_regular_file(base_tokenizer) ? base_tokenizer.string() : ByteTokenizer::kKind;
  }
  MOE_CHECK(spec == ByteTokenizer::kKind || fs::is_regular_file(spec),
            "data.tokenizer: expected \"byte\" or the path of a tokenizer.json (see `moe tokenizer "
            "train`), got \"{}\": no such file", spec);
  return spec;
}

std::unique_ptr<Tokenizer> load_configured_tokenizer(const TrainConfig& cfg) {
  return load_tokenizer(configured_tokenizer_spec(cfg));
}

// What a checkpoint stores to reproduce the ids: moe's BPE in its canonical form, a Hugging
// Face tokenizer.json as it was given (its tokenizer_config.json travels beside it, see
// tokenizer_side_files).
std::string tokenizer_file_text(const Tokenizer& t, const TrainConfig& cfg) {
  if (const auto* bpe = dynamic_cast<const BpeTokenizer*>(&t)) return bpe->to_json();
  if (t.kind() == "hf") return read_whole_file(configured_tokenizer_spec(cfg));
  return std::string();
}

std::vector<std::pair<std::string, std::string>> tokenizer_side_files(const Tokenizer& t,
                                                                      const TrainConfig& cfg) {
  std::vector<std::pair<std::string, std::string>> out;
  if (t.kind() != "hf") return out;
  const fs::path config = fs::path(configured_tokenizer_spec(cfg)).parent_path() /
                          "tokenizer_config.json";
  if (fs::is_regular_file(config)) out.emplace_back("tokenizer_config.json", read_whole_file(config));
  return out;
}

// A fine-tune's base model's own chat template, if it ships one: chat data is rendered with it.
std::optional<ChatTemplate> configured_chat_template(const TrainConfig& cfg) {
  if (!cfg.finetune) return std::nullopt;
  return load_chat_template(fs::path(cfg.model.weights) / "tokenizer_config.json");
}

Corpus load_configured_corpus(const TrainConfig& cfg, const Tokenizer& tokenizer,
                              const std::optional<ChatTemplate>& chat_template) {
  for (const std::string& p : cfg.data.path)
    MOE_CHECK(fs::exists(p), "data.path: {}: no such file or directory", p);
  if (cfg.finetune) {
    FinetuneDataOptions fo;
    fo.paths = cfg.data.path;
    fo.format = cfg.data.format;
    fo.jsonl_field = cfg.data.jsonl_field;
    fo.seq_len = cfg.data.seq_len;
    fo.val_fraction = cfg.data.val_fraction;
    fo.tokenizer = &tokenizer;
    fo.chat_template = chat_template ? &*chat_template : nullptr;
    return load_finetune_corpus(fo);
  }
  CorpusOptions co;
  co.paths = cfg.data.path;
  co.documents.format = parse_data_format(cfg.data.format, "data.format");
  co.documents.jsonl_field = cfg.data.jsonl_field;
  co.val_fraction = cfg.data.val_fraction;
  co.seq_len = cfg.data.seq_len;
  co.tokenizer = &tokenizer;
  return load_corpus(co);
}

AdamWConfig adamw_config(const TrainConfig::Optimizer& o) {
  AdamWConfig c;
  c.lr = o.lr;
  c.beta1 = o.beta1;
  c.beta2 = o.beta2;
  c.eps = o.eps;
  c.weight_decay = o.weight_decay;
  return c;
}

// A resumed run must build exactly the model it saved; shapes alone would not catch e.g. a
// changed rope_theta or routing method.
void check_same_model(const fs::path& dir, const ModelConfig& configured) {
  json saved = model_config_to_json(read_hf_config(dir));
  json want = model_config_to_json(configured);
  saved.erase("torch_dtype");
  want.erase("torch_dtype");
  for (const auto& [key, value] : want.items())
    MOE_CHECK(saved.contains(key) && saved[key] == value,
              "{}: the checkpoint's model has {} = {}, the configuration asks for {}; resume with "
              "the run's own configuration", dir.string(), key,
              saved.contains(key) ? saved[key].dump() : "nothing", value.dump());
}

// Initial weights (random, or model.weights: each rank reads only the tensors it holds) and
// gradient buffers; returns the params AdamW updates. A resume takes its weights from the
// checkpoint, so model.weights (which may be gone by then) is not read.
ParamList prepare_for_training(CausalLM& model, const TrainConfig& cfg, bool resuming) {
  if (cfg.finetune) {
    // The base is always read (a resume's checkpoint holds only the adapters), then frozen.
    MOE_CHECK(fs::is_directory(cfg.model.weights),
              "model.weights: {}: not a model directory (config.json + safetensors)",
              cfg.model.weights);
    load_weights(cfg.model.weights, model.params());
    model.freeze_base();
    model.add_lora(lora_settings(cfg), static_cast<uint64_t>(cfg.run.seed), "lora");
    model.allocate_grads();
    return model.trainable_params();
  }
  model.init_weights(static_cast<uint64_t>(cfg.run.seed));
  if (!cfg.model.weights.empty() && !resuming) {
    MOE_CHECK(fs::is_directory(cfg.model.weights),
              "model.weights: {}: not a model directory (config.json + safetensors)",
              cfg.model.weights);
    load_weights(cfg.model.weights, model.params());
  }
  model.allocate_grads();
  return model.trainable_params();
}

ExpertParallelGroups make_groups(const TrainConfig& cfg, std::shared_ptr<Communicator> world,
                                 const ModelConfig& mc) {
  if (!world) world = std::make_shared<LocalCommunicator>();
  MOE_CHECK(cfg.data.batch_size % world->size() == 0,
            "data.batch_size = {}: must be divisible by the number of ranks ({}), each rank "
            "taking an equal part of every batch", cfg.data.batch_size, world->size());
  return make_expert_parallel_groups(std::move(world), cfg.parallel.ep, mc.n_routed_experts,
                                     "parallel.ep");
}

int64_t counted_targets(const Tensor& targets) {
  int64_t n = 0;
  const int32_t* t = targets.i32();
  for (int64_t i = 0; i < targets.numel(); ++i) n += t[i] != kIgnoreIndex;
  return n;
}

// What one optimizer step measured.
struct StepOutcome {
  double loss = 0, z_loss = 0, aux_loss = 0, grad_norm = 0, lr = 0, seconds = 0;
  bool finite = true;
  bool stop_requested = false;  // Ctrl-C / SIGTERM on any rank
  json expert_load;
};

class TrainingRun {
 public:
  explicit TrainingRun(const TrainRequest& req)
      : req_(req),
        cfg_(req.config),
        out_dir_(cfg_.run.out_dir),
        ckpt_dir_(out_dir_ / "checkpoints"),
        main_(!req.world || req.world->rank() == 0),
        progress_(main_ ? cfg_.logging.progress : "none", cfg_.logging.log_every),
        tokenizer_(load_configured_tokenizer(cfg_)),
        tokenizer_json_(tokenizer_file_text(*tokenizer_, cfg_)),
        tokenizer_side_files_(tokenizer_side_files(*tokenizer_, cfg_)),
        base_fingerprint_(cfg_.finetune ? base_model_fingerprint(cfg_.model.weights) : 0),
        base_reference_(cfg_.finetune ? base_model_reference(cfg_.model.weights, base_fingerprint_)
                                      : std::string()),
        chat_template_(configured_chat_template(cfg_)),
        corpus_(load_configured_corpus(cfg_, *tokenizer_, chat_template_)),
        mc_(resolve_train_model(cfg_, padded_vocab_size(tokenizer_->vocab_size()),
                                tokenizer_->end_of_text())),
        groups_(make_groups(cfg_, req.world, mc_)),
        model_(make_causal_lm(mc_, make_dispatcher(groups_))),
        trainable_(prepare_for_training(*model_, cfg_, req.resume_from.has_value())),
        opt_(trainable_, adamw_config(cfg_.optimizer)),
        sampler_(corpus_.train, static_cast<uint64_t>(cfg_.run.seed), cfg_.data.shuffle),
        schedule_{cfg_.optimizer.lr, cfg_.schedule.min_lr, cfg_.schedule.warmup_steps,
                  cfg_.schedule.steps, cfg_.schedule.decay == "cosine"},
        step_tokens_(cfg_.data.batch_size * cfg_.data.seq_len * cfg_.optimizer.grad_accum),
        flops_per_token_(cfg_.finetune ? finetune_flops_per_token(mc_, cfg_.data.seq_len,
                                                                  adapter_weights_per_token())
                                       : train_flops_per_token(mc_, cfg_.data.seq_len)) {
    st_.data_seed = static_cast<uint64_t>(cfg_.run.seed);
    st_.data_fingerprint = corpus_.fingerprint;
    st_.tokenizer = tokenizer_->kind();
    st_.config_toml = train_config_to_toml(cfg_);
    result_.unigram_entropy = corpus_.train_unigram_entropy;
    result_.final_val_loss = kNaN;
  }

  TrainResult run() {
    const auto start = Clock::now();
    describe_setup();
    measure_peak();
    if (req_.resume_from) restore(*req_.resume_from);
    std::optional<MetricsLog> metrics;
    if (main_) {
      fs::create_directories(out_dir_);
      // For reference next to the metrics: the configuration this process actually runs.
      write_file_atomic(out_dir_ / "config.toml", st_.config_toml);
      metrics.emplace(out_dir_ / "metrics.jsonl", st_.step, req_.resume_from.has_value());
    }
    result_.first_step = st_.step;
    MemoryTracker::instance().reset_peaks();

    bool checkpoint_due = false;
    const InterruptGuard interrupt;
    interrupt_ = &interrupt;
    // Armed only now: start-up and restore do uneven work per rank (rank 0 reads more), which
    // the others may legitimately wait for.
    const bool several_ranks = world().size() > 1;
    const CollectiveWatchdog watchdog(
        {several_ranks ? static_cast<double>(cfg_.parallel.collective_timeout) : 0.0,
         "parallel.collective_timeout"},
        {several_ranks ? static_cast<double>(cfg_.parallel.checkpoint_timeout) : 0.0,
         "parallel.checkpoint_timeout"},
        world().rank());
    while (st_.step < cfg_.schedule.steps) {
      const StepOutcome s = step();
      const bool last = st_.step == cfg_.schedule.steps;
      json record = step_record(s);
      if (corpus_.val.size() > 0 && (last || due(cfg_.logging.val_every))) {
        const auto t0 = Clock::now();
        validate();
        record["val_loss"] = result_.final_val_loss;
        record["val_ppl"] = std::exp(result_.final_val_loss);
        record["val_s"] = seconds_since(t0);
      }
      record["memory"] = memory_json();
      if (metrics) metrics->write(record);
      show_progress(s);
      checkpoint_due |= last || due(cfg_.checkpoint.every) || s.stop_requested;
      // Only a state right after a good update is saved: a non-finite step may stem from
      // corrupted weights, and the last good checkpoint must survive the streak.
      if (checkpoint_due && st_.nonfinite_streak > 0) {
        warn(fmt::format("step {}: checkpoint postponed until a step succeeds", st_.step));
      } else if (checkpoint_due) {
        checkpoint_due = false;
        checkpoint();
      }
      if (s.stop_requested) {
        result_.stopped_early = result_.interrupted = true;
        progress_.finish();
        warn(fmt::format("interrupted: stopped after step {}; continue with `moe train --resume "
                         "{}`", st_.step, out_dir_.string()));
        break;
      }
      if (req_.hooks.stop_after && req_.hooks.stop_after(st_.step)) {
        result_.stopped_early = true;
        break;
      }
    }
    interrupt_ = nullptr;
    progress_.finish();
    if (checkpoint_due)
      warn(fmt::format("the last step was non-finite, so no checkpoint was written "
                                    "for it; the last good one is {}", last_checkpoint_name()));
    // A resume of a finished run still reports where it stands.
    if (!result_.stopped_early && steps_this_run_ == 0 && corpus_.val.size() > 0) validate();
    finish_result(start);
    if (main_) {
      print_summary(metrics->path());
      write_report();
    }
    return result_;
  }

 private:
  void say(const std::string& line) {
    if (main_) progress_.message(line);
  }
  void warn(const std::string& line) {
    if (main_) progress_.warning(line);
  }
  Communicator& world() const { return *groups_.world; }
  bool due(int64_t every) const { return every > 0 && st_.step % every == 0; }

  // Which chat template renders chat data: the base model's own (tokenizer_config.json), whose
  // special-token markers only become the model's ids with the model's tokenizer.
  void warn_about_chat_template() {
    if (!chat_template_) return;
    const fs::path file = fs::path(cfg_.model.weights) / "tokenizer_config.json";
    say(fmt::format("chat data: rendered with the base model's chat template ({})", file.string()));
    if (tokenizer_->kind() != "hf")
      warn(fmt::format("{} has a chat template, but the tokenizer in use ({}) is not the model's "
                       "tokenizer.json: its special-token markers are encoded as plain text",
                       file.string(), tokenizer_->kind()));
  }

  // Adapter weights one token passes through: every dense adapter, and top-k of E experts'
  // (this rank holds E / ep of them).
  double adapter_weights_per_token() const {
    double n = 0;
    const double expert_share = static_cast<double>(mc_.num_experts_per_tok * groups_.ep_size) /
                                static_cast<double>(std::max<int64_t>(1, mc_.n_routed_experts));
    for (Param* p : model_->lora_params())
      n += static_cast<double>(p->value.numel()) *
           (is_routed_expert_param(p->name) ? expert_share : 1.0);
    return n;
  }

  std::string last_checkpoint_name() const {
    const auto last = latest_checkpoint(ckpt_dir_);
    return last ? last->string() : std::string("(none written yet)");
  }

  void describe_setup() {
    warn_about_chat_template();
    const ParamCounts pc = count_params(mc_);
    say(fmt::format(
        "model: {} parameters ({} active per token), {} layers, {} routed experts, vocab {}",
        format_count(static_cast<double>(pc.total)),
        format_count(static_cast<double>(pc.active_per_token)), mc_.num_hidden_layers,
        mc_.n_routed_experts, mc_.vocab_size));
    if (cfg_.finetune) {
      // Rows are padded examples: what counts is the tokens that carry a loss.
      const double train_tokens = static_cast<double>(corpus_.train.size() * cfg_.data.seq_len);
      const double counted = static_cast<double>(corpus_.train.counted_targets());
      say(fmt::format(
          "data: {} example{}, {} tokens ({} tokenizer, {} ids): {} training rows of {} tokens "
          "({} with a loss, {:.0f}% of the row positions), {} validation rows ({} tokens with a "
          "loss); unigram entropy of the targets {:.4f} nats",
          corpus_.documents, corpus_.documents == 1 ? "" : "s",
          format_count(static_cast<double>(corpus_.total_tokens)), tokenizer_->kind(),
          tokenizer_->vocab_size(), corpus_.train.size(), cfg_.data.seq_len,
          format_count(counted), 100.0 * counted / std::max(1.0, train_tokens),
          corpus_.val.size(), format_count(static_cast<double>(corpus_.val.counted_targets())),
          corpus_.train_unigram_entropy));
    } else {
      say(fmt::format(
          "data: {} document{}, {} tokens ({} tokenizer, {} ids): {} training sequences of {} "
          "tokens, {} validation tokens; unigram entropy {:.4f} nats",
          corpus_.documents, corpus_.documents == 1 ? "" : "s",
          format_count(static_cast<double>(corpus_.total_tokens)), tokenizer_->kind(),
          tokenizer_->vocab_size(), corpus_.train.size(), cfg_.data.seq_len,
          format_count(static_cast<double>(corpus_.val.tokens().size())),
          corpus_.train_unigram_entropy));
    }
    if (cfg_.finetune) {
      int64_t n = 0;
      for (Param* p : model_->lora_params()) n += p->value.numel();
      const LoraSettings ls = lora_settings(cfg_);
      say(fmt::format("LoRA: {} adapter matrices, {} parameters (r {}, alpha {}{}{}); base model "
                      "{} frozen{}", model_->lora_params().size(),
                      format_count(static_cast<double>(n)), ls.r, ls.alpha,
                      ls.rslora ? ", rsLoRA" : "",
                      ls.expert_r > 0 ? fmt::format(", routed experts r {}", ls.expert_r) : "",
                      cfg_.model.weights,
                      mc_.mxfp4_experts() ? fmt::format(", routed experts MXFP4: {}",
                                                        describe_packed_experts())
                                          : ""));
    } else if (mc_.mxfp4_experts()) {
      say(fmt::format("routed experts: MXFP4, frozen: {}, decoded inside the expert matmuls; "
                      "everything else trains", describe_packed_experts()));
    }
    const int w = world().size(), e = groups_.ep_size;
    if (w > 1)
      say(fmt::format("parallel: {} ranks, expert-parallel size {}: {} of {} routed experts per "
                      "rank, {} cop{} of each; {} of the {} sequences of every batch per rank",
                      w, e, mc_.n_routed_experts / e, mc_.n_routed_experts, w / e,
                      w / e == 1 ? "y" : "ies", cfg_.data.batch_size / w, cfg_.data.batch_size));
  }

  // The MFU denominator: the fp32 FMA peak of this machine's cores for the SIMD target in use,
  // at this run's thread count (measured once per machine and cached). With several ranks each
  // has its own cores' peak and the peaks add up.
  void measure_peak() {
    peak_ = fma_peak(num_threads());
    peak_gflops_ = peak_.gflops;
    world().all_reduce_sum(&peak_gflops_, 1);
    const int w = world().size();
    say(fmt::format("MFU is against the {}{}", describe(peak_),
                    w > 1 ? fmt::format(" per rank; {:.0f} GFLOP/s for the {} ranks", peak_gflops_, w)
                          : std::string()));
  }

  double mfu(double tokens_per_s) const {
    return peak_gflops_ > 0 ? tokens_per_s * flops_per_token_ / (peak_gflops_ * 1e9) : 0.0;
  }

  // The report is a by-product: failing to draw it must not fail a run whose checkpoint is safe.
  void write_report() {
    if (steps_this_run_ == 0 && !fs::exists(out_dir_ / "metrics.jsonl")) return;
    try {
      const ReportFiles f = write_training_report(out_dir_);
      say(fmt::format("report: {}, {}, {}", f.summary.string(),
                                    f.loss_chart.string(), f.expert_load_chart.string()));
    } catch (const std::exception& e) {
      warn(fmt::format("the training report could not be written: {}", e.what()));
    }
  }

  void restore(const fs::path& dir) {
    const TrainerState saved = read_trainer_state(dir);
    MOE_CHECK(saved.tokenizer == tokenizer_->kind(),
              "{}: trained with tokenizer '{}', this run uses '{}' (data.tokenizer = \"{}\")",
              dir.string(), saved.tokenizer, tokenizer_->kind(), cfg_.data.tokenizer);
    if (!tokenizer_json_.empty())
      MOE_CHECK((tokenizer_->kind() == "hf" ? read_whole_file(dir / kTokenizerFile)
                                            : BpeTokenizer::load(dir / kTokenizerFile).to_json()) ==
                    tokenizer_json_,
                "{}: trained with a different tokenizer than data.tokenizer = \"{}\"; resume with "
                "the run's own tokenizer ({})", dir.string(), cfg_.data.tokenizer,
                (dir / kTokenizerFile).string());
    check_same_model(dir, mc_);
    if (cfg_.finetune) {
      check_base_model(dir, cfg_.model.weights, base_fingerprint_);
      load_peft_adapter_weights(dir, model_->lora_params());
    } else {
      load_weights(dir, model_->params());
    }
    load_optimizer_state(dir, opt_);
    if (saved.data_fingerprint != corpus_.fingerprint)
      warn(fmt::format("{}: the data differs from the data this run was trained on; "
                                    "training continues on the new data", dir.string()));
    if (saved.data_seed != st_.data_seed)
      warn(fmt::format("{}: saved with run.seed {}, resuming with {}: the remaining "
                                    "batches come in a different order", dir.string(),
                                    saved.data_seed, st_.data_seed));
    else if (cfg_.data.shuffle &&
             saved.shuffle_rng_state != sampler_.epoch_rng_state(saved.data.epoch))
      fail("{}: the saved shuffle generator state does not match run.seed {} (a checkpoint of "
           "another version of moe?)", dir.string(), st_.data_seed);
    MOE_CHECK(saved.data.index <= corpus_.train.size(),
              "{}: data position {} is beyond the {} training sequences (the data changed)",
              dir.string(), saved.data.index, corpus_.train.size());
    sampler_.set_position(saved.data);
    st_.step = saved.step;
    st_.tokens_seen = saved.tokens_seen;
    st_.nonfinite_streak = saved.nonfinite_streak;
    result_.last_checkpoint = dir;
    say(fmt::format("resumed from {} at step {}", dir.string(), st_.step));
  }

  // This rank's part of a global batch: parts of batch / W consecutive sequences, in rank order.
  Batch local_batch(const std::vector<int64_t>& global) const {
    const int64_t w = world().size(), part = static_cast<int64_t>(global.size()) / w;
    const auto first = global.begin() + world().rank() * part;
    return make_batch(corpus_.train, std::vector<int64_t>(first, first + part));
  }

  // Micro-batches -> gradient reductions across ranks -> clip -> router-bias update -> AdamW,
  // or a skipped step when anything is non-finite. Every rank draws the same global batches and
  // trains on its part; scaled as below, the summed gradients are those of the global batch.
  StepOutcome step() {
    CollectiveWatchdog::set_step(st_.step + 1);
    if (req_.hooks.before_step) req_.hooks.before_step(st_.step, *model_);
    const auto t0 = Clock::now();
    const int64_t accum = cfg_.optimizer.grad_accum;
    const double w = static_cast<double>(world().size());
    LossOptions options;
    options.z_loss = cfg_.optimizer.z_loss;
    // The sequence-wise aux loss is a mean over sequences, and every rank has as many.
    options.aux_grad_scale = static_cast<float>(1.0 / (w * static_cast<double>(accum)));
    StepOutcome s;
    s.lr = schedule_.at(st_.step);
    if (!grads_zeroed_) model_->zero_grads();
    grads_zeroed_ = false;
    // This rank's share of the step's CE, z-loss and aux loss, and whether it was asked to stop:
    // one all-reduce makes all of them the same on every rank.
    double parts[4] = {0, 0, 0, 0};
    for (int64_t m = 0; m < accum; ++m) {
      const Batch b = local_batch(sampler_.next_indices(cfg_.data.batch_size));
      // Adapter dropout: fresh masks per micro-batch, keyed by global token index.
      LoraRuntime& rt = model_->lora_runtime();
      rt.seed = static_cast<uint64_t>(cfg_.run.seed);
      rt.draw = static_cast<uint64_t>(st_.step * accum + m);
      rt.row_offset = world().rank() * b.shape.tokens();
      // The cross-entropy is a mean over the counted tokens of the whole micro-batch, so a
      // rank's part weighs in by its share of them.
      const int64_t mine = counted_targets(b.targets);
      int64_t all = mine;
      world().all_reduce_sum(&all, 1);
      const double share = all > 0 ? static_cast<double>(mine) / static_cast<double>(all) : 0.0;
      options.grad_scale = static_cast<float>(share / static_cast<double>(accum));
      const LossResult r = model_->forward(b.tokens, b.targets, b.shape, Pass::Train, options);
      // Backward runs even for a non-finite loss: it is what releases the saved activations
      // and dispatch handles of this forward.
      model_->backward();
      if (mine > 0) {
        parts[0] += r.ce * share / static_cast<double>(accum);
        parts[1] += r.z_loss * share / static_cast<double>(accum);
      }
      parts[2] += r.aux / (w * static_cast<double>(accum));
    }
    parts[3] = interrupt_ && interrupt_->requested() ? 1.0 : 0.0;
    if (world().size() > 1) {
      reduce_gradients(*model_, world(), *groups_.replicas);
      sum_router_counts(*model_, world());
      world().all_reduce_sum(parts, 4);
    }
    s.stop_requested = parts[3] > 0;
    s.loss = parts[0];
    s.z_loss = parts[1];
    s.aux_loss = parts[2];
    s.expert_load = expert_load_json(*model_);
    s.grad_norm = world().size() > 1 ? global_grad_norm(trainable_, groups_) : grad_norm(trainable_);
    const float clip = cfg_.optimizer.grad_clip > 0
                           ? clip_coefficient(s.grad_norm, cfg_.optimizer.grad_clip)
                           : 1.0f;
    s.finite = std::isfinite(s.loss) && std::isfinite(s.grad_norm);
    if (s.finite) {
      st_.nonfinite_streak = 0;
      model_->update_router_biases(cfg_.optimizer.bias_update_rate);
      // Clipping folded into the update, and the gradients zeroed as it reads them: one pass.
      opt_.step(s.lr, clip, GradsAfterStep::Zeroed);
      grads_zeroed_ = true;
    } else {
      skip(s);
    }
    ++st_.step;
    st_.tokens_seen += step_tokens_;
    st_.data = sampler_.position();
    st_.shuffle_rng_state = sampler_.epoch_rng_state(st_.data.epoch);
    s.seconds = seconds_since(t0);
    train_seconds_ += s.seconds;
    ++steps_this_run_;
    result_.losses.push_back(s.loss);
    return s;
  }

  void skip(const StepOutcome& s) {
    ++st_.nonfinite_streak;
    ++result_.skipped;
    model_->zero_grads();
    grads_zeroed_ = true;
    model_->update_router_biases(0.0);  // drops this step's expert counts, moves no bias
    const int64_t limit = cfg_.optimizer.max_nonfinite_steps;
    if (st_.nonfinite_streak > limit) {
      progress_.finish();
      fail("step {}: {} consecutive steps with a non-finite loss or gradient (more than "
           "optimizer.max_nonfinite_steps = {}); stopping. The last good checkpoint is {}",
           st_.step + 1, st_.nonfinite_streak, limit, last_checkpoint_name());
    }
    warn(fmt::format("step {}: non-finite {} (loss {}, grad norm {}); step skipped "
                                  "({} in a row, limit {})", st_.step + 1,
                                  std::isfinite(s.loss) ? "gradient" : "loss", s.loss,
                                  s.grad_norm, st_.nonfinite_streak, limit));
  }

  json step_record(const StepOutcome& s) const {
    const double tokens_per_s = static_cast<double>(step_tokens_) / s.seconds;
    json r = {{"step", st_.step},
              {"loss", s.loss},
              {"lr", s.lr},
              {"grad_norm", s.grad_norm},
              {"tokens", st_.tokens_seen},
              {"tokens_per_s", tokens_per_s},
              {"mfu", mfu(tokens_per_s)},
              {"fma_peak_gflops", peak_gflops_},
              {"simd", peak_.target},
              {"cpu", peak_.cpu},
              {"step_s", s.seconds},
              {"unigram_entropy", result_.unigram_entropy},
              {"skipped", !s.finite},
              {"expert_load", s.expert_load}};
    if (cfg_.optimizer.z_loss > 0) r["z_loss"] = s.z_loss;
    if (mc_.aux_loss_alpha > 0) r["aux_loss"] = s.aux_loss;
    return r;
  }

  void validate() {
    const auto t0 = Clock::now();
    result_.final_val_loss =
        evaluate(*model_, corpus_.val, cfg_.data.batch_size, cfg_.data.val_batches, world());
    say(fmt::format("step {}: validation loss {} ({})", st_.step,
                                  describe_loss(result_.final_val_loss),
                                  format_duration(seconds_since(t0))));
  }

  void checkpoint() {
    std::vector<std::pair<std::string, std::string>> extra;
    if (!tokenizer_json_.empty()) extra.emplace_back(kTokenizerFile, tokenizer_json_);
    for (const auto& f : tokenizer_side_files_) extra.push_back(f);
    CheckpointWriters writers;
    writers.world = &world();
    writers.ep_size = groups_.ep_size;
    writers.ep_rank = groups_.ep_rank;
    writers.writes_experts = groups_.writes_experts();
    // The other ranks wait in barriers while rank 0 writes, for as long as the disk takes
    // (up to parallel.checkpoint_timeout).
    const CollectiveWatchdog::SlowPhase slow_writes;
    try {
      save(extra, writers);
    } catch (const std::exception& e) {
      // A failed save touched only its hidden temporary directory: say which checkpoint a
      // resume will take.
      std::string last;
      try {
        last = last_checkpoint_name();
      } catch (const std::exception&) {
        last = "unknown (" + ckpt_dir_.string() + " cannot be listed)";
      }
      fail("step {}: writing the checkpoint failed: {}. The last complete checkpoint is {}",
           st_.step, e.what(), last);
    }
    say(fmt::format("step {}: checkpoint {}", st_.step, result_.last_checkpoint.string()));
  }

  void save(std::vector<std::pair<std::string, std::string>>& extra,
            const CheckpointWriters& writers) {
    if (cfg_.finetune) {
      // Adapters + their optimizer state + trainer state; the base is referenced, not copied.
      extra.emplace_back(kBaseModelFile, base_reference_);
      extra.emplace_back(kHfConfigFile, model_config_to_json(mc_).dump(2) + "\n");
      const AdapterWriters aw{&world(), groups_.ep_size, groups_.ep_rank, groups_.writes_experts()};
      const std::string base = fs::absolute(cfg_.model.weights).lexically_normal().string();
      result_.last_checkpoint = save_checkpoint_dir(
          ckpt_dir_, st_, cfg_.checkpoint.keep_last, req_.hooks.checkpoint_file, extra, writers,
          [&](const fs::path& tmp) {
            save_peft_adapter(tmp, *model_, lora_settings(cfg_), base, aw);
            write_optimizer_files(tmp, opt_, writers);
          });
    } else {
      result_.last_checkpoint = save_checkpoint(ckpt_dir_, mc_, model_->params(), opt_, st_,
                                                cfg_.checkpoint.keep_last,
                                                req_.hooks.checkpoint_file, extra, writers);
    }
  }

  void show_progress(const StepOutcome& s) {
    StepStatus status;
    status.step = st_.step;
    status.total = cfg_.schedule.steps;
    status.loss = s.loss;
    status.lr = s.lr;
    status.grad_norm = s.grad_norm;
    const double per_step = train_seconds_ / static_cast<double>(steps_this_run_);
    status.tokens_per_s = static_cast<double>(step_tokens_) / per_step;
    status.mfu = mfu(status.tokens_per_s);
    status.eta_s = static_cast<double>(cfg_.schedule.steps - st_.step) * per_step;
    progress_.step(status);
  }

  void finish_result(Clock::time_point start) {
    result_.steps_done = st_.step;
    result_.tokens_seen = st_.tokens_seen;
    result_.seconds = seconds_since(start);
    double recent = 0;
    n_recent_ = 0;
    for (auto it = result_.losses.rbegin(); it != result_.losses.rend() && n_recent_ < 10; ++it)
      if (std::isfinite(*it)) recent += *it, ++n_recent_;
    result_.final_train_loss = n_recent_ ? recent / static_cast<double>(n_recent_) : kNaN;
  }

  void print_summary(const fs::path& metrics_path) {
    const double tok_s = train_seconds_ > 0
                             ? static_cast<double>(step_tokens_ * steps_this_run_) / train_seconds_
                             : 0.0;
    auto line = [&](const std::string& s) { say("  " + s); };
    say("summary");
    line(fmt::format("steps            {} of {} ({} this run, {} skipped)", st_.step,
                     cfg_.schedule.steps, steps_this_run_, result_.skipped));
    line(fmt::format("tokens seen      {} ({} per step)",
                     format_count(static_cast<double>(st_.tokens_seen)), step_tokens_));
    line(fmt::format("time             {} ({} tok/s while training, MFU {:.1f}% of the {:.0f} "
                     "GFLOP/s FMA peak)", format_duration(result_.seconds), format_count(tok_s),
                     100.0 * mfu(tok_s), peak_gflops_));
    line(fmt::format("train loss       {} (mean of the last {} steps)",
                     describe_loss(result_.final_train_loss), n_recent_));
    line(fmt::format("validation loss  {}", describe_loss(result_.final_val_loss)));
    line(fmt::format("unigram baseline {:.4f} nats (token entropy of the training data)",
                     result_.unigram_entropy));
    if (!result_.last_checkpoint.empty())
      line(fmt::format("checkpoint       {}", result_.last_checkpoint.string()));
    line(fmt::format("metrics          {}", metrics_path.string()));
    say(world().size() > 1 ? "memory of rank 0 (current, peak since training started)"
                           : "memory (current, peak since training started)");
    std::string mem = MemoryTracker::instance().report();
    for (size_t pos = 0; pos < mem.size();) {
      const size_t nl = std::min(mem.find('\n', pos), mem.size());
      line(mem.substr(pos, nl - pos));
      pos = nl + 1;
    }
    if (mc_.mxfp4_experts()) line("  of the weights, routed experts (MXFP4): " + describe_packed_experts());
  }

  // "51.00 KiB for 98.3K weights on this rank (4.25 bits per weight)".
  std::string describe_packed_experts() const {
    int64_t bytes = 0, weights = 0;
    for (MoELayer* m : model_->moe_layers()) {
      bytes += m->mxfp4_experts()->bytes();
      const ExpertWeights& x = m->experts();
      weights += x.experts().count * 3 * x.dim() * x.hidden();
    }
    return fmt::format("{} for {} weights on this rank ({:.2f} bits per weight)", format_bytes(bytes),
                       format_count(static_cast<double>(weights)),
                       weights > 0 ? 8.0 * static_cast<double>(bytes) / static_cast<double>(weights)
                                   : 0.0);
  }

  const TrainRequest& req_;
  const TrainConfig& cfg_;
  const fs::path out_dir_, ckpt_dir_;
  const bool main_;  // world rank 0: prints and writes the run's files
  Progress progress_;
  const std::unique_ptr<Tokenizer> tokenizer_;
  const std::string tokenizer_json_;  // empty for the byte tokenizer
  const std::vector<std::pair<std::string, std::string>> tokenizer_side_files_;
  const uint64_t base_fingerprint_;   // a fine-tune's base (read once: it samples every tensor)
  const std::string base_reference_;  // a fine-tune's base_model.json
  const std::optional<ChatTemplate> chat_template_;  // a fine-tune's base model's, if any
  const Corpus corpus_;
  const ModelConfig mc_;
  const ExpertParallelGroups groups_;
  std::unique_ptr<CausalLM> model_;
  const ParamList trainable_;
  // Whether every gradient is zero now (the optimizer's pass or a skipped step zeroed them; the
  // gradients are those of trainable_, which AdamW updates), so a step need not zero them first.
  bool grads_zeroed_ = false;
  AdamW opt_;
  TrainSampler sampler_;
  const LrSchedule schedule_;
  const int64_t step_tokens_;
  const double flops_per_token_;
  FmaPeak peak_;
  double peak_gflops_ = 0;
  TrainerState st_;
  TrainResult result_;
  const InterruptGuard* interrupt_ = nullptr;
  double train_seconds_ = 0;
  int64_t steps_this_run_ = 0;
  int64_t n_recent_ = 0;
};

}  // namespace

TrainResult train(const TrainRequest& req) {
  // Before the data is read: a fresh run must not mix its checkpoints with another run's.
  if (!req.resume_from) {
    const fs::path out_dir = req.config.run.out_dir;
    const auto existing = latest_checkpoint(out_dir / "checkpoints");
    MOE_CHECK(!existing, "{}: already holds checkpoints (latest {}); pass --resume to continue "
              "that run, or choose another --run.out_dir", out_dir.string(),
              existing ? existing->filename().string() : "");
  }
  if (req.config.run.threads > 0) set_num_threads(static_cast<int>(req.config.run.threads));
  return TrainingRun(req).run();
}

}  // namespace moe
