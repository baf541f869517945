// A Hugging Face tokenizer.json (and tokenizer_config.json) from arbitrary bytes, then arbitrary
// text encoded with it: the input is the tokenizer.json, a NUL byte, the tokenizer_config.json,
// a NUL byte, and the text (missing parts are empty). Encoding must give ids inside the
// vocabulary, and decoding them must not fail.
#include "data/hf_tokenizer.h"
#include "fuzz_util.h"

using namespace moe;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_at_nuls<3>(fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const HfTokenizer t = HfTokenizer::from_json(std::string(parts[0]), "tokenizer.json", std::string(parts[1]));
    const std::vector<int32_t> ids = t.encode(parts[2]);
    for (int32_t id : ids)
      if (id < 0 || id >= t.vocab_size()) fuzz::finding("encode gave id " + std::to_string(id) + " outside the vocabulary");
    (void)t.decode(ids);
    (void)t.pieces(parts[2]);
    (void)t.eos_id(), (void)t.pad_id(), (void)t.bos_id(), (void)t.add_bos(), (void)t.add_eos();
  });
  return 0;
}
