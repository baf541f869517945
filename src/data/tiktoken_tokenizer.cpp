#include "data/tiktoken_tokenizer.h"

#include <algorithm>
#include <array>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "core/error.h"
#include "core/limits.h"
#include "data/documents.h"
#include "data/tokenizer_text.h"

namespace moe {

const char* const TiktokenTokenizer::kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

const char* const TiktokenTokenizer::kCl100kPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

// ------------------------------------------------------------------ pattern translation

// Unicode White_Space (what Rust's `regex` means by \s), as class members.
constexpr const char* kWhiteSpaceMembers =
    R"(\x{9}-\x{D}\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// Reads a bracketed class starting at p[i] == '[' (nested classes allowed); returns the index
// one past its closing ']'.
size_t class_end(std::string_view p, size_t i) {
  int depth = 0;
  for (size_t j = i; j < p.size(); ++j) {
    if (p[j] == '\\') {
      ++j;
      continue;
    }
    if (p[j] == '[') {
      ++depth;
      if (j + 1 < p.size() && p[j + 1] == '^') ++j;
      if (j + 1 < p.size() && p[j + 1] == ']') ++j;  // a leading ']' is literal
    } else if (p[j] == ']') {
      if (--depth == 0) return j + 1;
    }
  }
  throw std::runtime_error("unterminated character class");
}

std::string translate(std::string_view p);

// The inside of a class (no brackets): \s and \S spelled out, \p{Han} as the script.
std::string translate_class_body(std::string_view body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] == '\\' && i + 1 < body.size()) {
      const char c = body[i + 1];
      if (c == 's') {
        out += kWhiteSpaceMembers;
        ++i;
        continue;
      }
      if (c == 'S') throw std::runtime_error("\\S inside a character class is not supported");
      if (c == 'p' || c == 'P') {
        const size_t close = body.find('}', i);
        if (close == std::string_view::npos) throw std::runtime_error("unterminated \\p{...}");
        std::string name(body.substr(i + 3, close - i - 3));
        if (name == "Han") name = "sc:Han";  // Rust: the Script; PCRE2's bare name: Script_Extensions
        out += fmt::format("\\{}{{{}}}", c, name);
        i = close;
        continue;
      }
      out += body.substr(i, 2);
      ++i;
      continue;
    }
    if (body[i] == '[') throw std::runtime_error("nested character classes are only supported as `[A&&[^B]]`");
    out += body[i];
  }
  return out;
}

// One class `[...]` of the Rust syntax as PCRE2: `[A&&[^B]]` -> (?:(?![B])[A]).
std::string translate_class(std::string_view cls) {
  std::string_view body = cls.substr(1, cls.size() - 2);
  bool negated = false;
  if (!body.empty() && body[0] == '^') {
    negated = true;
    body.remove_prefix(1);
  }
  const size_t amp = body.find("&&");
  if (amp == std::string_view::npos) return std::string(negated ? "[^" : "[") + translate_class_body(body) + "]";
  if (negated) throw std::runtime_error("negated class intersections are not supported");
  const std::string_view left = body.substr(0, amp);
  std::string_view right = body.substr(amp + 2);
  if (right.size() < 3 || right.substr(0, 2) != "[^" || right.back() != ']')
    throw std::runtime_error("class intersections are only supported as `[A&&[^B]]`");
  right = right.substr(2, right.size() - 3);
  return "(?:(?![" + translate_class_body(right) + "])[" + translate_class_body(left) + "])";
}

// tiktoken's pattern syntax (Rust `regex` / fancy-regex) -> PCRE2 with UTF + UCP.
std::string translate(std::string_view p) {
  std::string out;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      if (n == 's') {
        out += std::string("[") + kWhiteSpaceMembers + "]";
      } else if (n == 'S') {
        out += std::string("[^") + kWhiteSpaceMembers + "]";
      } else if (n == 'p' || n == 'P') {
        const size_t close = p.find('}', i);
        if (close == std::string_view::npos) throw std::runtime_error("unterminated \\p{...}");
        out += translate_class_body(p.substr(i, close - i + 1));
        i = close;
        continue;
      } else {
        out += p.substr(i, 2);
      }
      ++i;
      continue;
    }
    if (c == '[') {
      const size_t e = class_end(p, i);
      out += translate_class(p.substr(i, e - i));
      i = e - 1;
      continue;
    }
    out += c;
  }
  return out;
}

// Standard base64 (tiktoken.model's alphabet), '=' padding optional.
bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char ch : in) {
    int v;
    if (ch >= 'A' && ch <= 'Z') v = ch - 'A';
    else if (ch >= 'a' && ch <= 'z') v = ch - 'a' + 26;
    else if (ch >= '0' && ch <= '9') v = ch - '0' + 52;
    else if (ch == '+') v = 62;
    else if (ch == '/') v = 63;
    else if (ch == '=') break;
    else return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return true;
}

}  // namespace

// ------------------------------------------------------------------ Impl

struct TiktokenTokenizer::Impl {
  std::string pattern;
  std::unique_ptr<Pcre2Pattern> regex;
  StringMap<int32_t> ranks;
  std::vector<std::string> bytes_of;  // by rank; "" for holes
  int64_t n_ranks = 0;                // largest rank + 1
  std::map<int32_t, std::string> special_by_id;
  StringMap<int32_t> special_by_text;
  // Special-token matching without a scan per token: the bytes a special may start with, and the
  // distinct special lengths, longest first (a match is a hash lookup per length).
  std::array<bool, 256> special_first_byte{};
  std::vector<size_t> special_lengths;
  int32_t bos = -1, eos = -1, pad = -1;
  bool add_bos = false;


  void compile() {
    std::string pcre;
    try {
      pcre = translate(pattern);
    } catch (const std::exception& e) {
      fail("tiktoken pattern {}: {}", pattern, e.what());
    }
    try {
      regex = std::make_unique<Pcre2Pattern>(pcre, 0);
    } catch (const std::runtime_error& e) {
      fail("tiktoken pattern: {}: {}", pcre, e.what());
    }
  }

  int32_t rank(std::string_view b) const {
    const auto it = ranks.find(b);
    return it == ranks.end() ? -1 : it->second;
  }

  // tiktoken's byte_pair_merge: merge the adjacent pair of parts whose joined bytes have the
  // lowest rank (the leftmost of equals) until no pair has a rank. A heap of candidate pairs and a
  // linked list of parts make it O(n log n) instead of tiktoken's O(n^2): a piece may be a
  // megabyte of one letter in a hostile request. Candidates made stale by a merge are skipped
  // when popped, so the merges and their order are tiktoken's.
  void byte_pair_encode(std::string_view piece, std::vector<int32_t>& out) const {
    if (const int32_t r = rank(piece); r >= 0) {
      out.push_back(r);
      return;
    }
    // Part i starts at byte i (a merge removes the right part, never moves a start) and ends where
    // the next live part starts; `rank` is that of part i joined with the next, -1 for none.
    struct Part {
      uint32_t next, prev;
      int32_t rank;
    };
    MOE_CHECK(piece.size() < std::numeric_limits<uint32_t>::max(), "tiktoken: a {}-byte piece (the limit is 4 GiB)",
              piece.size());
    const auto n = static_cast<uint32_t>(piece.size());
    std::vector<Part> parts(n + 1);
    for (uint32_t i = 0; i <= n; ++i) parts[i] = {i + 1, i - 1, -1};
    struct Candidate {
      int32_t rank;
      uint32_t part;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : part > o.part; }
    };
    std::vector<Candidate> heap;
    heap.reserve(n);
    auto rerank = [&](uint32_t i) {
      Part& p = parts[i];
      p.rank = p.next < n ? rank(piece.substr(i, parts[p.next].next - i)) : -1;
      if (p.rank >= 0) {
        heap.push_back({p.rank, i});
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
      }
    };
    for (uint32_t i = 0; i < n; ++i) rerank(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      const Candidate c = heap.back();
      heap.pop_back();
      Part& p = parts[c.part];
      if (p.next == 0 || p.rank != c.rank) continue;  // merged away, or re-ranked since
      const uint32_t gone = p.next;
      p.next = parts[gone].next;
      parts[p.next].prev = c.part;
      parts[gone].next = 0;
      rerank(c.part);
      if (c.part > 0) rerank(p.prev);
    }
    for (uint32_t i = 0; i < n; i = parts[i].next) {
      const int32_t r = rank(piece.substr(i, parts[i].next - i));
      MOE_CHECK(r >= 0, "tiktoken: no rank for a {}-byte part (the vocabulary lacks a single byte)", parts[i].next - i);
      out.push_back(r);
    }
  }

  // Regex pieces of `s` (no special tokens in it); invalid UTF-8 bytes are pieces of their own.
  template <typename F>
  void for_each_piece(std::string_view s, F&& f) const {
    size_t i = 0;
    while (i < s.size()) {
      // The longest valid UTF-8 run from i.
      size_t j = i;
      while (j < s.size()) {
        const size_t n = utf8_char_len(s, j);
        if (n == 0) break;
        j += n;
      }
      if (j > i) regex_pieces(s.substr(i, j - i), f);
      if (j < s.size()) {
        f(s.substr(j, 1));
        ++j;
      }
      i = j;
    }
  }

  // Every match left to right (text between matches is dropped, as tiktoken drops it).
  template <typename F>
  void regex_pieces(std::string_view s, F&& f) const {
    size_t from = 0, begin = 0, end = 0;
    while (from < s.size()) {
      if (!regex->find(s, from, begin, end, "tiktoken regex")) break;
      if (end == begin) {  // an empty match: step one character
        from = begin + std::max<size_t>(1, utf8_char_len(s, begin));
        continue;
      }
      f(s.substr(begin, end - begin));
      from = end;
    }
  }

  // The next special token at or after `from`: leftmost, the longest there.
  bool next_special(std::string_view text, size_t from, size_t& at, int32_t& id) const {
    for (size_t p = from; p < text.size(); ++p) {
      if (!special_first_byte[static_cast<unsigned char>(text[p])]) continue;
      for (size_t len : special_lengths) {
        if (len > text.size() - p) continue;
        const auto it = special_by_text.find(text.substr(p, len));
        if (it == special_by_text.end()) continue;
        at = p;
        id = it->second;
        return true;
      }
    }
    return false;
  }

  template <typename F>
  void segments(std::string_view text, F&& f) const {  // f(piece, special_id or -1)
    size_t pos = 0;
    while (pos <= text.size()) {
      size_t at = 0;
      int32_t id = -1;
      const bool found = !special_lengths.empty() && next_special(text, pos, at, id);
      const size_t end = found ? at : text.size();
      for_each_piece(text.substr(pos, end - pos), [&](std::string_view p) { f(p, -1); });
      if (!found) break;
      f(text.substr(at, special_by_id.at(id).size()), id);
      pos = at + special_by_id.at(id).size();
    }
  }
};

TiktokenTokenizer::TiktokenTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TiktokenTokenizer::~TiktokenTokenizer() = default;
TiktokenTokenizer::TiktokenTokenizer(TiktokenTokenizer&&) noexcept = default;
TiktokenTokenizer& TiktokenTokenizer::operator=(TiktokenTokenizer&&) noexcept = default;

bool TiktokenTokenizer::recognizes(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  // A directory that also has a tokenizer.json is left to the Hugging Face reader (it names its
  // own pattern).
  if (fs::is_directory(path))
    return fs::is_regular_file(path / "tiktoken.model") && !fs::exists(path / "tokenizer.json");
  return path.filename() == "tiktoken.model" || path.extension() == ".tiktoken";
}

TiktokenTokenizer TiktokenTokenizer::load(const std::filesystem::path& path, const std::string& pattern) {
  namespace fs = std::filesystem;
  const fs::path file = fs::is_directory(path) ? path / "tiktoken.model" : path;
  const std::string ranks = read_text_file_capped(file, "the tiktoken ranks");
  const fs::path config = file.parent_path() / "tokenizer_config.json";
  std::string config_text;
  if (fs::is_regular_file(config)) config_text = read_text_file_capped(config, "the tokenizer config");
  return from_text(ranks, file.string(), config_text, config.string(), pattern);
}

TiktokenTokenizer TiktokenTokenizer::from_text(const std::string& ranks_text, const std::string& source,
                                               const std::string& config_json, const std::string& config_source,
                                               const std::string& pattern) {
  auto impl = std::make_unique<Impl>();
  impl->pattern = pattern;
  impl->compile();

  // `<base64> <rank>` per line (tiktoken.load.load_tiktoken_bpe); blank lines are skipped.
  std::string bytes;
  size_t line_no = 0;
  for (size_t pos = 0; pos < ranks_text.size();) {
    size_t nl = ranks_text.find('\n', pos);
    if (nl == std::string::npos) nl = ranks_text.size();
    std::string_view line(ranks_text.data() + pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    MOE_CHECK(sp != std::string_view::npos, "{}:{}: expected `<base64 token> <rank>`", source, line_no);
    MOE_CHECK(base64_decode(line.substr(0, sp), bytes) && !bytes.empty(), "{}:{}: invalid base64 token", source,
              line_no);
    const std::string_view num = line.substr(sp + 1);
    int64_t r = 0;
    MOE_CHECK(!num.empty() && num.size() <= 10 && std::all_of(num.begin(), num.end(), [](char c) {
                return c >= '0' && c <= '9';
              }), "{}:{}: invalid rank `{}`", source, line_no, num);
    for (char c : num) r = r * 10 + (c - '0');
    MOE_CHECK(r < std::numeric_limits<int32_t>::max() / 2, "{}:{}: rank {} is too large", source, line_no, r);
    const auto [it, inserted] = impl->ranks.emplace(bytes, static_cast<int32_t>(r));
    MOE_CHECK(inserted, "{}:{}: token repeated (rank {} and {})", source, line_no, it->second, r);
    if (static_cast<int64_t>(impl->bytes_of.size()) <= r) {
      check_load_bytes(source, fmt::format("line {}: the table up to rank {}", line_no, r),
                       (r + 1) * static_cast<int64_t>(sizeof(std::string)));
      impl->bytes_of.resize(static_cast<size_t>(r) + 1);
    }
    MOE_CHECK(impl->bytes_of[static_cast<size_t>(r)].empty(), "{}:{}: rank {} repeated", source, line_no, r);
    impl->bytes_of[static_cast<size_t>(r)] = bytes;
  }
  MOE_CHECK(!impl->ranks.empty(), "{}: no ranks", source);
  impl->n_ranks = static_cast<int64_t>(impl->bytes_of.size());
  for (int b = 0; b < 256; ++b)
    MOE_CHECK(impl->ranks.count(std::string(1, static_cast<char>(b))), "{}: byte 0x{:02X} has no rank", source, b);

  if (!config_json.empty()) {
    const nlohmann::json cfg =
        nlohmann::json::parse(config_json, json_depth_limit<nlohmann::json>(config_source), /*allow_exceptions=*/false);
    MOE_CHECK(!cfg.is_discarded() && cfg.is_object(), "{}: not a JSON object", config_source);
    auto add_special = [&](int64_t id, const std::string& text, const std::string& where) {
      MOE_CHECK(id >= 0 && id < std::numeric_limits<int32_t>::max() / 2, "{}: {}: invalid id {}", config_source,
                where, id);
      MOE_CHECK(!text.empty(), "{}: {}: empty token", config_source, where);
      MOE_CHECK(id >= impl->n_ranks || impl->bytes_of[static_cast<size_t>(id)].empty(),
                "{}: {}: id {} is a rank of the tiktoken file", config_source, where, id);
      const auto [it, inserted] = impl->special_by_text.emplace(text, static_cast<int32_t>(id));
      MOE_CHECK(inserted || it->second == id, "{}: {}: `{}` has two ids ({} and {})", config_source, where, text,
                it->second, id);
      const auto [at, fresh] = impl->special_by_id.emplace(static_cast<int32_t>(id), text);
      MOE_CHECK(fresh || at->second == text, "{}: {}: id {} has two tokens (`{}` and `{}`)", config_source, where,
                id, at->second, text);
    };
    if (cfg.contains("added_tokens_decoder")) {
      const nlohmann::json& added = cfg.at("added_tokens_decoder");
      MOE_CHECK(added.is_object(), "{}: added_tokens_decoder: expected an object", config_source);
      for (const auto& [key, v] : added.items()) {
        // Digits only: stoll would also read " 7", "+7" or "07" as 7, and a second key for the
        // same id would give it a second text.
        const bool digits = !key.empty() && key.size() <= 10 && (key.size() == 1 || key[0] != '0') &&
                            std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
        MOE_CHECK(digits, "{}: added_tokens_decoder: key `{}` is not a token id (expected decimal digits)",
                  config_source, key);
        add_special(std::stoll(key), config_token_text(v), "added_tokens_decoder." + key);
      }
    }
    // tokenization_moonshot.py: every slot of [n_ranks, n_ranks + 256) is a special token.
    for (int64_t id = impl->n_ranks; id < impl->n_ranks + kNumReservedSpecialTokens; ++id)
      if (!impl->special_by_id.count(static_cast<int32_t>(id)))
        add_special(id, fmt::format("<|reserved_token_{}|>", id), "reserved slot");
    auto id_of = [&](const char* field, const char* fallback) -> int32_t {
      std::string text = cfg.contains(field) ? config_token_text(cfg.at(field)) : std::string();
      if (text.empty()) text = fallback;
      const auto it = impl->special_by_text.find(text);
      if (it != impl->special_by_text.end()) return it->second;
      MOE_CHECK(!cfg.contains(field) || cfg.at(field).is_null(), "{}: {}: `{}` is not a special token",
                config_source, field, text);
      return -1;
    };
    impl->bos = id_of("bos_token", "[BOS]");
    impl->eos = id_of("eos_token", "[EOS]");
    impl->pad = id_of("pad_token", "[PAD]");
    if (cfg.contains("add_bos_token")) {
      MOE_CHECK(cfg.at("add_bos_token").is_boolean(), "{}: add_bos_token: expected true or false", config_source);
      impl->add_bos = cfg.at("add_bos_token").get<bool>() && impl->bos >= 0;
    }
  }
  for (const auto& [text, id] : impl->special_by_text) {
    impl->special_first_byte[static_cast<unsigned char>(text[0])] = true;
    impl->special_lengths.push_back(text.size());
  }
  std::sort(impl->special_lengths.begin(), impl->special_lengths.end(), std::greater<>());
  impl->special_lengths.erase(std::unique(impl->special_lengths.begin(), impl->special_lengths.end()),
                              impl->special_lengths.end());
  return TiktokenTokenizer(std::move(impl));
}

void TiktokenTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  impl_->segments(text, [&](std::string_view piece, int32_t special) {
    if (special >= 0)
      out.push_back(special);
    else
      impl_->byte_pair_encode(piece, out);
  });
}

std::vector<std::string> TiktokenTokenizer::pieces(std::string_view text) const {
  std::vector<std::string> out;
  impl_->segments(text, [&](std::string_view piece, int32_t) { out.emplace_back(piece); });
  return out;
}

std::string TiktokenTokenizer::token_bytes(int32_t id) const {
  // A special id may also sit in a gap of the ranks (the loader allows that, not a clash).
  if (const auto it = impl_->special_by_id.find(id); it != impl_->special_by_id.end()) return it->second;
  if (id >= 0 && id < impl_->n_ranks) return impl_->bytes_of[static_cast<size_t>(id)];
  return {};
}

int64_t TiktokenTokenizer::vocab_size() const {
  int64_t n = impl_->n_ranks;
  if (!impl_->special_by_id.empty()) n = std::max<int64_t>(n, impl_->special_by_id.rbegin()->first + 1);
  return n;
}

int32_t TiktokenTokenizer::end_of_text() const { return impl_->eos; }
int32_t TiktokenTokenizer::bos_id() const { return impl_->bos; }
bool TiktokenTokenizer::add_bos() const { return impl_->add_bos; }
int32_t TiktokenTokenizer::eos_id() const { return impl_->eos; }
int32_t TiktokenTokenizer::pad_id() const { return impl_->pad; }
int64_t TiktokenTokenizer::num_ranks() const { return impl_->n_ranks; }
const std::string& TiktokenTokenizer::pattern() const { return impl_->pattern; }

bool TiktokenTokenizer::is_special(int32_t id) const { return impl_->special_by_id.count(id) > 0; }

int32_t TiktokenTokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->special_by_text.find(token); it != impl_->special_by_text.end()) return it->second;
  return impl_->rank(token);
}

}  // namespace moe
