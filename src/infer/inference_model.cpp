#include "infer/inference_model.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/limits.h"
#include "data/documents.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "lora/merge.h"
#include "train/checkpoint_state.h"

namespace moe {

namespace fs = std::filesystem;

std::unique_ptr<Tokenizer> model_tokenizer(const fs::path& dir) {
  if (fs::is_regular_file(dir / kTokenizerFile)) return load_tokenizer((dir / kTokenizerFile).string());
  if (fs::is_regular_file(dir / kTrainerStateFile)) {
    const TrainerState st = read_trainer_state(dir);
    MOE_CHECK(st.tokenizer == ByteTokenizer::kKind, "{}: trained with tokenizer '{}' but holds no {}",
              dir.string(), st.tokenizer, kTokenizerFile);
    return make_byte_tokenizer();
  }
  // A released model without tokenizer.json may ship a tiktoken file (Moonlight / Kimi).
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name == "tiktoken.model" || name.ends_with(".tiktoken")) return load_tokenizer(dir.string());
  }
  return make_byte_tokenizer();
}

namespace {

std::vector<int32_t> generation_config_eos_ids(const fs::path& file) {
  std::vector<int32_t> ids;
  if (!fs::is_regular_file(file)) return ids;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file_capped(file, "the generation config"),
                              json_depth_limit<nlohmann::json>(file.string()));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", file.string(), e.what());
  }
  if (!j.is_object() || !j.contains("eos_token_id") || j["eos_token_id"].is_null()) return ids;
  const nlohmann::json& eos = j["eos_token_id"];
  auto add = [&](const nlohmann::json& v) {
    MOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 &&
                  v.get<int64_t>() <= std::numeric_limits<int32_t>::max(),
              "{}: field 'eos_token_id' must be a token id or a list of them, got {}",
              file.string(), v.dump());
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  };
  if (eos.is_array()) {
    for (const auto& v : eos) add(v);
  } else {
    add(eos);
  }
  return ids;
}

}  // namespace

void check_expert_activations(const ModelConfig& cfg, ExpertActivations activations,
                              const fs::path& model_dir) {
  if (activations == ExpertActivations::Fp32) return;
  // One message for both causes, naming the option, the value it needs and how to get there.
  MOE_CHECK(cfg.n_routed_experts > 0 && cfg.mxfp4_experts(),
            "--expert-activations {} needs routed experts in MXFP4 (config.json "
            "quantization_config.quant_method \"mxfp4\", e.g. written by `moe quantize`), but "
            "{}'s routed experts are {}; use --expert-activations fp32 (the default)",
            expert_activations_name(activations), model_dir.string(),
            cfg.n_routed_experts > 0 ? cfg.expert_format : "absent (no MoE layer)");
}

InferenceModel load_inference_model(const fs::path& model_dir, const fs::path& adapter_dir,
                                    std::shared_ptr<Dispatcher> dispatcher,
                                    ExpertActivations expert_activations) {
  InferenceModel m;
  m.config = read_hf_config(model_dir.string());
  if (!adapter_dir.empty()) {
    // The experts in the format the adapter was trained with (lora/merge.h).
    std::string note;
    m.config = config_for_adapter(m.config, adapter_dir, &note);
    if (!note.empty()) m.notes.push_back(note);
  }
  check_expert_activations(m.config, expert_activations, model_dir);
  m.tokenizer = model_tokenizer(model_dir);
  MOE_CHECK(m.config.vocab_size >= m.tokenizer->vocab_size(),
            "{}: vocab_size {} is too small for its {} tokenizer ({} ids)", model_dir.string(),
            m.config.vocab_size, m.tokenizer->kind(), m.tokenizer->vocab_size());
  m.chat_template = load_chat_template(model_dir / "tokenizer_config.json");
  m.eos_ids = generation_config_eos_ids(model_dir / "generation_config.json");
  m.model = make_causal_lm(m.config, std::move(dispatcher));
  m.model->set_expert_activations(expert_activations);
  load_weights(model_dir.string(), m.model->params());
  if (!adapter_dir.empty()) {
    const AttachedAdapter adapter = attach_peft_adapter(adapter_dir, model_dir, *m.model);
    if (!adapter.base_mismatch.empty()) m.notes.push_back("warning: " + adapter.base_mismatch);
  }
  const fs::path named = model_dir.filename().empty() ? model_dir.parent_path() : model_dir;
  m.name = named.filename().string();
  return m;
}

std::vector<int32_t> encode_completion_prompt(const Tokenizer& tokenizer, std::string_view text) {
  std::vector<int32_t> ids;
  if (tokenizer.add_bos() && tokenizer.bos_id() >= 0) ids.push_back(tokenizer.bos_id());
  tokenizer.encode(text, ids);
  if (ids.empty()) ids.push_back(tokenizer.end_of_text());
  return ids;
}

std::vector<int32_t> encode_chat_prompt(const InferenceModel& m,
                                        const std::vector<ChatMessage>& messages) {
  if (m.chat_template) return chat_generation_prompt(messages, *m.tokenizer, *m.chat_template);
  return chat_generation_prompt(messages, *m.tokenizer);
}

std::vector<int32_t> stop_ids(const InferenceModel& m) {
  std::vector<int32_t> ids = {m.tokenizer->end_of_text()};
  for (int32_t id : m.eos_ids)
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  if (m.chat_template && !m.chat_template->eos_token().empty()) {
    const std::vector<int32_t> eos = m.tokenizer->encode(m.chat_template->eos_token());
    if (eos.size() == 1 && std::find(ids.begin(), ids.end(), eos[0]) == ids.end())
      ids.push_back(eos[0]);
  }
  return ids;
}

}  // namespace moe
