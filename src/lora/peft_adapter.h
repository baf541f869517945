#pragma once
// LoRA adapters on disk in Hugging Face PEFT's layout (SPEC §8): a directory with
//   adapter_config.json        LoraConfig fields (peft_type LORA, r, lora_alpha, lora_dropout,
//                              use_rslora, target_modules, rank_pattern / alpha_pattern for the
//                              routed experts' own rank, base_model_name_or_path, ...)
//   adapter_model.safetensors  F32 tensors base_model.model.<module>.lora_A.weight [r, in] and
//                              .lora_B.weight [out, r], metadata {"format": "pt"}
// Routed experts use the per-expert ("v4") keys of transformers' DeepseekV3 experts ModuleList:
// ...mlp.experts.<e>.{gate,up,down}_proj.lora_{A,B}.weight. The engine's grouped adapter of a
// layer, A [E, r, in] and B [E, out, r], is exactly these tensors stacked: expert e's slices
// are lora_A / lora_B of experts.<e> (no transposition, no interleaving), so PEFT's
// PeftModel.from_pretrained on a transformers DeepseekV3 model loads the same deltas.
//
// DeepSeek-V4 (model_type deepseek_v4) differs in two ways, because Hugging Face's deepseek_v4
// holds a layer's routed experts as fused 3-D parameters, mlp.experts.gate_up_proj [E, 2I, H]
// (gate rows, then up rows) and mlp.experts.down_proj [E, H, I], which PEFT adapts only through
// target_parameters (its ParamWrapper, SPEC §8.1):
//   * Routed experts are saved in that fused layout, PEFT >= 0.19.1's orientation (a parameter
//     [E, out, in]; R the fused rank):
//       lora_A [R·E, in]:  row e·R + k    = expert e's A row k
//       lora_B [out, R·E]: column k·E + e = expert e's B column k
//     under …mlp.experts.base_layer.lora_{A,B}.weight for gate_up (PEFT's inner wrapper) and
//     …mlp.experts.lora_{A,B}.weight for down (the outer one); a layer with only one of the two
//     uses the latter keys. The engine adapts gate and up separately (rank r each), which is
//     exactly one rank-2r gate_up adapter with A_e = [A_gate; A_up] and B_e = blockdiag(B_gate,
//     B_up) (SPEC §8.6): written with rank_pattern 2r and alpha_pattern 2·alpha (√2·alpha with
//     rsLoRA), the same scaling. Loading reads that back and requires B's off-diagonal blocks to
//     be zero (an adapter trained with a shared A has no exact separate-A form).
//   * adapter_config.json names every adapted module and parameter by its full path
//     (target_modules, target_parameters), so PEFT builds exactly the engine's adapters: a
//     suffix such as "kv_proj" would also reach the compressor in PEFT, "all-linear" o_a_proj
//     (model/v4/v4_lora.h has the rules).
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "lora/lora_config.h"
#include "model/param.h"

namespace moe {

class Communicator;
class CausalLM;

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";

// PEFT's rank_pattern / alpha_pattern key for every routed expert projection.
inline constexpr const char* kExpertRankPattern = R"(mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))";

// DeepSeek-V4's rank_pattern / alpha_pattern keys of the fused routed-expert parameters.
inline constexpr const char* kFusedGateUpPattern = R"(mlp\.experts\.gate_up_proj)";
inline constexpr const char* kFusedDownPattern = R"(mlp\.experts\.down_proj)";

nlohmann::json peft_adapter_config(const LoraSettings& s, const std::string& base_model);
// The adapter_config.json of `model`'s adapters (from add_lora with `s`): the above for
// DeepSeek-V2/V3; for DeepSeek-V4 the full module and parameter lists and the fused patterns.
nlohmann::json peft_adapter_config(const LoraSettings& s, const std::string& base_model,
                                   const CausalLM& model);
// DeepSeek-V4's per-expert adapter tensors (…mlp.experts.<e>.{gate,up,down}_proj.lora_{A,B}
// .weight, every expert of a layer) replaced by the fused ones described above; other tensors
// pass unchanged, in order.
std::vector<std::pair<std::string, Tensor>> fuse_expert_adapters(
    std::vector<std::pair<std::string, Tensor>> tensors);
// The settings an adapter_config.json describes. Fields PEFT has that the engine does not
// implement (DoRA, biases, layer selection, other patterns, ...) are errors naming the field.
LoraSettings lora_settings_from_peft(const nlohmann::json& config, const std::string& source);
LoraSettings read_peft_adapter_config(const std::filesystem::path& dir);
bool is_peft_adapter_dir(const std::filesystem::path& dir);

// Who writes what under expert parallelism: the first replica of each expert shard writes its
// experts' tensors to a part file, world rank 0 the rest, then rank 0 merges the parts into the
// one adapter_model.safetensors PEFT reads (adapters are small). Every rank calls (collective).
struct AdapterWriters {
  Communicator* world = nullptr;  // null or one rank: this process writes everything
  int ep_size = 1;
  int ep_rank = 0;
  bool writes_experts = true;
};

// Writes both files into `dir` (created), each atomically.
void save_peft_adapter(const std::filesystem::path& dir, const CausalLM& model,
                       const LoraSettings& settings, const std::string& base_model,
                       const AdapterWriters& writers = {});
// Fills `lora_params` (from CausalLM::add_lora) from dir's adapter_model.safetensors by
// name; every tensor must be present, F32 or BF16, with its shape. Each rank reads only the
// tensors it holds. Routed-expert adapters absent by their per-expert names are taken from the
// fused layout (DeepSeek-V4, above); `routed_experts` > 0 is the model's E, which the fused
// tensors must have (0: whatever they have). Returns the names of the file's tensors it read.
std::set<std::string> load_peft_adapter_weights(const std::filesystem::path& dir,
                                                const ParamList& lora_params,
                                                int64_t routed_experts = 0);
// read_peft_adapter_config + add_lora + load_peft_adapter_weights: the adapter applied unmerged.
void apply_peft_adapter(const std::filesystem::path& dir, CausalLM& model);

// What an adapter checkpoint records of its base (base_model.json): the model directory and a
// fingerprint of its config.json, tensor index (names, dtypes, shapes) and sampled bytes of every
// tensor, so a resume against another base is an error rather than a silently wrong fine-tune.
inline constexpr const char* kBaseModelFile = "base_model.json";
uint64_t base_model_fingerprint(const std::filesystem::path& model_dir);
// base_model.json's text for `model_dir`, whose base_model_fingerprint is `fingerprint`.
std::string base_model_reference(const std::filesystem::path& model_dir, uint64_t fingerprint);
// Raises naming both when `model_dir` (fingerprint `fingerprint`) is not the base
// `checkpoint_dir` was trained on.
void check_base_model(const std::filesystem::path& checkpoint_dir,
                      const std::filesystem::path& model_dir, uint64_t fingerprint);

}  // namespace moe
