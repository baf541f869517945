// The TOML of `moe train` / `moe finetune`, read for both purposes: the configuration, its
// round trip through train_config_to_toml (which must parse back to the same text), the LoRA
// settings of a fine-tune, and the model it resolves to when [model] names a built-in preset
// (a path there would make the fuzzer read this machine's files).
#include <algorithm>

#include "fuzz_util.h"
#include "model/presets.h"
#include "train/train_config.h"

using namespace moe;

namespace {

bool builtin_preset(const std::string& name) {
  const auto& presets = model_presets();
  return std::any_of(presets.begin(), presets.end(), [&](const ModelPreset& p) { return p.name == name; }) &&
         !std::filesystem::exists(name);
}

void check(const std::string& text, ConfigPurpose purpose) {
  fuzz::expect_ok_or_error([&] {
    const TrainConfig c = parse_train_config(text, "fuzz.toml", {}, purpose);
    const std::string written = train_config_to_toml(c);
    std::string again;
    try {
      again = train_config_to_toml(parse_train_config(written, "written.toml", {}, purpose));
    } catch (const Error& e) {
      fuzz::finding(std::string("the TOML written for a valid config does not parse: ") + e.what() +
                    "\n" + written);
    }
    if (again != written) fuzz::finding("train_config_to_toml does not round-trip:\n" + written + "\n" + again);
    if (c.finetune) (void)lora_settings(c).shape_for(true);
    if (builtin_preset(c.model.preset)) (void)resolve_train_model(c, 256, 0);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(fuzz::as_text(data, size));
  check(text, ConfigPurpose::Pretrain);
  check(text, ConfigPurpose::Finetune);
  return 0;
}
