#pragma once
// `moe inspect DIR`: what a model directory holds, against what its config.json describes, from
// the safetensors headers alone (no tensor data is read): the configuration, every tensor by
// kind with dtypes, shapes and bytes, the weight formats found (fp32, bf16, FP8, MXFP4), missing
// and unexpected tensors, and the memory a load would need in the engine's formats.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/hf_config.h"
#include "model/config.h"

namespace moe {

enum class TensorKind {
  Embedding, Attention, DenseMlp, Router, SharedExperts, RoutedExperts, Norms, Head,
  HyperConnections, Mtp, Unknown
};
const char* tensor_kind_name(TensorKind k);
// By name: model.embed_tokens, model.layers.L.self_attn.*, ... (MTP layers per `info`); scales
// (`weight_scale_inv`, MXFP4 `.scale`) share their weight's kind. DeepSeek-V4 (info.v4()):
// embed, head, layers.L.{hc_*, attn.*, ffn.gate.*, ffn.shared_experts.*, ffn.experts.*, norms},
// hc_head_*, and the MTP module mtp.0.* (kind Mtp, except its routed experts: RoutedExperts).
TensorKind tensor_kind_of(const std::string& name, const HfWeightsInfo& info);

// One tensor of the model a config describes, in the engine's parameter order (the order of
// DeepSeekModel::params(), or DeepSeekV4Model::params() for model_type deepseek_v4, with fp32
// routed experts; packed experts add a `.scale` after each weight).
struct ExpectedTensor {
  std::string name;
  Shape shape;        // matrices: the unpacked [out, in]
  TensorKind kind;
  bool matrix = false;    // a linear weight: may be F32, BF16, F8_E4M3 (+ its scale) on disk
  bool optional = false;  // mlp.gate.e_score_correction_bias (absent in V2: zeros)
  bool ids = false;       // an id table (V4's gate.tid2eid): I64 or I32 on disk
  bool routed_expert() const { return kind == TensorKind::RoutedExperts; }
};
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& cfg);

struct InspectTensor {
  std::string name, file, dtype;
  Shape shape;
  int64_t bytes = 0;
  TensorKind kind = TensorKind::Unknown;
  // "fp32", "bf16", "fp8", "mxfp4" (scales carry their weight's format), else the dtype.
  std::string format;
};

struct InspectKindStats {
  int64_t tensors = 0, bytes = 0;
  std::map<std::string, int64_t> dtypes;  // dtype -> tensors
};

struct InspectFormatStats {
  int64_t weights = 0;  // weight tensors in this format (their scales not counted)
  int64_t elements = 0;
  int64_t bytes = 0;    // scales included
};

struct InspectReport {
  std::filesystem::path dir;
  ModelConfig config;
  HfWeightsInfo info;
  ParamCounts counts;
  bool sharded = false;
  std::vector<std::string> files;  // weight files, in index order
  int64_t file_bytes = 0;          // sum of the weight files' sizes
  std::vector<InspectTensor> tensors;
  std::map<TensorKind, InspectKindStats> kinds;
  std::map<std::string, InspectFormatStats> formats;
  // Each entry names the tensor (and its file where there is one).
  std::vector<std::string> missing, unexpected, problems;
  std::vector<std::string> notes;  // e.g. absent router biases (loaded as zeros)
  int64_t mtp_tensors = 0;  // V2/V3: tensors of the MTP layers, which a load skips
  // What a load needs for the weights, in the engine's formats: everything fp32 but routed
  // experts, which are fp32 or MXFP4 (4.25 bits per weight); `experts` is what the config asks.
  int64_t nonexpert_bytes = 0, experts_fp32_bytes = 0, experts_mxfp4_bytes = 0;
  std::string experts;
  // The largest transient buffer of a load (one row, or one chunk of FP8 rows + its scales).
  int64_t load_transient_bytes = 0;
  bool ok() const { return missing.empty() && problems.empty(); }
};

// Errors (an unreadable config, a corrupt header, an index naming a file that does not exist)
// name the file and the tensor; inconsistencies a load would trip over are collected instead.
InspectReport inspect_model(const std::filesystem::path& dir);
std::string format_inspect_report(const InspectReport& report);

}  // namespace moe
