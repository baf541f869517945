#include "data/byte_level.h"

#include <unordered_map>

namespace moe {

const char* const kPreTokenizerRegex =
    " ?[A-Za-z]+| ?[0-9]+| ?[^\\t\\n\\x0B\\x0C\\r A-Za-z0-9]+|[\\t\\n\\x0B\\x0C\\r ]+(?![^\\t\\n\\x0B\\x0C\\r ])"
    "|[\\t\\n\\x0B\\x0C\\r ]+";

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

const std::unordered_map<std::string, unsigned char>& char_to_byte() {
  static const auto* m = [] {
    auto* out = new std::unordered_map<std::string, unsigned char>;
    for (int b = 0; b < 256; ++b) (*out)[byte_level_chars()[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);
    return out;
  }();
  return *m;
}

enum class Class { Letter, Digit, Space, Other };

Class class_of(unsigned char c) {
  if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z')) return Class::Letter;
  if (c >= '0' && c <= '9') return Class::Digit;
  if (c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r') return Class::Space;
  return Class::Other;
}

}  // namespace

const std::array<std::string, 256>& byte_level_chars() {
  // GPT-2's table: printable Latin-1 bytes stand for themselves, the other 68 bytes map to
  // U+0100 onwards in byte order.
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      t[b] = utf8(printable ? b : next++);
    }
    return t;
  }();
  return table;
}

bool byte_level_decode(std::string_view chars, std::string& bytes) {
  const auto& map = char_to_byte();
  for (size_t i = 0; i < chars.size();) {
    // Every stand-in character is one or two UTF-8 bytes.
    const size_t len = static_cast<unsigned char>(chars[i]) < 0x80 ? 1 : 2;
    if (i + len > chars.size()) return false;
    const auto it = map.find(std::string(chars.substr(i, len)));
    if (it == map.end()) return false;
    bytes += static_cast<char>(it->second);
    i += len;
  }
  return true;
}

std::string byte_level_encode(std::string_view bytes) {
  std::string out;
  for (char c : bytes) out += byte_level_chars()[static_cast<unsigned char>(c)];
  return out;
}

std::vector<std::string_view> pre_tokenize(std::string_view s) {
  std::vector<std::string_view> out;
  const size_t n = s.size();
  auto cls = [&](size_t i) { return class_of(static_cast<unsigned char>(s[i])); };
  size_t i = 0;
  while (i < n) {
    size_t j = i;
    if (s[i] == ' ' && i + 1 < n && cls(i + 1) != Class::Space) {
      const Class k = cls(i + 1);
      j = i + 1;
      while (j < n && cls(j) == k) ++j;
    } else if (cls(i) != Class::Space) {
      const Class k = cls(i);
      while (j < n && cls(j) == k) ++j;
    } else {
      while (j < n && cls(j) == Class::Space) ++j;
      // The last space of a run in front of a word goes with the word (" word").
      if (j < n && j - i >= 2) --j;
    }
    out.push_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

}  // namespace moe
