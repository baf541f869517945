// config.json -> ModelConfig, as `moe info --config`, a load and a conversion read it: the
// config, what it says about the weight files, the parameter and FLOP counts, and the round trip
// through the config.json the engine writes (which must give back the same config).
#include "fuzz_util.h"
#include "io/hf_config.h"

using namespace moe;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::MemoryFile file(fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const HfWeightsInfo w = read_hf_weights_info(file.path());
    for (const char* name : {"model.layers.0.mlp.gate.weight", "model.layers.61.self_attn.q_a_proj.weight",
                             "model.layers.9223372036854775807.x", "model.layers.-1.x", "lm_head.weight"})
      (void)w.mtp_layer_of(name);
    (void)w.fp8_block();
  });
  fuzz::expect_ok_or_error([&] {
    const ModelConfig c = read_hf_config(file.path());
    (void)count_params(c);
    (void)train_flops_per_token(c, 64);
    (void)finetune_flops_per_token(c, 64, 1000.0);
    const nlohmann::json written = model_config_to_json(c);
    ModelConfig again;
    try {
      again = parse_hf_config(written, "written config.json");
    } catch (const Error& e) {
      fuzz::finding(std::string("the config.json written for a valid config does not load: ") + e.what());
    }
    if (model_config_to_json(again) != written)
      fuzz::finding("config.json -> config -> config.json -> config is not lossless");
  });
  return 0;
}
