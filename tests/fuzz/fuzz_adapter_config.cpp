// A PEFT adapter_config.json, read as `moe generate --adapter` and `moe merge` read it, then
// matched against a DeepSeek model's module and parameter names as add_lora matches them.
#include "fuzz_util.h"
#include "lora/peft_adapter.h"

using namespace moe;

namespace {

const char* const kModules[] = {
    "model.layers.0.self_attn.q_a_proj",      "model.layers.0.self_attn.q_b_proj",
    "model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.0.self_attn.kv_b_proj",
    "model.layers.0.self_attn.o_proj",        "model.layers.0.mlp.gate_proj",
    "model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.15.down_proj",
    "model.layers.1.mlp.shared_experts.up_proj", "layers.2.attn.wo_a",
};
const char* const kParameters[] = {"model.layers.1.mlp.experts.gate_up_proj",
                                   "model.layers.1.mlp.experts.down_proj"};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path dir = fuzz::scratch_dir() / "adapter";
  static const bool made = std::filesystem::create_directories(dir);
  (void)made;
  fuzz::write_file(dir / kAdapterConfigFile, fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const LoraSettings s = read_peft_adapter_config(dir);
    (void)s.shape_for(false);
    (void)s.shape_for(true);
    LoraTargetMatcher matcher(s);
    for (const char* m : kModules) (void)matcher.matches(m), (void)matcher.names(m);
    for (const char* p : kParameters) (void)matcher.matches_parameter(p);
    (void)matcher.first_unused();
    matcher.check_all_used("adapter_config.json");
  });
  return 0;
}
