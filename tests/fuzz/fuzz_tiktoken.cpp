// A tiktoken tokenizer (Moonlight / Kimi: tiktoken.model and tokenizer_config.json) from
// arbitrary bytes, then arbitrary text encoded with it: the input is the ranks file, a NUL byte,
// the tokenizer_config.json, a NUL byte, and the text (missing parts are empty). Every byte has a
// rank (the loader requires it), so encoding must give ids inside the vocabulary and decoding
// them must give the text back.
#include "data/tiktoken_tokenizer.h"
#include "fuzz_util.h"

using namespace moe;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_at_nuls<3>(fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const TiktokenTokenizer t =
        TiktokenTokenizer::from_text(std::string(parts[0]), "tiktoken.model", std::string(parts[1]));
    const std::vector<int32_t> ids = t.encode(parts[2]);
    for (int32_t id : ids)
      if (id < 0 || id >= t.vocab_size()) fuzz::finding("encode gave id " + std::to_string(id) + " outside the vocabulary");
    if (t.decode(ids) != parts[2]) fuzz::finding("decode(encode(text)) is not the text");
    (void)t.eos_id(), (void)t.pad_id(), (void)t.bos_id(), (void)t.add_bos();
  });
  return 0;
}
