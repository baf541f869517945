#include "data/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <shared_mutex>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <cctype>

#include "core/error.h"
#include "core/limits.h"
#include "data/byte_level.h"
#include "data/documents.h"
#include "data/tokenizer_text.h"

namespace moe {

namespace {

using json = nlohmann::json;

// ------------------------------------------------------------------ UTF-8

// Length of the character at s[i] for stepping through text already known to be UTF-8.
size_t char_len_at(std::string_view s, size_t i) {
  const size_t n = utf8_char_len(s, i);
  return n == 0 ? 1 : n;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_char_len(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

template <typename V>
using StrMap = StringMap<V>;

// ------------------------------------------------------------------ regular expressions

// Oniguruma (what `tokenizers` compiles patterns with, Ruby syntax) -> PCRE2 with UTF + UCP.
// The classes whose meaning differs are spelled out: Oniguruma's \s is White_Space (PCRE2's
// adds U+180E), its \w is Letter | Mark | Decimal_Number | Connector_Punctuation (PCRE2 10.42's
// is L | N | _), and its \h is a hex digit (PCRE2's is horizontal space).
constexpr const char* kOnigSpace = "\\t-\\r\\x{85}\\p{Z}";
constexpr const char* kOnigWord = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
constexpr const char* kOnigHex = "0-9A-Fa-f";

std::string translate_onig(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  size_t class_start = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      ++i;
      auto cls = [&](const char* body, bool negated) {
        if (in_class) {
          if (negated)
            throw std::runtime_error(fmt::format("\\{} inside a character class is not supported", e));
          out += body;
        } else {
          out += negated ? "[^" : "[";
          out += body;
          out += "]";
        }
      };
      switch (e) {
        case 's': cls(kOnigSpace, false); break;
        case 'S': cls(kOnigSpace, true); break;
        case 'w': cls(kOnigWord, false); break;
        case 'W': cls(kOnigWord, true); break;
        case 'h': cls(kOnigHex, false); break;
        case 'H': cls(kOnigHex, true); break;
        case 'u': {  // \uHHHH
          const std::string_view hex = p.substr(i + 1, 4);
          if (hex.size() == 4 && std::all_of(hex.begin(), hex.end(), [](char h) {
                return std::isxdigit(static_cast<unsigned char>(h)) != 0;
              })) {
            out += "\\x{";
            out += hex;
            out += "}";
            i += 4;
          } else {
            out += "\\u";
          }
          break;
        }
        default: {
          out += '\\';
          // Copy the escaped character whole (it may be multi-byte).
          const size_t n = char_len_at(p, i);
          out += p.substr(i, n);
          i += n - 1;
        }
      }
      continue;
    }
    if (in_class) {
      if (c == '[') {
        if (i + 1 < p.size() && p[i + 1] == ':') {  // POSIX bracket [:alpha:]
          const size_t close = p.find(":]", i + 2);
          if (close == std::string_view::npos) throw std::runtime_error("unterminated [: in a class");
          out += p.substr(i, close + 2 - i);
          i = close + 1;
          continue;
        }
        throw std::runtime_error("nested character classes (Oniguruma set operations) are not supported");
      }
      if (c == '&' && i + 1 < p.size() && p[i + 1] == '&')
        throw std::runtime_error("character class intersection (&&) is not supported");
      if (c == ']' && i > class_start) {
        in_class = false;
      }
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      size_t k = i + 1;
      if (k < p.size() && p[k] == '^') out += p[k++];
      class_start = k;
      if (k < p.size() && p[k] == ']') {
        out += "\\]";
        ++k;
        class_start = k;
      }
      i = k - 1;
      continue;
    }
    out += c;
  }
  return out;
}

class Regex {
 public:
  // `onig`: the pattern as tokenizer.json has it (Oniguruma syntax). Throws runtime_error.
  explicit Regex(std::string_view onig, bool translate = true)
      : pattern_(translate ? translate_onig(onig) : std::string(onig), PCRE2_MULTILINE) {}

  // The first match at or after `from` (a character boundary of valid UTF-8 `s`).
  bool find(std::string_view s, size_t from, size_t& begin, size_t& end) const {
    return pattern_.find(s, from, begin, end, "tokenizer regex");
  }

  // Every match, as Oniguruma's find_iter (the `onig` crate) gives them: left to right, not
  // overlapping; an empty match right where the previous one ended is skipped.
  template <typename F>
  void for_each_match(std::string_view s, F&& f) const {
    size_t last_end = 0;
    std::optional<size_t> last_match_end;
    while (last_end <= s.size()) {
      size_t b = 0, e = 0;
      if (!find(s, last_end, b, e)) break;
      if (b == e && last_match_end && *last_match_end == e) {
        last_end += last_end < s.size() ? char_len_at(s, last_end) : 1;
        continue;
      }
      last_end = e;  // after an empty match the next search finds it again and skips a character
      last_match_end = e;
      f(b, e);
    }
  }

 private:
  Pcre2Pattern pattern_;
};

// ------------------------------------------------------------------ splitting (HF semantics)

struct Span {
  size_t begin, end;
  bool match;
};

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// `Pattern::find_matches` for a regex: the whole text as matched and unmatched spans.
void regex_spans(const Regex& re, std::string_view s, std::vector<Span>& spans) {
  spans.clear();
  if (s.empty()) {
    spans.push_back({0, 0, false});
    return;
  }
  size_t prev = 0;
  re.for_each_match(s, [&](size_t b, size_t e) {
    if (prev != b) spans.push_back({prev, b, false});
    spans.push_back({b, e, true});
    prev = e;
  });
  if (prev != s.size()) spans.push_back({prev, s.size(), false});
}

void literal_spans(std::string_view lit, std::string_view s, std::vector<Span>& spans) {
  spans.clear();
  if (s.empty()) {
    spans.push_back({0, 0, false});
    return;
  }
  size_t prev = 0;
  for (size_t at = s.find(lit); at != std::string_view::npos; at = s.find(lit, at + lit.size())) {
    if (prev != at) spans.push_back({prev, at, false});
    spans.push_back({at, at + lit.size(), true});
    prev = at + lit.size();
  }
  if (prev != s.size()) spans.push_back({prev, s.size(), false});
}

// `NormalizedString::split`: the pieces that `behavior` keeps, empty ones dropped.
template <typename Emit>
void split_spans(std::vector<Span>& spans, Behavior behavior, bool invert, std::string_view s,
                 Emit&& emit) {
  if (invert)
    for (Span& sp : spans) sp.match = !sp.match;
  std::vector<Span> out;
  out.reserve(spans.size());
  bool previous_match = false;
  switch (behavior) {
    case Behavior::Isolated:
      for (const Span& sp : spans) out.push_back({sp.begin, sp.end, false});
      break;
    case Behavior::Removed:
      for (const Span& sp : spans) out.push_back(sp);
      break;
    case Behavior::Contiguous:
      for (const Span& sp : spans) {
        if (sp.match == previous_match && !out.empty())
          out.back().end = sp.end;
        else
          out.push_back({sp.begin, sp.end, false});
        previous_match = sp.match;
      }
      break;
    case Behavior::MergedWithPrevious:
      for (const Span& sp : spans) {
        if (sp.match && !previous_match && !out.empty())
          out.back().end = sp.end;
        else
          out.push_back({sp.begin, sp.end, false});
        previous_match = sp.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (size_t k = spans.size(); k-- > 0;) {
        const Span& sp = spans[k];
        if (sp.match && !previous_match && !out.empty())
          out.back().begin = sp.begin;
        else
          out.push_back({sp.begin, sp.end, false});
        previous_match = sp.match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  for (const Span& sp : out)
    if (!sp.match && sp.end > sp.begin) emit(s.substr(sp.begin, sp.end - sp.begin));
}

// ------------------------------------------------------------------ JSON helpers

struct Reader {
  std::string source;
  [[noreturn]] void bad(const std::string& field, const std::string& expected, const json& got) const {
    fail("{}: {}: expected {}, got {}", source, field, expected,
         got.is_null() ? std::string("nothing") : got.dump().substr(0, 200));
  }
  static const json& at(const json& obj, const char* key) {
    static const json null_value;
    return obj.is_object() && obj.contains(key) ? obj.at(key) : null_value;
  }
  std::string str(const json& obj, const char* key, const std::string& field) const {
    const json& v = at(obj, key);
    if (!v.is_string()) bad(field + "." + key, "a string", v);
    return v.get<std::string>();
  }
  bool flag(const json& obj, const char* key, const std::string& field, bool def) const {
    const json& v = at(obj, key);
    if (v.is_null()) return def;
    if (!v.is_boolean()) bad(field + "." + key, "true or false", v);
    return v.get<bool>();
  }
};

Behavior parse_behavior(const Reader& r, const json& v, const std::string& field) {
  static const std::pair<const char*, Behavior> names[] = {
      {"Removed", Behavior::Removed}, {"Isolated", Behavior::Isolated},
      {"MergedWithPrevious", Behavior::MergedWithPrevious}, {"MergedWithNext", Behavior::MergedWithNext},
      {"Contiguous", Behavior::Contiguous}};
  if (v.is_string())
    for (const auto& [n, b] : names)
      if (v == n) return b;
  r.bad(field, "Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous", v);
}

// A {"String": s} or {"Regex": r} pattern.
struct Pattern {
  std::shared_ptr<Regex> regex;
  std::string literal;

  void spans(std::string_view s, std::vector<Span>& out) const {
    if (regex)
      regex_spans(*regex, s, out);
    else
      literal_spans(literal, s, out);
  }
};

Pattern parse_pattern(const Reader& r, const json& v, const std::string& field) {
  Pattern p;
  if (v.is_object() && v.contains("Regex") && v.at("Regex").is_string()) {
    try {
      p.regex = std::make_shared<Regex>(v.at("Regex").get<std::string>());
    } catch (const std::runtime_error& e) {
      r.bad(field + ".Regex", fmt::format("a regular expression this engine runs ({})", e.what()), v.at("Regex"));
    }
  } else if (v.is_object() && v.contains("String") && v.at("String").is_string()) {
    p.literal = v.at("String").get<std::string>();
    if (p.literal.empty()) r.bad(field + ".String", "a non-empty string", v);
  } else {
    r.bad(field, "{\"Regex\": ...} or {\"String\": ...}", v);
  }
  return p;
}

// The GPT-2 split ByteLevel uses with use_regex: true.
const Regex& gpt2_regex() {
  static const Regex re("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+");
  return re;
}

// Unicode classes as the Rust `regex` crate has them (added tokens' single_word / lstrip /
// rstrip): \w = Alphabetic | M | Nd | Pc | Join_Control, \s = White_Space.
const Regex& word_char_regex() {
  static const Regex re("[\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]", false);
  return re;
}
bool is_white_space(std::string_view ch) {
  static const Regex re("[\\t-\\r\\x{85}\\p{Z}]", false);
  size_t b = 0, e = 0;
  return re.find(ch, 0, b, e) && b == 0 && e == ch.size();
}
bool is_word_char(std::string_view ch) {
  size_t b = 0, e = 0;
  return word_char_regex().find(ch, 0, b, e) && b == 0 && e == ch.size();
}
// Start of the last character of valid UTF-8 `s` (non-empty).
size_t last_char_start(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

}  // namespace

// ------------------------------------------------------------------ the tokenizer

struct HfTokenizer::Impl {
  std::string source;

  // ---- normalizer
  struct NormStep {
    enum Kind { Replace, Prepend, Strip } kind;
    Pattern pattern;
    std::string content;
    bool left = false, right = false;
  };
  std::vector<NormStep> normalizer;

  // ---- pre-tokenizer
  struct PreStep {
    enum Kind { Split, ByteLevel } kind;
    Pattern pattern;
    Behavior behavior = Behavior::Isolated;
    bool invert = false;
    bool add_prefix_space = false, use_regex = false;
  };
  std::vector<PreStep> pre;
  bool has_byte_level = false;

  // ---- BPE model
  StrMap<int32_t> vocab;
  MergeTable merges;
  int32_t unk_id = -1;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::string prefix, suffix;
  std::array<int32_t, 256> byte_token{};  // <0xXX> ids for byte_fallback, -1 if missing

  // ---- added tokens
  struct Added {
    int32_t id;
    std::string content;
    bool single_word, lstrip, rstrip, normalized, special;
  };
  std::vector<Added> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  StrMap<int32_t> added_by_content;
  // Byte tries for leftmost-longest matching: node -> children via one hash map.
  struct Trie {
    std::unordered_map<uint64_t, int32_t> next;  // (node << 8 | byte) -> node
    std::vector<int32_t> terminal{-1};            // node -> index into `added`, -1
    bool empty() const { return terminal.size() == 1; }
    void insert(std::string_view key, int32_t value) {
      int32_t node = 0;
      for (char c : key) {
        const uint64_t k = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(c);
        auto it = next.find(k);
        if (it == next.end()) {
          it = next.emplace(k, static_cast<int32_t>(terminal.size())).first;
          terminal.push_back(-1);
        }
        node = it->second;
      }
      terminal[static_cast<size_t>(node)] = value;
    }
    // Longest key starting at s[i]: (index into `added`, length), or (-1, 0).
    std::pair<int32_t, size_t> longest(std::string_view s, size_t i) const {
      int32_t node = 0, best = -1;
      size_t best_len = 0;
      for (size_t j = i; j < s.size(); ++j) {
        const auto it = next.find((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(s[j]));
        if (it == next.end()) break;
        node = it->second;
        if (terminal[static_cast<size_t>(node)] >= 0) best = terminal[static_cast<size_t>(node)], best_len = j + 1 - i;
      }
      return {best, best_len};
    }
  };
  Trie raw_trie, normalized_trie;

  // ---- ids
  std::vector<std::string> token_of;  // id -> tokenizer.json string
  std::vector<std::string> bytes_of;  // id -> decoded bytes
  int64_t size = 0;

  // ---- decoder
  struct DecStep {
    enum Kind { ByteLevel, Replace, ByteFallback, Fuse } kind;
    Pattern pattern;
    std::string content;
  };
  std::vector<DecStep> decoder;

  // ---- tokenizer_config.json / post-processor
  std::string bos_token, eos_token, pad_token, chat_template;
  int32_t bos = -1, eos = -1, pad = -1;
  bool add_bos = false, add_eos = false;
  int64_t model_max_length = 0;

  // ---- cache of piece -> ids
  mutable std::shared_mutex cache_mu;
  mutable StrMap<std::vector<int32_t>> cache;
  static constexpr size_t kCacheCapacity = 1 << 18;
  static constexpr size_t kCacheMaxPiece = 256;

  // ================================================================ encoding

  std::string normalize(std::string_view s) const {
    std::string t(s);
    for (const NormStep& n : normalizer) {
      switch (n.kind) {
        case NormStep::Prepend:
          if (!t.empty()) t = n.content + t;
          break;
        case NormStep::Strip: {
          size_t b = 0, e = t.size();
          if (n.left)
            while (b < e && is_white_space(std::string_view(t).substr(b, char_len_at(t, b)))) b += char_len_at(t, b);
          if (n.right)
            while (e > b) {
              const size_t k = last_char_start(std::string_view(t).substr(0, e));
              if (!is_white_space(std::string_view(t).substr(k, e - k))) break;
              e = k;
            }
          t = t.substr(b, e - b);
          break;
        }
        case NormStep::Replace: {
          std::vector<Span> spans;
          n.pattern.spans(t, spans);
          std::string r;
          for (const Span& sp : spans) r += sp.match ? n.content : t.substr(sp.begin, sp.end - sp.begin);
          t = std::move(r);
          break;
        }
      }
    }
    return t;
  }

  // AddedVocabulary::find_matches: calls piece(text) for unmatched stretches and token(idx)
  // for added tokens, in order.
  template <typename Piece, typename Token>
  void extract_added(const Trie& trie, std::string_view s, Piece&& piece, Token&& token) const {
    if (trie.empty()) {
      if (!s.empty()) piece(s);
      return;
    }
    size_t start_offset = 0;
    size_t i = 0;
    while (i < s.size()) {
      const auto [idx, len] = trie.longest(s, i);
      if (idx < 0) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + len;
      i = stop;  // the search resumes after this match, kept or not
      const Added& a = added[static_cast<size_t>(idx)];
      if (a.single_word) {
        const bool start_space = start == 0 || !is_word_char(s.substr(last_char_start(s.substr(0, start)),
                                                                       start - last_char_start(s.substr(0, start))));
        const bool stop_space = stop == s.size() || !is_word_char(s.substr(stop, char_len_at(s, stop)));
        if (!start_space || !stop_space) continue;
      }
      if (a.lstrip) {
        size_t b = start;
        while (b > 0) {
          const size_t k = last_char_start(s.substr(0, b));
          if (!is_white_space(s.substr(k, b - k))) break;
          b = k;
        }
        start = std::max(b, start_offset);
      }
      if (a.rstrip)  // (the search still resumes at the match's own end, as in HF)
        while (stop < s.size() && is_white_space(s.substr(stop, char_len_at(s, stop)))) stop += char_len_at(s, stop);
      if (start_offset < start) piece(s.substr(start_offset, start - start_offset));
      token(static_cast<size_t>(idx));
      start_offset = stop;
    }
    if (start_offset < s.size()) piece(s.substr(start_offset));
  }

  using Sink = std::function<void(std::string_view)>;

  void pre_tokenize(size_t k, std::string_view piece, const Sink& sink) const {
    if (piece.empty()) return;
    if (k == pre.size()) {
      sink(piece);
      return;
    }
    const PreStep& st = pre[k];
    if (st.kind == PreStep::Split) {
      std::vector<Span> spans;
      st.pattern.spans(piece, spans);
      split_spans(spans, st.behavior, st.invert, piece,
                  [&](std::string_view sub) { pre_tokenize(k + 1, sub, sink); });
      return;
    }
    // ByteLevel: optional prefix space, optional GPT-2 split, then bytes -> stand-in characters.
    std::string with_space;
    if (st.add_prefix_space && piece.front() != ' ') {
      with_space = " ";
      with_space += piece;
      piece = with_space;
    }
    const auto& chars = byte_level_chars();
    auto map = [&](std::string_view sub) {
      std::string mapped;
      mapped.reserve(sub.size() * 2);
      for (char c : sub) mapped += chars[static_cast<unsigned char>(c)];
      pre_tokenize(k + 1, mapped, sink);
    };
    if (st.use_regex) {
      std::vector<Span> spans;
      regex_spans(gpt2_regex(), piece, spans);
      split_spans(spans, Behavior::Isolated, false, piece, map);
    } else {
      map(piece);
    }
  }

  int32_t vocab_id(std::string_view s) const {
    const auto it = vocab.find(s);
    return it == vocab.end() ? -1 : it->second;
  }


  // BPE::merge_word + Word::merge_all.
  void bpe(std::string_view w, std::vector<int32_t>& out) const {
    std::vector<int32_t> sym;
    sym.reserve(w.size());
    auto add = [&](int32_t id) { sym.push_back(id); };
    int32_t pending_unk = -1;
    std::string buf;
    for (size_t i = 0; i < w.size();) {
      const size_t n = char_len_at(w, i);
      const bool first = i == 0, last = i + n >= w.size();
      std::string_view ch = w.substr(i, n);
      i += n;
      std::string_view key = ch;
      if ((!first && !prefix.empty()) || (last && !suffix.empty())) {
        buf.clear();
        if (!first) buf += prefix;
        buf += ch;
        if (last) buf += suffix;
        key = buf;
      }
      const int32_t id = vocab_id(key);
      if (id >= 0) {
        if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
        add(id);
        continue;
      }
      if (byte_fallback) {
        bool all = true;
        for (char c : key) all = all && byte_token[static_cast<unsigned char>(c)] >= 0;
        if (all) {
          // HF adds these without flushing a pending unk first.
          for (char c : key) add(byte_token[static_cast<unsigned char>(c)]);
          continue;
        }
      }
      if (unk_id >= 0) {
        if (pending_unk >= 0 && !fuse_unk) add(pending_unk);
        pending_unk = unk_id;
      }
      // Without an unk token the character is dropped, as in HF.
    }
    if (pending_unk >= 0) add(pending_unk);
    apply_bpe_merges(sym, merges);
    out.insert(out.end(), sym.begin(), sym.end());
  }

  void model(std::string_view piece, std::vector<int32_t>& out) const {
    if (ignore_merges) {
      const int32_t id = vocab_id(piece);
      if (id >= 0) {
        out.push_back(id);
        return;
      }
    }
    const bool cacheable = piece.size() < kCacheMaxPiece;
    if (cacheable) {
      std::shared_lock lock(cache_mu);
      const auto it = cache.find(piece);
      if (it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t begin = out.size();
    bpe(piece, out);
    if (cacheable) {
      std::unique_lock lock(cache_mu);
      if (cache.size() < kCacheCapacity) cache.emplace(std::string(piece), std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(begin), out.end()));
    }
  }

  // A byte that is not part of valid UTF-8 (outside what HF accepts): its own piece.
  void invalid_byte(unsigned char b, std::vector<int32_t>& out) const {
    if (has_byte_level) {
      const int32_t id = vocab_id(byte_level_chars()[b]);
      if (id >= 0) {
        out.push_back(id);
        return;
      }
    }
    if (byte_fallback && byte_token[b] >= 0) {
      out.push_back(byte_token[b]);
      return;
    }
    if (unk_id >= 0) {
      out.push_back(unk_id);
      return;
    }
    fail("{}: the text holds the byte {:#04x}, which is not valid UTF-8, and this tokenizer has no "
         "token for it (no ByteLevel pre-tokenizer, byte_fallback or unk_token)", source, b);
  }

  // Added tokens on the raw text, then per valid UTF-8 stretch: normalize, cut the normalized
  // added tokens, pre-tokenize. on_piece(piece, false) for the model's pieces,
  // on_piece(byte, true) for a byte that is not valid UTF-8, on_added(index into `added`).
  template <typename OnPiece, typename OnAdded>
  void process(std::string_view text, OnPiece&& on_piece, OnAdded&& on_added) const {
    const Sink sink = [&](std::string_view p) { on_piece(p, false); };
    auto valid_stretch = [&](std::string_view v) {
      if (v.empty()) return;
      std::string normalized_storage;
      std::string_view norm = v;
      if (!normalizer.empty()) {
        normalized_storage = normalize(v);
        norm = normalized_storage;
      }
      extract_added(normalized_trie, norm, [&](std::string_view p) { pre_tokenize(0, p, sink); }, on_added);
    };
    extract_added(
        raw_trie, text,
        [&](std::string_view stretch) {
          size_t start = 0;
          for (size_t i = 0; i < stretch.size();) {
            const size_t n = utf8_char_len(stretch, i);
            if (n > 0) {
              i += n;
              continue;
            }
            valid_stretch(stretch.substr(start, i - start));
            on_piece(stretch.substr(i, 1), true);
            start = ++i;
          }
          valid_stretch(stretch.substr(start));
        },
        on_added);
  }

  void encode(std::string_view text, std::vector<int32_t>& out) const {
    process(
        text,
        [&](std::string_view piece, bool invalid) {
          if (invalid)
            invalid_byte(static_cast<unsigned char>(piece[0]), out);
          else
            model(piece, out);
        },
        [&](size_t idx) { out.push_back(added[idx].id); });
  }

  // ================================================================ decoding

  std::string decode_token(const std::string& token) const {
    std::string t = token;
    for (const DecStep& d : decoder) {
      switch (d.kind) {
        case DecStep::ByteLevel: {
          std::string bytes;
          if (byte_level_decode(t, bytes)) t = std::move(bytes);
          break;
        }
        case DecStep::Replace: {
          std::vector<Span> spans;
          d.pattern.spans(t, spans);
          std::string r;
          for (const Span& sp : spans) r += sp.match ? d.content : t.substr(sp.begin, sp.end - sp.begin);
          t = std::move(r);
          break;
        }
        case DecStep::ByteFallback:
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              std::isxdigit(static_cast<unsigned char>(t[3])) && std::isxdigit(static_cast<unsigned char>(t[4])))
            t = std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
          break;
        case DecStep::Fuse: break;
      }
    }
    return t;
  }
};

// ------------------------------------------------------------------ loading

namespace {

void parse_normalizer(const Reader& r, const json& n, const std::string& field, HfTokenizer::Impl& impl) {
  if (n.is_null()) return;
  const json& type = Reader::at(n, "type");
  if (type == "Sequence") {
    const json& list = Reader::at(n, "normalizers");
    if (!list.is_array()) r.bad(field + ".normalizers", "an array", list);
    for (size_t i = 0; i < list.size(); ++i)
      parse_normalizer(r, list[i], fmt::format("{}.normalizers[{}]", field, i), impl);
    return;
  }
  using NS = HfTokenizer::Impl::NormStep;
  NS step{};
  if (type == "Replace") {
    step.kind = NS::Replace;
    step.pattern = parse_pattern(r, Reader::at(n, "pattern"), field + ".pattern");
    step.content = r.str(n, "content", field);
  } else if (type == "Prepend") {
    step.kind = NS::Prepend;
    step.content = r.str(n, "prepend", field);
  } else if (type == "Strip") {
    step.kind = NS::Strip;
    step.left = r.flag(n, "strip_left", field, true);
    step.right = r.flag(n, "strip_right", field, true);
  } else {
    r.bad(field + ".type", "a normalizer this engine implements (Sequence, Replace, Prepend, Strip)", type);
  }
  impl.normalizer.push_back(std::move(step));
}

void parse_pre_tokenizer(const Reader& r, const json& p, const std::string& field, HfTokenizer::Impl& impl) {
  if (p.is_null()) return;
  const json& type = Reader::at(p, "type");
  using PS = HfTokenizer::Impl::PreStep;
  if (type == "Sequence") {
    const json& list = Reader::at(p, "pretokenizers");
    if (!list.is_array()) r.bad(field + ".pretokenizers", "an array", list);
    for (size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(r, list[i], fmt::format("{}.pretokenizers[{}]", field, i), impl);
    return;
  }
  PS step{};
  if (type == "Split") {
    step.kind = PS::Split;
    step.pattern = parse_pattern(r, Reader::at(p, "pattern"), field + ".pattern");
    step.behavior = parse_behavior(r, Reader::at(p, "behavior"), field + ".behavior");
    step.invert = r.flag(p, "invert", field, false);
  } else if (type == "ByteLevel") {
    step.kind = PS::ByteLevel;
    step.add_prefix_space = r.flag(p, "add_prefix_space", field, true);
    step.use_regex = r.flag(p, "use_regex", field, true);
    impl.has_byte_level = true;
  } else if (type == "Digits") {
    // Digits splits on char::is_numeric (\p{N}): each digit alone, or runs of them.
    step.kind = PS::Split;
    step.pattern.regex = std::make_shared<Regex>("\\p{N}", false);
    step.behavior = r.flag(p, "individual_digits", field, false) ? Behavior::Isolated : Behavior::Contiguous;
  } else {
    r.bad(field + ".type", "a pre-tokenizer this engine implements (Sequence, Split, ByteLevel, Digits)", type);
  }
  impl.pre.push_back(std::move(step));
}

void parse_decoder(const Reader& r, const json& d, const std::string& field, HfTokenizer::Impl& impl) {
  if (d.is_null()) return;
  const json& type = Reader::at(d, "type");
  using DS = HfTokenizer::Impl::DecStep;
  if (type == "Sequence") {
    const json& list = Reader::at(d, "decoders");
    if (!list.is_array()) r.bad(field + ".decoders", "an array", list);
    for (size_t i = 0; i < list.size(); ++i) parse_decoder(r, list[i], fmt::format("{}.decoders[{}]", field, i), impl);
    return;
  }
  DS step{};
  if (type == "ByteLevel") {
    step.kind = DS::ByteLevel;
  } else if (type == "Replace") {
    step.kind = DS::Replace;
    step.pattern = parse_pattern(r, Reader::at(d, "pattern"), field + ".pattern");
    step.content = r.str(d, "content", field);
  } else if (type == "ByteFallback") {
    step.kind = DS::ByteFallback;
  } else if (type == "Fuse") {
    step.kind = DS::Fuse;
  } else {
    r.bad(field + ".type", "a decoder this engine implements (Sequence, ByteLevel, Replace, ByteFallback, Fuse)", type);
  }
  impl.decoder.push_back(std::move(step));
}

}  // namespace

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;
HfTokenizer::HfTokenizer(HfTokenizer&&) noexcept = default;
HfTokenizer& HfTokenizer::operator=(HfTokenizer&&) noexcept = default;

HfTokenizer HfTokenizer::load(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(file)) file /= "tokenizer.json";
  const std::string text = read_text_file_capped(file, "the tokenizer");
  const std::filesystem::path config = file.parent_path() / "tokenizer_config.json";
  std::string config_text;
  if (std::filesystem::is_regular_file(config)) config_text = read_text_file_capped(config, "the tokenizer config");
  return from_json(text, file.string(), config_text, config.string());
}

HfTokenizer HfTokenizer::from_json(const std::string& tokenizer_json, const std::string& source,
                                   const std::string& config_json, const std::string& config_source) {
  return from_parsed(json::parse(tokenizer_json, json_depth_limit<json>(source), /*allow_exceptions=*/false),
                     source, config_json, config_source);
}

HfTokenizer HfTokenizer::from_parsed(const json& j, const std::string& source, const std::string& config_json,
                                     const std::string& config_source) {
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  const Reader r{source};
  if (!j.is_object()) fail("{}: not a JSON object (expected a Hugging Face tokenizer.json)", source);

  // ---- model
  const json& model = Reader::at(j, "model");
  if (!model.is_object()) r.bad("model", "an object", model);
  const json& mtype = Reader::at(model, "type");
  if (!mtype.is_null() && mtype != "BPE") r.bad("model.type", "\"BPE\"", mtype);
  const json& dropout = Reader::at(model, "dropout");
  if (!dropout.is_null() && !(dropout.is_number() && dropout.get<double>() == 0.0))
    r.bad("model.dropout", "null (BPE dropout is not implemented)", dropout);
  const json& vocab_json = Reader::at(model, "vocab");
  if (!vocab_json.is_object()) r.bad("model.vocab", "an object of token -> id", vocab_json);
  int64_t max_id = -1;
  std::unordered_map<int32_t, std::string> model_token;
  model_token.reserve(vocab_json.size());
  impl->vocab.reserve(vocab_json.size());
  for (const auto& [token, id_json] : vocab_json.items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() > INT32_MAX)
      r.bad(fmt::format("model.vocab[\"{}\"]", token), "a non-negative id", id_json);
    const auto id = id_json.get<int32_t>();
    impl->vocab.emplace(token, id);
    model_token.emplace(id, token);
    max_id = std::max<int64_t>(max_id, id);
  }
  const json& unk = Reader::at(model, "unk_token");
  if (!unk.is_null()) {
    if (!unk.is_string()) r.bad("model.unk_token", "a string or null", unk);
    impl->unk_id = impl->vocab_id(unk.get<std::string>());
    if (impl->unk_id < 0) r.bad("model.unk_token", "a token in model.vocab", unk);
  }
  impl->fuse_unk = r.flag(model, "fuse_unk", "model", false);
  impl->byte_fallback = r.flag(model, "byte_fallback", "model", false);
  impl->ignore_merges = r.flag(model, "ignore_merges", "model", false);
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json& v = Reader::at(model, key);
    if (v.is_null()) continue;
    if (!v.is_string()) r.bad(fmt::format("model.{}", key), "a string or null", v);
    (std::string_view(key) == "end_of_word_suffix" ? impl->suffix : impl->prefix) = v.get<std::string>();
  }
  for (int b = 0; b < 256; ++b) impl->byte_token[static_cast<size_t>(b)] = impl->vocab_id(fmt::format("<0x{:02X}>", b));

  const json& merges_json = Reader::at(model, "merges");
  if (!merges_json.is_array()) r.bad("model.merges", "an array", merges_json);
  impl->merges.reserve(merges_json.size());
  for (size_t rank = 0; rank < merges_json.size(); ++rank) {
    const json& m = merges_json[rank];
    const std::string field = fmt::format("model.merges[{}]", rank);
    std::string left, right;
    if (m.is_string()) {
      // "a b": HF splits at the (only) space.
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) r.bad(field, "\"left right\"", m);
      left = s.substr(0, sp), right = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>(), right = m[1].get<std::string>();
    } else {
      r.bad(field, "\"left right\" or [\"left\", \"right\"]", m);
    }
    const int32_t a = impl->vocab_id(left), b = impl->vocab_id(right);
    if (right.size() < impl->prefix.size() || right.compare(0, impl->prefix.size(), impl->prefix) != 0)
      if (!impl->prefix.empty()) r.bad(field, "a right part starting with continuing_subword_prefix", m);
    const int32_t merged = impl->vocab_id(left + right.substr(impl->prefix.size()));
    if (a < 0 || b < 0 || merged < 0) r.bad(field, "tokens in model.vocab whose concatenation is in model.vocab too", m);
    // Later duplicates overwrite earlier ones, as HF's HashMap collect does.
    impl->merges[merge_pair_key(a, b)] = {static_cast<int32_t>(rank), merged};
  }

  // ---- added tokens
  const json& added = Reader::at(j, "added_tokens");
  if (!added.is_null() && !added.is_array()) r.bad("added_tokens", "an array", added);
  if (added.is_array()) {
    for (size_t i = 0; i < added.size(); ++i) {
      const json& t = added[i];
      const std::string field = fmt::format("added_tokens[{}]", i);
      const json& id = Reader::at(t, "id");
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        r.bad(field + ".id", "a non-negative id", id);
      Impl::Added a{id.get<int32_t>(), r.str(t, "content", field), r.flag(t, "single_word", field, false),
                    r.flag(t, "lstrip", field, false), r.flag(t, "rstrip", field, false),
                    r.flag(t, "normalized", field, true), r.flag(t, "special", field, false)};
      if (a.content.empty()) r.bad(field + ".content", "a non-empty string", t);
      if (!valid_utf8(a.content)) r.bad(field + ".content", "UTF-8 text", t);
      // One id, one text: a second text at an id (or a second id for a text) would make
      // encoding and decoding disagree, and Hugging Face resolves such a file by rules of its
      // own (with a warning), so it is rejected here, naming both entries. The same token
      // listed twice, flags and all, is taken once.
      if (const auto same_id = impl->added_by_id.find(a.id); same_id != impl->added_by_id.end()) {
        const Impl::Added& b = impl->added[same_id->second];
        if (b.content != a.content)
          r.bad(field + ".id", fmt::format("an id of its own (id {} is already the added token {})",
                                           a.id, json(b.content).dump()),
                id);
        if (std::tie(a.single_word, a.lstrip, a.rstrip, a.normalized, a.special) !=
            std::tie(b.single_word, b.lstrip, b.rstrip, b.normalized, b.special))
          r.bad(field, "the same flags as the earlier entry of this token", t);
        continue;
      }
      if (const auto same_text = impl->added_by_content.find(a.content);
          same_text != impl->added_by_content.end())
        r.bad(field + ".content", fmt::format("a text of its own (it is already the added token "
                                              "of id {})", same_text->second),
              t.at("content"));
      max_id = std::max<int64_t>(max_id, a.id);
      impl->added_by_id[a.id] = impl->added.size();
      impl->added_by_content[a.content] = a.id;
      impl->added.push_back(std::move(a));
    }
  }

  // ---- normalizer, pre-tokenizer, decoder
  parse_normalizer(r, Reader::at(j, "normalizer"), "normalizer", *impl);
  parse_pre_tokenizer(r, Reader::at(j, "pre_tokenizer"), "pre_tokenizer", *impl);
  parse_decoder(r, Reader::at(j, "decoder"), "decoder", *impl);

  for (size_t i = 0; i < impl->added.size(); ++i) {
    const Impl::Added& a = impl->added[i];
    if (a.normalized)
      impl->normalized_trie.insert(impl->normalizer.empty() ? a.content : impl->normalize(a.content), static_cast<int32_t>(i));
    else
      impl->raw_trie.insert(a.content, static_cast<int32_t>(i));
  }

  // ---- id tables
  // Both tables are indexed by id, so their size follows the largest id, not the number of
  // tokens: one token with id 2^31 - 1 would make them 128 GiB.
  check_load_bytes(source, fmt::format("the id tables up to id {}", max_id),
                   (max_id + 1) * static_cast<int64_t>(2 * sizeof(std::string)));
  impl->size = max_id + 1;
  impl->token_of.assign(static_cast<size_t>(impl->size), std::string());
  for (const auto& [id, token] : model_token) impl->token_of[static_cast<size_t>(id)] = token;
  for (const Impl::Added& a : impl->added) impl->token_of[static_cast<size_t>(a.id)] = a.content;
  impl->bytes_of.resize(impl->token_of.size());
  for (size_t id = 0; id < impl->token_of.size(); ++id)
    if (!impl->token_of[id].empty()) impl->bytes_of[id] = impl->decode_token(impl->token_of[id]);

  // ---- special tokens: tokenizer_config.json, then the post-processor, then well-known names
  auto id_of = [&](const std::string& token) -> int32_t {
    if (token.empty()) return -1;
    const auto it = impl->added_by_content.find(token);
    if (it != impl->added_by_content.end()) return it->second;
    return impl->vocab_id(token);
  };
  std::optional<bool> add_bos, add_eos;
  if (!config_json.empty()) {
    const Reader cr{config_source};
    const json c = json::parse(config_json, json_depth_limit<json>(config_source), false);
    if (!c.is_object()) fail("{}: not a JSON object (expected a Hugging Face tokenizer_config.json)", config_source);
    impl->bos_token = config_token_text(Reader::at(c, "bos_token"));
    impl->eos_token = config_token_text(Reader::at(c, "eos_token"));
    impl->pad_token = config_token_text(Reader::at(c, "pad_token"));
    for (const auto& [key, name] : {std::pair{"bos_token", &impl->bos_token}, std::pair{"eos_token", &impl->eos_token},
                                    std::pair{"pad_token", &impl->pad_token}})
      if (!name->empty() && id_of(*name) < 0)
        cr.bad(key, fmt::format("a token of {}", source), json(*name));
    const json& ab = Reader::at(c, "add_bos_token");
    if (!ab.is_null()) add_bos = cr.flag(c, "add_bos_token", "", false);
    const json& ae = Reader::at(c, "add_eos_token");
    if (!ae.is_null()) add_eos = cr.flag(c, "add_eos_token", "", false);
    const json& tpl = Reader::at(c, "chat_template");
    if (tpl.is_string()) {
      impl->chat_template = tpl.get<std::string>();
    } else if (tpl.is_array()) {  // [{"name": "default", "template": "..."}, ...]
      for (const json& t : tpl)
        if (Reader::at(t, "name") == "default" && Reader::at(t, "template").is_string())
          impl->chat_template = t.at("template").get<std::string>();
    } else if (!tpl.is_null()) {
      cr.bad("chat_template", "a string or a list of {name, template}", tpl);
    }
    const json& mml = Reader::at(c, "model_max_length");
    if (mml.is_number_integer()) impl->model_max_length = mml.get<int64_t>();
    else if (mml.is_number()) impl->model_max_length = static_cast<int64_t>(std::min(mml.get<double>(), 9.0e18));
  }
  // A TemplateProcessing post-processor places the BOS/EOS itself (Llama 3, Qwen...).
  const json& post = Reader::at(j, "post_processor");
  auto template_special = [&](const json& single, bool front) -> std::string {
    if (!single.is_array() || single.empty()) return {};
    const json& item = front ? single.front() : single.back();
    const json& sp = Reader::at(item, "SpecialToken");
    return Reader::at(sp, "id").is_string() ? sp.at("id").get<std::string>() : std::string();
  };
  const json* tp = nullptr;
  if (Reader::at(post, "type") == "TemplateProcessing") tp = &post;
  if (Reader::at(post, "type") == "Sequence" && Reader::at(post, "processors").is_array())
    for (const json& p : post.at("processors"))
      if (Reader::at(p, "type") == "TemplateProcessing") tp = &p;
  if (tp) {
    const std::string first = template_special(Reader::at(*tp, "single"), true);
    const std::string last = template_special(Reader::at(*tp, "single"), false);
    if (!first.empty()) {
      if (impl->bos_token.empty()) impl->bos_token = first;
      if (!add_bos) add_bos = first == impl->bos_token;
    }
    if (!last.empty() && last != first) {
      if (impl->eos_token.empty()) impl->eos_token = last;
      if (!add_eos) add_eos = last == impl->eos_token;
    }
  }
  if (impl->eos_token.empty())
    for (const char* name : {"<|endoftext|>", "<｜end▁of▁sentence｜>", "</s>", "<|end_of_text|>", "<eos>"})
      if (impl->added_by_content.count(name)) {
        impl->eos_token = name;
        break;
      }
  if (impl->bos_token.empty())
    for (const char* name : {"<｜begin▁of▁sentence｜>", "<s>", "<|begin_of_text|>", "<bos>"})
      if (impl->added_by_content.count(name)) {
        impl->bos_token = name;
        break;
      }
  impl->bos = id_of(impl->bos_token);
  impl->eos = id_of(impl->eos_token);
  impl->pad = id_of(impl->pad_token);
  impl->add_bos = add_bos.value_or(false) && impl->bos >= 0;
  impl->add_eos = add_eos.value_or(false) && impl->eos >= 0;
  if (impl->eos < 0)
    fail("{}: no end-of-text token: {} names no eos_token and no added token is a known one "
         "(<|endoftext|>, <｜end▁of▁sentence｜>, </s>, <|end_of_text|>, <eos>)",
         source, config_json.empty() ? "there is no tokenizer_config.json beside it that" : config_source);
  return HfTokenizer(std::move(impl));
}

// ------------------------------------------------------------------ accessors

void HfTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const { impl_->encode(text, out); }

std::string HfTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= impl_->size) return {};
  return impl_->bytes_of[static_cast<size_t>(id)];
}

int64_t HfTokenizer::vocab_size() const { return impl_->size; }
int32_t HfTokenizer::end_of_text() const { return impl_->eos; }
int32_t HfTokenizer::bos_id() const { return impl_->bos; }
bool HfTokenizer::add_bos() const { return impl_->add_bos; }
int32_t HfTokenizer::eos_id() const { return impl_->eos; }
int32_t HfTokenizer::pad_id() const { return impl_->pad; }
bool HfTokenizer::add_eos() const { return impl_->add_eos; }
const std::string& HfTokenizer::bos_token() const { return impl_->bos_token; }
const std::string& HfTokenizer::eos_token() const { return impl_->eos_token; }
const std::string& HfTokenizer::chat_template() const { return impl_->chat_template; }
int64_t HfTokenizer::model_max_length() const { return impl_->model_max_length; }

int32_t HfTokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->added_by_content.find(token);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->vocab_id(token);
}

std::string HfTokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= impl_->size) return {};
  return impl_->token_of[static_cast<size_t>(id)];
}

bool HfTokenizer::is_added(int32_t id) const { return impl_->added_by_id.count(id) > 0; }

bool HfTokenizer::is_special(int32_t id) const {
  const auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

std::vector<std::string> HfTokenizer::pieces(std::string_view text) const {
  std::vector<std::string> out;
  impl_->process(
      text, [&](std::string_view p, bool) { out.emplace_back(p); },
      [&](size_t idx) { out.push_back(impl_->added[idx].content); });
  return out;
}

}  // namespace moe
