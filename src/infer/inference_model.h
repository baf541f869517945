#pragma once
// What `moe generate` and `moe serve` load: a model directory (config.json + safetensors, the
// engine's checkpoints or a released model's), its tokenizer (tokenizer.json, a tiktoken file, or
// bytes for a checkpoint trained with the byte tokenizer), its chat template
// (tokenizer_config.json) and optionally a LoRA adapter in PEFT layout applied unmerged.
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/chat_template.h"
#include "data/finetune_data.h"
#include "data/tokenizer.h"
#include "model/causal_lm.h"

namespace moe {

class Dispatcher;

struct InferenceModel {
  ModelConfig config;
  std::unique_ptr<CausalLM> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;  // the model's own; none: the engine's default
  std::string name;                            // the model directory's name (the API's model id)
  std::vector<int32_t> eos_ids;                // generation_config.json's eos_token_id(s)
  std::vector<std::string> notes;              // one line each, for stderr (adapter warnings)
};

// Errors name the directory and the file. `dispatcher`: expert parallelism's, or null for one
// process (each rank then loads only its experts). `expert_activations`: the routed experts'
// forward (--expert-activations, moe/expert_activations.h); int8 is refused before any weight
// is read unless the experts, once an adapter's format is applied, are MXFP4.
InferenceModel load_inference_model(const std::filesystem::path& model_dir,
                                    const std::filesystem::path& adapter_dir = {},
                                    std::shared_ptr<Dispatcher> dispatcher = nullptr,
                                    ExpertActivations expert_activations = ExpertActivations::Fp32);

// The error for `--expert-activations int8` on a model (config read from model_dir) whose routed
// experts are not MXFP4; nothing for fp32.
void check_expert_activations(const ModelConfig& cfg, ExpertActivations activations,
                              const std::filesystem::path& model_dir);

// The tokenizer a model directory was trained or released with.
std::unique_ptr<Tokenizer> model_tokenizer(const std::filesystem::path& model_dir);

// A completion prompt: the text's ids, after BOS where the tokenizer adds one. An empty text
// starts a new document (end-of-text, or BOS).
std::vector<int32_t> encode_completion_prompt(const Tokenizer& tokenizer, std::string_view text);
// A chat prompt: the messages in the model's chat template (or the engine's default), then the
// assistant header, exactly the ids that precede a reply in `moe finetune`.
std::vector<int32_t> encode_chat_prompt(const InferenceModel& m,
                                        const std::vector<ChatMessage>& messages);
// Ids that end a reply: end-of-text, generation_config.json's eos_token_id (one id or a list,
// as transformers and vLLM read it), and the chat template's eos token when it is a single id.
std::vector<int32_t> stop_ids(const InferenceModel& m);

}  // namespace moe
