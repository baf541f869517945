#pragma once
// Byte-level tokenizer: ids 0..255 are the bytes themselves, 256 marks the end of a text. It
// needs no vocabulary file, so any text can be trained on and any id sequence decodes.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

class ByteTokenizer {
 public:
  static constexpr int32_t kEndOfText = 256;
  static constexpr int64_t kVocab = 257;
  // Recorded in checkpoints so a later loader can tell which tokenizer produced the ids.
  static constexpr const char* kKind = "byte";

  // Appends the ids of `text` to `out` (no end-of-text marker).
  static void encode(std::string_view text, std::vector<int32_t>& out);
  static std::vector<int32_t> encode(std::string_view text);
  // End-of-text ids and ids outside the byte range decode to nothing.
  static std::string decode(const std::vector<int32_t>& ids);
  static bool is_byte(int32_t id) { return id >= 0 && id < 256; }
};

// Embedding and head rows are padded to a multiple of 8 so GEMM tiles stay aligned; the extra
// ids are never produced by the tokenizer.
int64_t padded_vocab_size(int64_t vocab);

}  // namespace moe
