#include "data/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/limits.h"
#include "data/bpe.h"
#include "data/documents.h"
#include "data/hf_tokenizer.h"
#include "data/tiktoken_tokenizer.h"

namespace moe {

namespace {

class ByteLevelIds final : public Tokenizer {
 public:
  using Tokenizer::encode;
  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    ByteTokenizer::encode(text, out);
  }
  std::string token_bytes(int32_t id) const override {
    return ByteTokenizer::is_byte(id) ? std::string(1, static_cast<char>(static_cast<unsigned char>(id)))
                                      : std::string();
  }
  int64_t vocab_size() const override { return ByteTokenizer::kVocab; }
  int32_t end_of_text() const override { return ByteTokenizer::kEndOfText; }
  std::string kind() const override { return ByteTokenizer::kKind; }
};

}  // namespace

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode(text, out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

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

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteLevelIds>(); }

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == ByteTokenizer::kKind) return make_byte_tokenizer();
  namespace fs = std::filesystem;
  fs::path file = spec;
  // Moonlight / Kimi: tiktoken.model (a directory holding one, or the file itself).
  if (TiktokenTokenizer::recognizes(file)) return std::make_unique<TiktokenTokenizer>(TiktokenTokenizer::load(file));
  if (fs::is_directory(file)) file /= "tokenizer.json";
  const std::string text = read_text_file_capped(file, "the tokenizer");
  const nlohmann::json j =
      nlohmann::json::parse(text, json_depth_limit<nlohmann::json>(file.string()), /*allow_exceptions=*/false);
  // The engine's own files keep their own reader (ids are the same either way, tested).
  if (j.is_discarded() || BpeTokenizer::own_layout(j))
    return std::make_unique<BpeTokenizer>(BpeTokenizer::from_json(text, file.string()));
  const fs::path config = file.parent_path() / "tokenizer_config.json";
  const std::string config_text =
      fs::is_regular_file(config) ? read_text_file_capped(config, "the tokenizer config") : "";
  return std::make_unique<HfTokenizer>(HfTokenizer::from_parsed(j, file.string(), config_text, config.string()));
}

int64_t padded_vocab_size(int64_t vocab) { return (vocab + 7) / 8 * 8; }

}  // namespace moe
