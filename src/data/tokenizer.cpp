#include "data/tokenizer.h"

namespace moe {

void ByteTokenizer::encode(std::string_view text, std::vector<int32_t>& out) {
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<int32_t>(static_cast<unsigned char>(c)));
}

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<int32_t> out;
  encode(text, out);
  return out;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids)
    if (is_byte(id)) out.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  return out;
}

int64_t padded_vocab_size(int64_t vocab) { return (vocab + 7) / 8 * 8; }

}  // namespace moe
