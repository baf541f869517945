// `moe merge`: a LoRA adapter folded into its base model, written as a new Hugging Face model
// directory (PEFT's merge_and_unload): every adapted weight W += s·B·A, computed in fp32 with
// double accumulation (src/lora/merge.h), the adapters gone. The tokenizer files of the base
// travel along.
//
// Routed experts of an MXFP4 base cannot hold W + s·B·A exactly; --experts chooses:
//   bf16 (default for an MXFP4 base) | f32  see below: the merge is faithful, the experts grow
//        from 4.25 to 16 (32) bits per weight.
//   mxfp4  each merged expert row is re-quantized in place (decode
//        the packed row, add the delta row, quantize it back, per block under the better of the
//        fresh scale and the base's: one row buffer, never a whole fp32 matrix; lora/merge.h);
//        the relative RMS and max error of that re-quantization (merged fp32 against packed) is
//        printed per MoE layer, next to ‖ΔW‖/‖W‖ and error/‖ΔW‖. The output keeps
//        quantization_config. An adapter of a few percent of ‖W‖ is mostly below MXFP4's
//        resolution (error/‖ΔW‖ near 1: the experts' part of it is lost); a warning says so.
//   bf16 | f32  the base's experts are decoded exactly into fp32, the delta added there, and
//        the merged experts written unquantized in that dtype; config.json has no
//        quantization_config (quantize the result later with `moe quantize` if wanted).
// For an fp32/bf16 base --experts is the dtype of the routed experts (default: --dtype); mxfp4
// is refused there (merge, then `moe quantize`) — unless the adapter was trained with the base's
// experts quantized on load (`moe finetune --model.experts mxfp4`; its checkpoint's config.json
// has quantization_config): the base is then loaded as it was for the fine-tune, MXFP4 experts,
// and merged as an MXFP4 base (lora/merge.h config_for_adapter).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "lora/merge.h"
#include "lora/peft_adapter.h"
#include "model/causal_lm.h"
#include "parallel/ep_training.h"

namespace moe::cli {

namespace {

namespace fs = std::filesystem;

struct MergeArgs {
  std::string model_dir, adapter_dir, out_dir;
  std::string dtype = "f32";
  std::string experts;  // empty: mxfp4 for an MXFP4 base, else --dtype
};

// Files of the base that describe its tokenizer and generation defaults (copied when present).
constexpr const char* kSideFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                      "special_tokens_map.json", "generation_config.json"};

DType dtype_of(const std::string& name) { return name == "bf16" ? DType::BF16 : DType::F32; }

// Weights in `dtype`, except fp32 routed experts in `expert_dtype` (packed ones keep I8 +
// F8_E8M0). One dtype: save_model; two: the non-expert tensors, then the experts, in shards of
// at most kDefaultMaxShardBytes each, indexed as one sharded model.
void save_merged(const fs::path& out, const ModelConfig& cfg, const ParamList& params, DType dtype,
                 DType expert_dtype) {
  bool mixed = false;
  for (const Param* p : params) mixed |= !p->packed() && is_routed_expert_param(p->name) && expert_dtype != dtype;
  if (!mixed) {
    save_model(out, cfg, params, dtype);
    return;
  }
  struct Shard {
    ParamList params;
    DType dtype;
    int64_t bytes = 0;
  };
  std::vector<Shard> shards;
  for (const bool experts : {false, true}) {
    const DType d = experts ? expert_dtype : dtype;
    bool opened = false;
    for (Param* p : params) {
      if (is_routed_expert_param(p->name) != experts) continue;
      const int64_t bytes = p->packed() ? p->value.nbytes() : p->value.numel() * dtype_size(d);
      if (!opened || (shards.back().bytes > 0 && shards.back().bytes + bytes > kDefaultMaxShardBytes))
        shards.push_back({{}, d, 0}), opened = true;
      shards.back().params.push_back(p);
      shards.back().bytes += bytes;
    }
  }
  const int64_t n = static_cast<int64_t>(shards.size());
  for (int64_t i = 0; i < n; ++i)
    save_model_shard(out, i + 1, n, shards[static_cast<size_t>(i)].params,
                     shards[static_cast<size_t>(i)].dtype);
  finish_sharded_model(out, cfg, n, dtype);
}

void run_merge(const MergeArgs& a) {
  const fs::path base = a.model_dir, adapter = a.adapter_dir, out = a.out_dir;
  const ModelConfig cfg = read_hf_config(base);
  std::error_code ec;
  MOE_CHECK(fs::is_directory(adapter, ec), "--adapter {}: no such directory (a PEFT adapter "
            "directory holds {} and {})", adapter.string(), kAdapterConfigFile, kAdapterWeightsFile);
  read_peft_adapter_config(adapter);  // fails fast, before the base is loaded
  auto same = [](const fs::path& x, const fs::path& y) {
    return fs::weakly_canonical(fs::absolute(x)) == fs::weakly_canonical(fs::absolute(y));
  };
  MOE_CHECK(!same(out, base) && !same(out, adapter), "--out {} must differ from --model and "
            "--adapter", out.string());
  MOE_CHECK(!fs::exists(out, ec) || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
            "--out {}: already exists and is not an empty directory; choose a new one",
            out.string());

  // The experts as the adapter was trained with them: MXFP4 when the base's are, or when an fp32
  // base was quantized on load for the fine-tune (the checkpoint's config.json says so).
  std::string note;
  const ModelConfig trained = config_for_adapter(cfg, adapter, &note);
  if (!note.empty()) fmt::print(stderr, "{}\n", note);
  const bool packed = trained.mxfp4_experts();
  std::string experts = a.experts;
  // Faithful by default: re-quantizing loses most of a typical adapter's expert delta (above).
  if (experts.empty()) experts = packed ? "bf16" : a.dtype;
  MOE_CHECK(experts != "mxfp4" || packed,
            "--experts mxfp4: the routed experts of {} are not MXFP4 (its config.json has no "
            "quantization_config); merge with --experts f32 or bf16, then run `moe quantize` on "
            "the result", base.string());
  const bool requantize = experts == "mxfp4";

  // MXFP4 experts merged into unquantized ones are loaded as fp32 holding the MXFP4 values
  // exactly: decoded from a packed base, or rounded through MXFP4 from an fp32 one.
  ModelConfig model_cfg = trained;
  if (packed && !requantize) model_cfg.expert_format = "fp32";
  const std::unique_ptr<CausalLM> built = make_causal_lm(model_cfg);
  CausalLM& model = *built;
  if (model_cfg.mxfp4_experts() || !packed) {
    load_weights(base, model.params());  // packed, quantized on load, or fp32 as it is
  } else if (cfg.mxfp4_experts()) {
    load_weights_decoding_experts(base, model.params());
  } else {
    load_weights(base, model.params());
    round_experts_through_mxfp4(model.params());
  }

  const AttachedAdapter attached = attach_peft_adapter(adapter, base, model);
  if (!attached.base_mismatch.empty()) fmt::print(stderr, "warning: {}\n", attached.base_mismatch);
  const LoraSettings& s = attached.settings;
  const MergeReport report = merge_lora_into_base(model, s);
  fmt::print("merged {} adapted matrices (r {}, alpha {}{}{}) into {}\n", report.matrices, s.r,
             s.alpha, s.rslora ? ", rsLoRA" : "",
             s.expert_r > 0 || s.expert_alpha > 0
                 ? fmt::format("; routed experts r {}, alpha {}", s.rank_for(true), s.alpha_for(true))
                 : std::string(),
             base.string());
  if (!report.requantized.empty()) {
    fmt::print("routed experts re-quantized to MXFP4 (merged fp32 vs packed):\n");
    fmt::print("{:>6}  {:>8}  {:>12}  {:>14}  {:>13}  {:>12}  {:>13}\n", "layer", "matrices",
               "weights", "rel RMS error", "max |error|", "|dW| / |W|", "error / |dW|");
    double worst = 0;  // error / |dW|
    for (const MergeLayerStats& st : report.requantized) {
      const double lost = st.rel_delta > 0 ? st.rel_rms_error / st.rel_delta : 0.0;
      worst = std::max(worst, lost);
      fmt::print("{:>6}  {:>8}  {:>12}  {:>14.4e}  {:>13.4e}  {:>12.4e}  {:>13.3f}\n", st.layer,
                 st.matrices, st.weights, st.rel_rms_error, st.max_abs_error, st.rel_delta, lost);
    }
    if (worst >= 0.5)
      fmt::print(stderr, "warning: re-quantizing the merged experts to MXFP4 costs up to {:.0f}% "
                 "of the adapter's change to them (100%: no closer to the adapted model than the "
                 "base is); much of that change is below MXFP4's resolution. --experts bf16 or "
                 "f32 keeps it\n", 100 * worst);
  }

  save_merged(out, model.config(), model.params(), dtype_of(a.dtype), dtype_of(experts));
  for (const char* name : kSideFiles) {
    if (!fs::is_regular_file(base / name, ec)) continue;
    std::ifstream src(base / name, std::ios::binary);
    std::stringstream bytes;
    bytes << src.rdbuf();
    MOE_CHECK(src.good() || src.eof(), "{}: cannot read", (base / name).string());
    write_file_atomic(out / name, bytes.str());
  }
  fsync_directory(out);
  fmt::print("wrote {} (weights {}, routed experts {}{})\n", out.string(), a.dtype, experts,
             packed && !requantize ? ", no quantization_config" : "");
}

}  // namespace

void add_merge_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "merge", "fold a LoRA adapter into its base model (W += s·B·A) and write the merged model "
               "as a new Hugging Face model directory");
  auto a = std::make_shared<MergeArgs>();
  cmd->add_option("--model", a->model_dir, "base model directory (config.json + safetensors)")
      ->required();
  cmd->add_option("--adapter", a->adapter_dir,
                  "LoRA adapter directory in PEFT layout (adapter_config.json + "
                  "adapter_model.safetensors), e.g. runs/X/checkpoints/step_N")
      ->required();
  cmd->add_option("--out", a->out_dir, "new model directory (must not exist, or be empty)")
      ->required();
  cmd->add_option("--dtype", a->dtype, "dtype of the written weights")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--experts", a->experts,
                  "routed experts of the output. bf16 (default for an MXFP4 base) | f32: the merged "
                  "experts are written unquantized (no quantization_config), exactly W + s·B·A. "
                  "mxfp4: each merged expert is re-quantized row by row and the re-quantization "
                  "error is printed per layer; it cannot stay exact in MXFP4, and an adapter of a "
                  "few percent of the weights is mostly lost there. Default for an fp32/bf16 "
                  "base: --dtype; mxfp4 needs an MXFP4 base")
      ->check(CLI::IsMember({"mxfp4", "bf16", "f32"}));
  cmd->callback([a] { run_merge(*a); });
}

}  // namespace moe::cli
