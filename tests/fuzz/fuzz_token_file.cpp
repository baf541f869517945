// A token-id file of `moe logits`: one sequence of ids per line.
#include "fuzz_util.h"
#include "io/token_file.h"

using namespace moe;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::MemoryFile file(fuzz::as_text(data, size));
  fuzz::expect_ok_or_error([&] {
    const TokenBatch b = read_token_file(file.path());
    if (b.shape.tokens() != b.tokens.numel()) fuzz::finding("the batch shape does not match the ids read");
  });
  return 0;
}
