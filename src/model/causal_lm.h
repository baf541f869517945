#pragma once
// What the trainer, evaluation, fine-tuning, generation and serving need of a model, whatever
// its family: DeepSeek-V2/V3 (model/model.h) or DeepSeek-V4 (model/v4/v4_model.h). One
// interface, so `moe train`, `moe finetune`, `moe generate` and `moe serve` run every family
// through the same code; make_causal_lm picks the family from config.json's model_type.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "lora/lora_adapter.h"
#include "lora/lora_config.h"
#include "model/config.h"
#include "model/inference_cache.h"
#include "model/lm_head_loss.h"
#include "model/param.h"
#include "moe/expert_activations.h"

namespace moe {

class Dispatcher;
class MoELayer;

struct LossOptions {
  double z_loss = 0.0;
  float grad_scale = 1.0f;  // d(objective)/d(this micro-batch's loss), e.g. 1/accumulation steps
  // d(objective)/d(this micro-batch's aux loss) when it differs from grad_scale: under data or
  // expert parallelism the cross-entropy part weighs a rank's counted tokens, the sequence-wise
  // aux loss its sequences.
  std::optional<float> aux_grad_scale;
  // DeepSeek-V4 with MTP layers: the MTP cross-entropy's weight in the loss (Automodel's
  // loss_scaling_factor 0.1 divided by the depth, 1). Ignored by models without MTP.
  double mtp_loss_scale = 0.1;
};

class CausalLM {
 public:
  virtual ~CausalLM() = default;

  virtual const ModelConfig& config() const = 0;
  // Every parameter, in checkpoint order, under the family's checkpoint key names.
  virtual const ParamList& params() const = 0;
  // What the optimizer steps: the base parameters that train, then the adapters.
  virtual ParamList trainable_params() const = 0;
  // Deterministic initialisation: each tensor drawn from a stream keyed by (seed, name).
  virtual void init_weights(uint64_t seed) = 0;
  virtual void allocate_grads() = 0;
  virtual void zero_grads() = 0;

  // tokens, targets: I32 [batch*seq]. Pass::Train keeps what backward() needs; Eval and
  // Inference keep nothing.
  virtual LossResult forward(const Tensor& tokens, const Tensor& targets,
                             const BatchShape& shape, Pass pass,
                             const LossOptions& options = {}) = 0;
  // Releases everything the Train forward kept.
  virtual void backward() = 0;
  // Logits [batch*seq, vocab] in inference mode (nothing is kept).
  virtual Tensor logits(const Tensor& tokens, const BatchShape& shape) = 0;

  // Cached inference (src/infer): a cache of this model's kind for `slots` sequences of up to
  // `max_len` positions, and the forward over it. tokens I32 [T] are the chunks' new tokens in
  // row order. Returns the logits of each non-empty chunk's last token [chunks, vocab], or of
  // every row [T, vocab] with all_rows. T = 0 is allowed: an expert-parallel rank without
  // requests still serves its experts to the others (every MoE layer's dispatch and combine are
  // collective).
  virtual std::unique_ptr<InferenceCache> make_cache(int64_t slots, int64_t max_len) const = 0;
  virtual Tensor forward_cached(const Tensor& tokens, std::span<const CachedChunk> chunks,
                                InferenceCache& cache, bool all_rows = false) = 0;
  // Grows the RoPE tables to `positions` now, so inference never grows them mid-serving.
  virtual void reserve_positions(int64_t positions) = 0;

  // LoRA fine-tuning. freeze_base: no base parameter trains (no gradient, no optimizer state;
  // router biases stay put). add_lora: adapters on the modules `settings` targets (PEFT module
  // names of the family's Hugging Face model), initialised as PEFT does from `seed` (step 0
  // equals the base model); errors name `section`.
  virtual void freeze_base() = 0;
  virtual const ParamList& add_lora(const LoraSettings& settings, uint64_t seed,
                                    const std::string& section = "lora") = 0;
  // Adapter matrices in a fixed order (layer, then module), PEFT key names.
  virtual const ParamList& lora_params() const = 0;
  bool has_lora() const { return !lora_params().empty(); }
  // Removes every adapter (after lora/merge.h has folded them into the base weights).
  virtual void drop_lora() = 0;
  // Dropout masks need the micro-batch and each row's global token index (the trainer's).
  virtual LoraRuntime& lora_runtime() = 0;

  virtual std::vector<MoELayer*> moe_layers() const = 0;
  // Inference: every MoE layer's routed-expert forward with int8 or fp32 activations
  // (moe/expert_activations.h). Int8 needs MXFP4 routed experts (an error otherwise) and makes
  // a Train forward an error until fp32 is set again. Under expert parallelism every rank sets
  // it: each rank computes its own experts' rows.
  void set_expert_activations(ExpertActivations activations);
  // Aux-loss-free balancing: call between backward and the optimizer step.
  virtual void update_router_biases(double rate) = 0;
  // Whether any layer still holds state from a Train forward (tests: nothing leaks).
  virtual bool has_saved() const = 0;
};

// The model config.json's model_type names: DeepSeekV4Model for "deepseek_v4", DeepSeekModel
// for the V2/V3 family. `dispatcher`: expert parallelism's, or null for one process.
std::unique_ptr<CausalLM> make_causal_lm(const ModelConfig& cfg,
                                         std::shared_ptr<Dispatcher> dispatcher = nullptr);

}  // namespace moe
