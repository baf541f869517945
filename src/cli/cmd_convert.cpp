// `moe convert`: a model directory in any layout the engine reads -> the engine's preferred
// layout (e.g. DeepSeek's FP8 -> bf16 dense weights + MXFP4 experts), streaming.
#include <fmt/format.h>

#include "cli/commands.h"
#include "core/error.h"
#include "core/memory.h"
#include "io/checkpoint.h"
#include "io/convert_model.h"
#include "io/hf_config.h"
#include "io/v4_checkpoint.h"
#include "model/v4/v4_model.h"

namespace moe::cli {

namespace {

// --layout released: a DeepSeek-V4 model in any layout the engine reads (its own checkpoints,
// `moe merge` output, a released one) written back as DeepSeek releases V4 (io/v4_checkpoint.h):
// FP8 dense weights with E8M0 tile scales, packed MXFP4 experts (--experts mxfp4, as V4-Flash)
// or FP8 experts (--experts f32, as V4-Flash-Base). The model is loaded whole (packed experts stay
// packed), then written tensor by tensor.
void convert_to_released(const std::string& in, const std::string& out,
                         const ConvertOptions& opt) {
  ModelConfig cfg = read_hf_config(in);
  MOE_CHECK(cfg.is_v4(), "--layout released: DeepSeek-V4 models only; {} has model_type \"{}\"",
            in, cfg.model_type);
  MOE_CHECK(opt.experts != "bf16", "--layout released: routed experts are written as MXFP4 "
            "(--experts mxfp4, DeepSeek-V4-Flash) or FP8 (--experts f32, V4-Flash-Base), not bf16");
  check_new_output_dir(in, out);
  cfg.expert_format = opt.experts == "mxfp4" ? "mxfp4" : "fp32";
  DeepSeekV4Model model(cfg);
  load_weights(in, model.params());
  const V4SaveSummary s = save_v4_released(out, cfg, model.params(), opt.max_shard_bytes);
  copy_side_files(in, out);
  fmt::print("{} file{} written to {} in DeepSeek's V4 layout: {} FP8, {} MXFP4, {} BF16, {} F32 "
             "weights, {} hash-table ids; {} of tensor data\n", s.files, s.files == 1 ? "" : "s",
             out, s.fp8, s.mxfp4, s.bf16, s.f32, s.ids, format_bytes(s.bytes));
}

}  // namespace

void add_convert_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "convert", "write a copy of a model in the engine's preferred layout (non-expert weights "
                 "bf16 or f32, routed experts MXFP4, bf16 or f32; FP8 dequantized), so a later "
                 "load is a plain read");
  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto opt = std::make_shared<ConvertOptions>();
  cmd->add_option("--model", *in, "model directory (config.json + safetensors)")->required();
  cmd->add_option("--out", *out, "new model directory (must not exist, or be empty)")->required();
  cmd->add_option("--dtype", opt->dtype, "non-expert weights: bf16 or f32")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  cmd->add_option("--experts", opt->experts, "routed experts: mxfp4, bf16 or f32")
      ->check(CLI::IsMember({"mxfp4", "bf16", "f32"}))
      ->capture_default_str();
  auto layout = std::make_shared<std::string>("engine");
  cmd->add_option("--layout", *layout,
                  "engine: the layout above; released: DeepSeek-V4's release layout (FP8 dense "
                  "weights with E8M0 tile scales, experts as --experts says; --dtype unused)")
      ->check(CLI::IsMember({"engine", "released"}))
      ->capture_default_str();
  cmd->add_option("--max-shard-bytes", opt->max_shard_bytes,
                  "largest output file before a new shard starts")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->callback([in, out, opt, layout] {
    if (*layout == "released") return convert_to_released(*in, *out, *opt);
    bool header = false;
    const ConvertReport r = convert_model(*in, *out, *opt, [&](const QuantizeLayerStats& s) {
      if (!header)
        fmt::print("{:>6}  {:>8}  {:>12}  {:>14}  {:>13}\n", "layer", "matrices", "weights",
                   "rel RMS error", "max |error|");
      header = true;
      fmt::print("{:>6}  {:>8}  {:>12}  {:>14.4e}  {:>13.4e}\n", s.layer, s.matrices, s.weights,
                 s.rel_rms_error, s.max_abs_error);
    });
    for (const std::string& n : r.notices) fmt::print("note: {}\n", n);
    fmt::print("{} tensors ({} FP8 weights dequantized): {} -> {}; routed experts {} -> {}\n",
               r.tensors, r.fp8_dequantized, format_bytes(r.bytes_in), format_bytes(r.bytes_out),
               format_bytes(r.expert_bytes_in), format_bytes(r.expert_bytes_out));
    fmt::print("{} file{} written to {} (non-expert weights {}, experts {})\n", r.files,
               r.files == 1 ? "" : "s", *out, opt->dtype, opt->experts);
    const MemSnapshot mem = MemoryTracker::instance().snapshot();
    fmt::print("peak tracked memory: {} (streamed tensor by tensor)\n",
               format_bytes(mem.total_peak()));
  });
}

}  // namespace moe::cli
