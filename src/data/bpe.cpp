#include "data/bpe.h"

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/limits.h"
#include "data/byte_level.h"

namespace moe {

namespace {

using json = nlohmann::json;

json pre_tokenizer_json() {
  return {{"type", "Sequence"},
          {"pretokenizers",
           json::array({{{"type", "Split"},
                         {"pattern", {{"Regex", kPreTokenizerRegex}}},
                         {"behavior", "Isolated"},
                         {"invert", false}},
                        {{"type", "ByteLevel"},
                         {"add_prefix_space", false},
                         {"trim_offsets", true},
                         {"use_regex", false}}})}};
}

json decoder_json() {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
}

}  // namespace

BpeTokenizer::BpeTokenizer(std::vector<std::string> vocab,
                           std::vector<std::pair<int32_t, int32_t>> merges, int32_t end_of_text)
    : vocab_(std::move(vocab)), merges_(std::move(merges)), end_of_text_(end_of_text) {
  const auto n = static_cast<int32_t>(vocab_.size());
  MOE_CHECK(end_of_text_ >= 0 && end_of_text_ < n, "BPE: end-of-text id {} outside the vocabulary of {}",
            end_of_text_, n);
  byte_id_.fill(-1);
  for (int32_t id = 0; id < n; ++id) {
    if (id == end_of_text_) continue;
    const std::string& b = vocab_[static_cast<size_t>(id)];
    MOE_CHECK(!b.empty(), "BPE: token {} is empty", id);
    MOE_CHECK(id_of_.emplace(b, id).second, "BPE: tokens {} and {} are the same bytes", id_of_[b], id);
    if (b.size() == 1) byte_id_[static_cast<unsigned char>(b[0])] = id;
  }
  for (int b = 0; b < 256; ++b)
    MOE_CHECK(byte_id_[static_cast<size_t>(b)] >= 0, "BPE: byte {:#04x} has no token (a byte-level "
              "vocabulary holds all 256)", b);
  for (size_t r = 0; r < merges_.size(); ++r) {
    const auto [a, b] = merges_[r];
    MOE_CHECK(a >= 0 && a < n && b >= 0 && b < n && a != end_of_text_ && b != end_of_text_,
              "BPE: merge {} joins ids outside the vocabulary", r);
    const int32_t merged = id_of(vocab_[static_cast<size_t>(a)] + vocab_[static_cast<size_t>(b)]);
    MOE_CHECK(merged >= 0, "BPE: merge {} ({} + {}) makes a token that is not in the vocabulary", r, a, b);
    // A pair listed twice keeps its first (lowest) rank, as in HF.
    merge_rank_.emplace(merge_pair_key(a, b), std::make_pair(static_cast<int32_t>(r), merged));
  }
}

int32_t BpeTokenizer::id_of(std::string_view bytes) const {
  const auto it = id_of_.find(std::string(bytes));
  return it == id_of_.end() ? -1 : it->second;
}

std::string BpeTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(vocab_.size()) || id == end_of_text_) return {};
  return vocab_[static_cast<size_t>(id)];
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  std::vector<int32_t> sym;
  sym.reserve(piece.size());
  for (char c : piece) sym.push_back(byte_id_[static_cast<unsigned char>(c)]);
  apply_bpe_merges(sym, merge_rank_);
  out.insert(out.end(), sym.begin(), sym.end());
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  // Natural text repeats its words: remember each word's ids for the rest of this text.
  std::unordered_map<std::string_view, std::pair<size_t, size_t>> seen;  // -> range in `out`
  for (std::string_view piece : pre_tokenize(text)) {
    const auto it = seen.find(piece);
    if (it != seen.end()) {
      const auto [begin, len] = it->second;
      for (size_t i = 0; i < len; ++i) {
        const int32_t id = out[begin + i];
        out.push_back(id);
      }
      continue;
    }
    const size_t begin = out.size();
    encode_piece(piece, out);
    seen.emplace(piece, std::make_pair(begin, out.size() - begin));
  }
}

std::string BpeTokenizer::to_json() const {
  json vocab = json::object();
  for (size_t id = 0; id < vocab_.size(); ++id)
    vocab[static_cast<int32_t>(id) == end_of_text_ ? std::string(kEndOfTextToken)
                                                   : byte_level_encode(vocab_[id])] = id;
  json merges = json::array();
  for (const auto& [a, b] : merges_)
    merges.push_back(byte_level_encode(vocab_[static_cast<size_t>(a)]) + " " +
                     byte_level_encode(vocab_[static_cast<size_t>(b)]));
  json j = {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"added_tokens", json::array({{{"id", end_of_text_},
                                           {"content", kEndOfTextToken},
                                           {"single_word", false},
                                           {"lstrip", false},
                                           {"rstrip", false},
                                           {"normalized", false},
                                           {"special", true}}})},
            {"normalizer", nullptr},
            {"pre_tokenizer", pre_tokenizer_json()},
            {"post_processor", nullptr},
            {"decoder", decoder_json()},
            {"model",
             {{"type", "BPE"},
              {"dropout", nullptr},
              {"unk_token", nullptr},
              {"continuing_subword_prefix", nullptr},
              {"end_of_word_suffix", nullptr},
              {"fuse_unk", false},
              {"byte_fallback", false},
              {"vocab", std::move(vocab)},
              {"merges", std::move(merges)}}}};
  // ordered_json would keep this order, but the file only has to be valid HF JSON; HF reads
  // keys by name.
  return j.dump(1) + "\n";
}

BpeTokenizer BpeTokenizer::from_json(const std::string& text, const std::string& source) {
  const json j = json::parse(text, json_depth_limit<json>(source), /*allow_exceptions=*/false);
  MOE_CHECK(j.is_object(), "{}: not a JSON object (expected a Hugging Face tokenizer.json)", source);
  auto bad = [&](const std::string& field, const std::string& expected, const json& got) {
    fail("{}: {}: expected {}, got {}", source, field, expected,
         got.is_null() ? std::string("nothing") : got.dump().substr(0, 200));
  };
  auto at = [&](const json& obj, const char* key) -> const json& {
    static const json null_value;
    return obj.is_object() && obj.contains(key) ? obj.at(key) : null_value;
  };
  const json& model = at(j, "model");
  if (!model.is_object()) bad("model", "an object", model);
  if (at(model, "type") != "BPE") bad("model.type", "\"BPE\"", at(model, "type"));
  // Only the pre-tokenizer and decoder this engine implements give the same ids as HF would.
  if (at(j, "pre_tokenizer") != pre_tokenizer_json())
    bad("pre_tokenizer", "the byte-level Split + ByteLevel sequence `moe tokenizer train` writes",
        at(j, "pre_tokenizer"));
  if (!at(j, "normalizer").is_null()) bad("normalizer", "null", at(j, "normalizer"));

  int32_t eot = -1;
  const json& added = at(j, "added_tokens");
  if (!added.is_array()) bad("added_tokens", "an array", added);
  for (const json& t : added) {
    if (at(t, "content") == kEndOfTextToken && at(t, "id").is_number_integer()) eot = at(t, "id").get<int32_t>();
  }
  if (eot < 0) bad("added_tokens", fmt::format("an entry {{\"content\": \"{}\", \"id\": N}}", kEndOfTextToken), added);

  const json& vocab_json = at(model, "vocab");
  if (!vocab_json.is_object() || vocab_json.empty()) bad("model.vocab", "an object of token -> id", vocab_json);
  const size_t n = vocab_json.size();
  std::vector<std::string> vocab(n);
  std::vector<bool> filled(n, false);
  for (const auto& [token, id_json] : vocab_json.items()) {
    const std::string field = fmt::format("model.vocab[\"{}\"]", token);
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() >= static_cast<int64_t>(n))
      bad(field, fmt::format("an id in [0, {})", n), id_json);
    const auto id = id_json.get<size_t>();
    if (filled[id]) bad(field, "an id no other token has", id_json);
    filled[id] = true;
    if (static_cast<int32_t>(id) == eot) continue;
    if (!byte_level_decode(token, vocab[id]))
      bad(field, "a token of byte-level characters", json(token));
  }
  if (eot >= static_cast<int32_t>(n)) bad("added_tokens", fmt::format("the {} id inside model.vocab (< {})", kEndOfTextToken, n), json(eot));

  std::unordered_map<std::string, int32_t> by_token;
  for (const auto& [token, id] : vocab_json.items()) by_token[token] = id.get<int32_t>();
  const json& merges_json = at(model, "merges");
  if (!merges_json.is_array()) bad("model.merges", "an array", merges_json);
  std::vector<std::pair<int32_t, int32_t>> merges;
  for (size_t r = 0; r < merges_json.size(); ++r) {
    const json& m = merges_json[r];
    const std::string field = fmt::format("model.merges[{}]", r);
    std::string left, right;
    // "a b" (classic) or ["a", "b"] (tokenizers >= 0.20).
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) bad(field, "\"left right\"", m);
      left = s.substr(0, sp), right = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>(), right = m[1].get<std::string>();
    } else {
      bad(field, "\"left right\" or [\"left\", \"right\"]", m);
    }
    const auto l = by_token.find(left), rr = by_token.find(right), joined = by_token.find(left + right);
    if (l == by_token.end() || rr == by_token.end() || joined == by_token.end())
      bad(field, "tokens in model.vocab whose concatenation is in model.vocab too", m);
    merges.emplace_back(l->second, rr->second);
  }
  try {
    return BpeTokenizer(std::move(vocab), std::move(merges), eot);
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
}

bool BpeTokenizer::own_layout(const json& j) {
  if (!j.is_object() || !j.contains("pre_tokenizer") || j.at("pre_tokenizer") != pre_tokenizer_json()) return false;
  if (j.contains("normalizer") && !j.at("normalizer").is_null()) return false;
  const auto it = j.find("added_tokens");
  return it != j.end() && it->is_array() && it->size() == 1 && (*it)[0].is_object() &&
         (*it)[0].value("content", std::string()) == kEndOfTextToken;
}

BpeTokenizer BpeTokenizer::load(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  MOE_CHECK(in.good(), "{}: cannot read the tokenizer file", file.string());
  std::stringstream s;
  s << in.rdbuf();
  return from_json(s.str(), file.string());
}

}  // namespace moe
