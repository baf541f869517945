#include "data/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/limits.h"

namespace moe {

namespace {

using ojson = nlohmann::ordered_json;

// ================================================================== errors

// An error at a byte offset of the (newline-normalized) template; turned into a moe::Error with
// line and column where the template is known.
struct Located {
  size_t pos;
  std::string message;
};

[[noreturn]] void fail_at(size_t pos, std::string message) {
  throw Located{pos, std::move(message)};
}

std::string where(const std::string& source, size_t pos) {
  pos = std::min(pos, source.size());
  size_t line = 1, column = 1;
  for (size_t i = 0; i < pos; ++i) {
    if (source[i] == '\n') {
      ++line;
      column = 1;
    } else if ((static_cast<unsigned char>(source[i]) & 0xC0) != 0x80) {
      ++column;  // columns count code points
    }
  }
  return fmt::format("chat template, line {}, column {}", line, column);
}

// ================================================================== UTF-8

size_t utf8_length_of_lead(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 0x6) return 2;
  if ((c >> 4) == 0xE) return 3;
  if ((c >> 3) == 0x1E) return 4;
  return 1;  // a stray byte counts as one character
}

// Start offsets of the code points of s, plus s.size() at the end.
std::vector<size_t> code_point_offsets(const std::string& s) {
  std::vector<size_t> out;
  out.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size();) {
    out.push_back(i);
    i += std::min(utf8_length_of_lead(static_cast<unsigned char>(s[i])), s.size() - i);
  }
  out.push_back(s.size());
  return out;
}

char32_t decode_at(const std::string& s, size_t i, size_t* len) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = std::min(utf8_length_of_lead(c), s.size() - i);
  *len = n;
  if (n == 1) return c;
  char32_t cp = c & (0xFF >> (n + 1));
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Python's str.isspace().
bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Python's str.strip / lstrip / rstrip: whitespace, or any code point of `chars`.
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  std::vector<char32_t> set;
  if (chars) {
    for (size_t i = 0, n = 0; i < chars->size(); i += n) set.push_back(decode_at(*chars, i, &n));
  }
  const auto strip_it = [&](char32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c);
  };
  const std::vector<size_t> at = code_point_offsets(s);
  size_t b = 0, e = at.size() - 1;  // code point indexes [b, e)
  size_t n = 0;
  if (left)
    while (b < e && strip_it(decode_at(s, at[b], &n))) ++b;
  if (right)
    while (e > b && strip_it(decode_at(s, at[e - 1], &n))) --e;
  return s.substr(at[b], at[e] - at[b]);
}

bool all_space(const std::string& s, size_t from) {
  for (size_t i = from, n = 0; i < s.size(); i += n)
    if (!py_isspace(decode_at(s, i, &n))) return false;
  return true;
}

std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}
std::string ascii_upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return s;
}

// ================================================================== values

struct Value;
using ValueList = std::vector<Value>;
using ValueDict = std::vector<std::pair<std::string, Value>>;  // insertion order, as in Python
struct NamespaceObject;

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace };
  Kind kind = Kind::Undefined;
  bool b = false;
  bool tuple = false;  // a List that is a Python tuple (only its repr differs)
  int64_t i = 0;
  double f = 0.0;
  std::string s;  // a String's text; an Undefined's explanation ("'x' is undefined")
  std::shared_ptr<const ValueList> list;
  std::shared_ptr<const ValueDict> dict;
  std::shared_ptr<NamespaceObject> ns;

  static Value undefined(std::string why) {
    Value v;
    v.s = std::move(why);
    return v;
  }
  static Value none() { return with_kind(Kind::None); }
  static Value boolean(bool x) {
    Value v = with_kind(Kind::Bool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = with_kind(Kind::Int);
    v.i = x;
    return v;
  }
  static Value floating(double x) {
    Value v = with_kind(Kind::Float);
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v = with_kind(Kind::String);
    v.s = std::move(x);
    return v;
  }
  static Value make_list(ValueList items, bool is_tuple = false) {
    Value v = with_kind(Kind::List);
    v.list = std::make_shared<const ValueList>(std::move(items));
    v.tuple = is_tuple;
    return v;
  }
  static Value make_dict(ValueDict items) {
    Value v = with_kind(Kind::Dict);
    v.dict = std::make_shared<const ValueDict>(std::move(items));
    return v;
  }

  bool is(Kind k) const { return kind == k; }
  bool is_number() const { return kind == Kind::Bool || kind == Kind::Int || kind == Kind::Float; }

 private:
  static Value with_kind(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

struct NamespaceObject {
  ValueDict attrs;
};

const Value* dict_find(const ValueDict& d, const std::string& key) {
  for (const auto& [k, v] : d)
    if (k == key) return &v;
  return nullptr;
}

void dict_set(ValueDict& d, const std::string& key, Value v) {
  for (auto& [k, old] : d)
    if (k == key) {
      old = std::move(v);
      return;
    }
  d.emplace_back(key, std::move(v));
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return "Undefined";
    case Value::Kind::None:
      return "NoneType";
    case Value::Kind::Bool:
      return "bool";
    case Value::Kind::Int:
      return "int";
    case Value::Kind::Float:
      return "float";
    case Value::Kind::String:
      return "str";
    case Value::Kind::List:
      return v.tuple ? "tuple" : "list";
    case Value::Kind::Dict:
      return "dict";
    case Value::Kind::Namespace:
      return "Namespace";
  }
  return "?";
}

Value from_json(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null:
      return Value::none();
    case ojson::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case ojson::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case ojson::value_t::number_unsigned:
      return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case ojson::value_t::number_float:
      return Value::floating(j.get<double>());
    case ojson::value_t::string:
      return Value::string(j.get<std::string>());
    case ojson::value_t::array: {
      ValueList items;
      for (const ojson& e : j) items.push_back(from_json(e));
      return Value::make_list(std::move(items));
    }
    case ojson::value_t::object: {
      ValueDict items;
      for (auto it = j.begin(); it != j.end(); ++it)
        items.emplace_back(it.key(), from_json(it.value()));
      return Value::make_dict(std::move(items));
    }
    default:
      return Value::none();
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return false;
    case Value::Kind::Bool:
      return v.b;
    case Value::Kind::Int:
      return v.i != 0;
    case Value::Kind::Float:
      return v.f != 0.0;
    case Value::Kind::String:
      return !v.s.empty();
    case Value::Kind::List:
      return !v.list->empty();
    case Value::Kind::Dict:
      return !v.dict->empty();
    case Value::Kind::Namespace:
      return true;
  }
  return false;
}

double as_double(const Value& v) {
  if (v.is(Value::Kind::Float)) return v.f;
  if (v.is(Value::Kind::Int)) return static_cast<double>(v.i);
  return v.b ? 1.0 : 0.0;
}
int64_t as_int(const Value& v) { return v.is(Value::Kind::Int) ? v.i : (v.b ? 1 : 0); }

// Python's repr(float).
std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e_at = sci.find('e');
  std::string digits = sci.substr(0, e_at);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e_at + 1));
  if (exp >= -4 && exp < 16) {
    std::string out;
    if (exp >= 0) {
      std::string int_part = digits.substr(0, std::min<size_t>(digits.size(), exp + 1));
      int_part.append(static_cast<size_t>(exp + 1) - int_part.size(), '0');
      std::string frac =
          digits.size() > static_cast<size_t>(exp + 1) ? digits.substr(exp + 1) : "0";
      out = int_part + "." + frac;
    } else {
      out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    }
    return sign + out;
  }
  std::string mant = digits.substr(0, 1);
  if (digits.size() > 1) mant += "." + digits.substr(1);
  return sign + mant + fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
}

// Python's repr(str).
std::string py_str_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0, n = 0; i < s.size(); i += n) {
    const char32_t c = decode_at(s, i, &n);
    if (c == '\\')
      out += "\\\\";
    else if (c == static_cast<char32_t>(quote))
      out += std::string("\\") + quote;
    else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20 || (c >= 0x7F && c <= 0xA0))
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    else
      out.append(s, i, n);
  }
  out += quote;
  return out;
}

std::string py_str(const Value& v);

std::string py_repr(const Value& v) {
  if (v.is(Value::Kind::String)) return py_str_repr(v.s);
  return py_str(v);
}

// Python's str(value), which is what {{ value }} and ~ print.
std::string py_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return "";
    case Value::Kind::None:
      return "None";
    case Value::Kind::Bool:
      return v.b ? "True" : "False";
    case Value::Kind::Int:
      return std::to_string(v.i);
    case Value::Kind::Float:
      return py_float_repr(v.f);
    case Value::Kind::String:
      return v.s;
    case Value::Kind::List: {
      std::string out = v.tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + py_repr((*v.list)[k]);
      if (v.tuple && v.list->size() == 1) out += ",";
      return out + (v.tuple ? ")" : "]");
    }
    case Value::Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, e] : *v.dict) {
        out += (first ? "" : ", ") + py_str_repr(k) + ": " + py_repr(e);
        first = false;
      }
      return out + "}";
    }
    case Value::Kind::Namespace: {
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [k, e] : v.ns->attrs) {
        out += (first ? "" : ", ") + py_str_repr(k) + ": " + py_repr(e);
        first = false;
      }
      return out + "}>";
    }
  }
  return "";
}

bool py_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is(Value::Kind::Float) || b.is(Value::Kind::Float)) return as_double(a) == as_double(b);
    return as_int(a) == as_int(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return true;
    case Value::Kind::String:
      return a.s == b.s;
    case Value::Kind::List:
      if (a.tuple != b.tuple || a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!py_equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::Kind::Dict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, e] : *a.dict) {
        const Value* o = dict_find(*b.dict, k);
        if (!o || !py_equal(e, *o)) return false;
      }
      return true;
    case Value::Kind::Namespace:
      return a.ns == b.ns;
    default:
      return false;
  }
}

// ------------------------------------------------------------------ JSON (transformers' tojson)

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0, n = 0; i < s.size(); i += n) {
    const char32_t c = decode_at(s, i, &n);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else if (ensure_ascii && c >= 0x80) {
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", static_cast<unsigned>(0xD800 + (v >> 10)),
                               static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
          }
        } else {
          out.append(s, i, n);
        }
    }
  }
  out += '"';
}

struct JsonStyle {
  std::optional<std::string> indent;  // None: one line
  std::string item_sep, key_sep;
  bool sort_keys = false;
  bool ensure_ascii = false;
};

void to_json(std::string& out, const Value& v, const JsonStyle& st, int depth, size_t pos) {
  const auto newline = [&](int d) {
    if (!st.indent) return;
    out += '\n';
    for (int k = 0; k < d; ++k) out += *st.indent;
  };
  switch (v.kind) {
    case Value::Kind::None:
      out += "null";
      return;
    case Value::Kind::Bool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::Int:
      out += std::to_string(v.i);
      return;
    case Value::Kind::Float:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                               : py_float_repr(v.f);
      return;
    case Value::Kind::String:
      json_string(out, v.s, st.ensure_ascii);
      return;
    case Value::Kind::List: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += st.item_sep;
        newline(depth + 1);
        to_json(out, (*v.list)[k], st, depth + 1, pos);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::Dict:
    case Value::Kind::Namespace: {
      if (v.is(Value::Kind::Namespace))
        fail_at(pos, "tojson: Object of type Namespace is not JSON serializable");
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : *v.dict) items.push_back(&kv);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      if (items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += st.item_sep;
        newline(depth + 1);
        json_string(out, items[k]->first, st.ensure_ascii);
        out += st.key_sep;
        to_json(out, items[k]->second, st, depth + 1, pos);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::Undefined:
      fail_at(pos, "tojson: " + (v.s.empty() ? std::string("undefined value") : v.s));
  }
}

// ================================================================== lexer

enum class Tok { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  Tok type;
  std::string text;  // Data text, name, decoded string, operator
  size_t pos;
  int64_t i = 0;
  double f = 0.0;
};

bool is_ident_start(unsigned char c) { return std::isalpha(c) || c == '_' || c >= 0x80; }
bool is_ident_char(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }

// Python string-literal escapes (jinja2 decodes literals with "unicode-escape").
std::string unescape(const std::string& body, size_t pos) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char c = body[++i];
    const auto hex = [&](size_t n) -> char32_t {
      char32_t v = 0;
      for (size_t k = 1; k <= n; ++k) {
        if (i + k >= body.size() || !std::isxdigit(static_cast<unsigned char>(body[i + k])))
          fail_at(pos, "truncated \\x, \\u or \\U escape in string literal");
        v = v * 16 + static_cast<char32_t>(std::stoi(std::string(1, body[i + k]), nullptr, 16));
      }
      i += n;
      return v;
    };
    switch (c) {
      case '\n':
        break;  // line continuation
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        append_utf8(out, hex(2));
        break;
      case 'u':
        append_utf8(out, hex(4));
        break;
      case 'U':
        append_utf8(out, hex(8));
        break;
      case 'N':
        fail_at(pos, "\\N{...} escapes in string literals are not supported");
      default:
        if (c >= '0' && c <= '7') {
          char32_t v = static_cast<char32_t>(c - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7';
               ++k)
            v = v * 8 + static_cast<char32_t>(body[++i] - '0');
          append_utf8(out, v);
        } else {
          out += '\\';
          out += c;  // Python keeps unknown escapes as they are
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(const std::string& src) : s_(src) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < s_.size()) {
      size_t tag = std::string::npos;
      for (size_t p = s_.find('{', pos); p != std::string::npos; p = s_.find('{', p + 1)) {
        if (p + 1 < s_.size() && (s_[p + 1] == '{' || s_[p + 1] == '%' || s_[p + 1] == '#')) {
          tag = p;
          break;
        }
      }
      if (tag == std::string::npos) {
        push(Tok::Data, s_.substr(pos), pos);
        break;
      }
      const char kind = s_[tag + 1];
      size_t after = tag + 2;
      char sign = 0;
      if (after < s_.size() && (s_[after] == '-' || s_[after] == '+')) sign = s_[after++];
      std::string text = s_.substr(pos, tag - pos);
      if (sign == '-') {
        text = py_strip(text, nullptr, false, true);
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks: block and comment tags only
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && all_space(text, l_pos))
          text.erase(l_pos);
      }
      if (!text.empty()) push(Tok::Data, text, pos);
      if (kind == '#') {
        pos = comment(tag, after, &line_starting);
      } else {
        pos = tag_body(kind == '{', tag, after, &line_starting);
      }
    }
    push(Tok::End, "", s_.size());
    return std::move(out_);
  }

 private:
  void push(Tok t, std::string text, size_t pos) { out_.push_back(Token{t, std::move(text), pos}); }

  // After "{#": up to the first "#}" (with its -/+ control and trim_blocks).
  size_t comment(size_t tag, size_t p, bool* line_starting) {
    const size_t end = s_.find("#}", p);
    if (end == std::string::npos) fail_at(tag, "missing end of comment tag '#}'");
    size_t next = end + 2;
    const char control = end > p ? s_[end - 1] : 0;
    if (control == '-') {
      while (next < s_.size()) {
        size_t n = 0;
        if (!py_isspace(decode_at(s_, next, &n))) break;
        next += n;
      }
    } else if (control != '+' && next < s_.size() && s_[next] == '\n') {
      ++next;  // trim_blocks
    }
    *line_starting = s_[next - 1] == '\n';
    return next;
  }

  // After "{{" or "{%": the expression tokens up to the matching end tag.
  size_t tag_body(bool variable, size_t tag, size_t p, bool* line_starting) {
    push(variable ? Tok::VarBegin : Tok::BlockBegin, "", tag);
    std::vector<char> balance;
    while (true) {
      if (p >= s_.size())
        fail_at(tag,
                variable ? "missing end of variable tag '}}'" : "missing end of block tag '%}'");
      if (balance.empty()) {
        const char* close = variable ? "}}" : "%}";
        const bool minus = s_[p] == '-' && s_.compare(p + 1, 2, close) == 0;
        const bool plus = !variable && s_[p] == '+' && s_.compare(p + 1, 2, close) == 0;
        if (minus || plus || s_.compare(p, 2, close) == 0) {
          push(variable ? Tok::VarEnd : Tok::BlockEnd, "", p);
          size_t next = p + 2 + (minus || plus ? 1 : 0);
          if (minus) {
            while (next < s_.size()) {
              size_t n = 0;
              if (!py_isspace(decode_at(s_, next, &n))) break;
              next += n;
            }
          } else if (!variable && !plus && next < s_.size() && s_[next] == '\n') {
            ++next;  // trim_blocks
          }
          *line_starting = s_[next - 1] == '\n';
          return next;
        }
      }
      const unsigned char c = static_cast<unsigned char>(s_[p]);
      size_t n = 0;
      if (py_isspace(decode_at(s_, p, &n))) {
        p += n;
        continue;
      }
      if (std::isdigit(c)) {
        p = number(p);
        continue;
      }
      if (is_ident_start(c)) {
        size_t e = p;
        while (e < s_.size() && is_ident_char(static_cast<unsigned char>(s_[e]))) ++e;
        push(Tok::Name, s_.substr(p, e - p), p);
        p = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t e = p + 1;
        while (e < s_.size() && s_[e] != static_cast<char>(c)) e += s_[e] == '\\' ? 2 : 1;
        if (e >= s_.size()) fail_at(p, "unterminated string literal");
        push(Tok::String, unescape(s_.substr(p + 1, e - p - 1), p), p);
        p = e + 1;
        continue;
      }
      static const char* const kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                         "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                         ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
      const char* op = nullptr;
      for (const char* o : kOps)
        if (s_.compare(p, std::char_traits<char>::length(o), o) == 0) {
          op = o;
          break;
        }
      if (!op) fail_at(p, fmt::format("unexpected character '{}'", s_.substr(p, n)));
      const std::string o(op);
      if (o == "(" || o == "[" || o == "{") {
        balance.push_back(o == "(" ? ')' : o == "[" ? ']' : '}');
      } else if (o == ")" || o == "]" || o == "}") {
        if (balance.empty()) fail_at(p, "unexpected '" + o + "'");
        if (balance.back() != o[0])
          fail_at(p, fmt::format("unexpected '{}', expected '{}'", o, balance.back()));
        balance.pop_back();
      }
      push(Tok::Op, o, p);
      p += o.size();
    }
  }

  size_t number(size_t p) {
    size_t e = p;
    const auto digits = [&] {
      while (e < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[e])) || s_[e] == '_'))
        ++e;
    };
    digits();
    bool is_float = false;
    if (e + 1 < s_.size() && s_[e] == '.' && std::isdigit(static_cast<unsigned char>(s_[e + 1]))) {
      is_float = true;
      ++e;
      digits();
    }
    if (e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
      size_t k = e + 1;
      if (k < s_.size() && (s_[k] == '+' || s_[k] == '-')) ++k;
      if (k < s_.size() && std::isdigit(static_cast<unsigned char>(s_[k]))) {
        is_float = true;
        e = k;
        digits();
      }
    }
    std::string text = s_.substr(p, e - p);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Token t{is_float ? Tok::Float : Tok::Int, text, p};
    if (is_float) {
      t.f = std::strtod(text.c_str(), nullptr);
    } else {
      const auto r = std::from_chars(text.data(), text.data() + text.size(), t.i);
      if (r.ec != std::errc()) fail_at(p, "integer literal out of range");
    }
    out_.push_back(std::move(t));
    return e;
  }

  const std::string& s_;
  std::vector<Token> out_;
};

// ================================================================== syntax tree

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Const,
    Name,
    Getattr,
    Getitem,
    Slice,
    Call,
    Filter,
    Test,
    Unary,
    Binary,
    Compare,
    And,
    Or,
    Not,
    Cond,
    List,
    Tuple,
    Dict,
    Concat
  };
  Kind kind;
  size_t pos = 0;
  Value value;                // Const
  std::string name;           // Name, Getattr attribute, Filter/Test name, operator
  std::vector<ExprPtr> args;  // operands / items / positional arguments
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // keyword arguments; Dict items
  std::vector<std::string> ops;                         // Compare operators
  bool negated = false;                                 // Test
  bool has_call = false;                                // Filter / Test written with parentheses
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  enum class Kind { Text, Print, If, For, Set, SetAttr, SetBlock, Break, Continue, Generation };
  Kind kind;
  size_t pos = 0;
  std::string text;                  // Text; SetAttr namespace name
  std::vector<std::string> targets;  // For / Set names; SetBlock name; SetAttr attribute
  ExprPtr expr;                      // Print; For iterable; Set value
  ExprPtr filter;                    // For ... if
  std::vector<std::pair<ExprPtr, Body>> branches;  // If
  Body body, else_body;                            // For, SetBlock, Generation; If / For else
};

ExprPtr make_expr(Expr::Kind k, size_t pos) {
  auto e = std::make_unique<Expr>();
  e->kind = k;
  e->pos = pos;
  return e;
}

// ================================================================== parser

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  Body parse_template() {
    Body body = subparse({});
    if (cur().type != Tok::End) fail_at(cur().pos, "unexpected tag");
    return body;
  }

 private:
  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  bool is_op(const char* op) const { return cur().type == Tok::Op && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Tok::Name && cur().text == name; }
  void next() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  std::string describe(const Token& t) const {
    switch (t.type) {
      case Tok::Data:
        return "template text";
      case Tok::VarBegin:
        return "'{{'";
      case Tok::VarEnd:
        return "end of print statement '}}'";
      case Tok::BlockBegin:
        return "'{%'";
      case Tok::BlockEnd:
        return "end of statement block '%}'";
      case Tok::Name:
        return "'" + t.text + "'";
      case Tok::String:
        return "string literal";
      case Tok::Int:
      case Tok::Float:
        return "number '" + t.text + "'";
      case Tok::Op:
        return "'" + t.text + "'";
      case Tok::End:
        return "end of template";
    }
    return "?";
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail_at(cur().pos, fmt::format("expected '{}', got {}", op, describe(cur())));
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd)
      fail_at(cur().pos, "expected end of statement block '%}', got " + describe(cur()));
    next();
  }
  std::string expect_name() {
    if (cur().type != Tok::Name) fail_at(cur().pos, "expected a name, got " + describe(cur()));
    std::string n = cur().text;
    next();
    return n;
  }

  // Statements up to a block tag named in `ends` (left unconsumed, positioned on its name).
  Body subparse(const std::vector<std::string>& ends) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::End) {
        if (!ends.empty())
          fail_at(t.pos, "unexpected end of template: expected " + join_names(ends));
        return body;
      }
      if (t.type == Tok::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Text;
        s->pos = t.pos;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
        continue;
      }
      if (t.type == Tok::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Print;
        s->pos = t.pos;
        s->expr = parse_tuple(true);
        if (cur().type != Tok::VarEnd)
          fail_at(cur().pos, "expected end of print statement '}}', got " + describe(cur()));
        next();
        body.push_back(std::move(s));
        continue;
      }
      if (t.type != Tok::BlockBegin) fail_at(t.pos, "unexpected " + describe(t));
      next();
      if (cur().type != Tok::Name)
        fail_at(cur().pos, "expected a statement name, got " + describe(cur()));
      const std::string tag = cur().text;
      if (std::find(ends.begin(), ends.end(), tag) != ends.end()) return body;
      body.push_back(parse_statement(t.pos));
    }
  }

  static std::string join_names(const std::vector<std::string>& names) {
    std::string out;
    for (size_t k = 0; k < names.size(); ++k) out += (k ? " or '" : "'") + names[k] + "'";
    return out;
  }

  std::unique_ptr<Stmt> parse_statement(size_t pos) {
    const std::string tag = cur().text;
    const size_t tag_pos = cur().pos;
    next();
    auto s = std::make_unique<Stmt>();
    s->pos = pos;
    if (tag == "if") {
      s->kind = Stmt::Kind::If;
      ExprPtr cond = parse_tuple(false);
      while (true) {
        expect_block_end();
        Body b = subparse({"elif", "else", "endif"});
        s->branches.emplace_back(std::move(cond), std::move(b));
        const std::string end = cur().text;
        next();
        if (end == "elif") {
          cond = parse_tuple(false);
          continue;
        }
        if (end == "else") {
          expect_block_end();
          s->else_body = subparse({"endif"});
          next();
        }
        expect_block_end();
        return s;
      }
    }
    if (tag == "for") {
      s->kind = Stmt::Kind::For;
      s->targets = parse_targets();
      if (!skip_name("in")) fail_at(cur().pos, "expected 'in' in for loop, got " + describe(cur()));
      s->expr = parse_tuple(false, /*for_iter=*/true);
      if (skip_name("if")) s->filter = parse_expression(true);
      if (is_name("recursive")) fail_at(cur().pos, "unsupported: recursive for loops");
      expect_block_end();
      ++loop_depth_;
      s->body = subparse({"endfor", "else"});
      --loop_depth_;
      if (cur().text == "else") {
        next();
        expect_block_end();
        s->else_body = subparse({"endfor"});
      }
      next();
      expect_block_end();
      return s;
    }
    if (tag == "set") {
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == ".") {
        s->kind = Stmt::Kind::SetAttr;
        s->text = expect_name();
        next();  // '.'
        s->targets.push_back(expect_name());
        expect_op("=");
        s->expr = parse_tuple(true);
        expect_block_end();
        return s;
      }
      s->targets = parse_targets();
      if (skip_op("=")) {
        s->kind = Stmt::Kind::Set;
        s->expr = parse_tuple(true);
        expect_block_end();
        return s;
      }
      if (s->targets.size() != 1) fail_at(cur().pos, "a block set assigns one name");
      if (is_op("|")) fail_at(cur().pos, "unsupported: filters on a block set");
      s->kind = Stmt::Kind::SetBlock;
      expect_block_end();
      s->body = subparse({"endset"});
      next();
      expect_block_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail_at(tag_pos, fmt::format("'{}' outside of a for loop", tag));
      s->kind = tag == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue;
      expect_block_end();
      return s;
    }
    if (tag == "generation") {
      s->kind = Stmt::Kind::Generation;
      expect_block_end();
      s->body = subparse({"endgeneration"});
      next();
      expect_block_end();
      return s;
    }
    if (tag == "print") {
      s->kind = Stmt::Kind::Print;
      s->expr = parse_tuple(true);
      expect_block_end();
      return s;
    }
    static const char* const kUnsupported[] = {
        "macro", "call", "filter",     "include", "import", "from", "extends",
        "block", "with", "autoescape", "raw",     "do",     "trans"};
    for (const char* u : kUnsupported)
      if (tag == u)
        fail_at(tag_pos, fmt::format("unsupported statement '{}' (moe's chat template renderer "
                                     "implements the Jinja subset listed in data/chat_template.h)",
                                     tag));
    fail_at(tag_pos, fmt::format("unexpected or unknown statement '{}'", tag));
  }

  // for / set targets: a name or names separated by commas, optionally in parentheses.
  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = skip_op("(");
    do {
      names.push_back(expect_name());
    } while (skip_op(","));
    if (paren) expect_op(")");
    return names;
  }

  bool is_tuple_end() const {
    const Token& t = cur();
    if (t.type == Tok::VarEnd || t.type == Tok::BlockEnd || t.type == Tok::End) return true;
    if (t.type == Tok::Op && (t.text == ")" || t.text == "]" || t.text == "}" || t.text == "="))
      return true;
    return false;
  }

  ExprPtr parse_tuple(bool with_condexpr, bool for_iter = false, bool explicit_parens = false) {
    const size_t pos = cur().pos;
    std::vector<ExprPtr> items;
    bool comma = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        comma = true;
      }
      if (is_tuple_end() || (for_iter && is_name("if"))) break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (!comma && items.size() == 1) return std::move(items[0]);
    if (items.empty() && !explicit_parens)
      fail_at(cur().pos, "expected an expression, got " + describe(cur()));
    auto e = make_expr(Expr::Kind::Tuple, pos);
    e->args = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      const size_t pos = cur().pos;
      next();
      auto c = make_expr(Expr::Kind::Cond, pos);
      ExprPtr test = parse_or();
      ExprPtr other = skip_name("else") ? parse_condexpr() : nullptr;
      c->args.push_back(std::move(test));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(Expr::Kind k, const std::string& op, size_t pos, ExprPtr l, ExprPtr r) {
    auto e = make_expr(k, pos);
    e->name = op;
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      const size_t pos = cur().pos;
      next();
      e = binary(Expr::Kind::Or, "or", pos, std::move(e), parse_and());
    }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      const size_t pos = cur().pos;
      next();
      e = binary(Expr::Kind::And, "and", pos, std::move(e), parse_not());
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      const size_t pos = cur().pos;
      next();
      auto e = make_expr(Expr::Kind::Not, pos);
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const size_t pos = cur().pos;
    ExprPtr first = parse_math1();
    auto c = make_expr(Expr::Kind::Compare, pos);
    while (true) {
      std::string op;
      if (cur().type == Tok::Op &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
           cur().text == ">" || cur().text == ">=")) {
        op = cur().text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().type == Tok::Name && peek().text == "in") {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      c->ops.push_back(op);
      c->args.push_back(parse_math1());
    }
    if (c->ops.empty()) return first;
    c->args.insert(c->args.begin(), std::move(first));
    return c;
  }
  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = cur().text;
      const size_t pos = cur().pos;
      next();
      e = binary(Expr::Kind::Binary, op, pos, std::move(e), parse_concat());
    }
    return e;
  }
  ExprPtr parse_concat() {
    const size_t pos = cur().pos;
    ExprPtr e = parse_math2();
    if (!is_op("~")) return e;
    auto c = make_expr(Expr::Kind::Concat, pos);
    c->args.push_back(std::move(e));
    while (skip_op("~")) c->args.push_back(parse_math2());
    return c;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = cur().text;
      const size_t pos = cur().pos;
      next();
      e = binary(Expr::Kind::Binary, op, pos, std::move(e), parse_pow());
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      const size_t pos = cur().pos;
      next();
      e = binary(Expr::Kind::Binary, "**", pos, std::move(e), parse_unary(true));
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    const size_t pos = cur().pos;
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const std::string op = cur().text;
      next();
      e = make_expr(Expr::Kind::Unary, pos);
      e->name = op;
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    const size_t pos = t.pos;
    if (t.type == Tok::Name) {
      auto e = make_expr(Expr::Kind::Const, pos);
      if (t.text == "true" || t.text == "True")
        e->value = Value::boolean(true);
      else if (t.text == "false" || t.text == "False")
        e->value = Value::boolean(false);
      else if (t.text == "none" || t.text == "None")
        e->value = Value::none();
      else {
        e->kind = Expr::Kind::Name;
        e->name = t.text;
      }
      next();
      return e;
    }
    if (t.type == Tok::String) {
      std::string s;
      while (cur().type == Tok::String) {  // adjacent literals concatenate
        s += cur().text;
        next();
      }
      auto e = make_expr(Expr::Kind::Const, pos);
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      auto e = make_expr(Expr::Kind::Const, pos);
      e->value = t.type == Tok::Int ? Value::integer(t.i) : Value::floating(t.f);
      next();
      return e;
    }
    if (skip_op("(")) {
      ExprPtr e = parse_tuple(true, false, true);
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto e = make_expr(Expr::Kind::List, pos);
      while (!is_op("]")) {
        if (!e->args.empty()) {
          expect_op(",");
          if (is_op("]")) break;
        }
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (skip_op("{")) {
      auto e = make_expr(Expr::Kind::Dict, pos);
      while (!is_op("}")) {
        if (!e->args.empty()) {
          expect_op(",");
          if (is_op("}")) break;
        }
        e->args.push_back(parse_expression(true));  // key
        expect_op(":");
        e->kwargs.emplace_back("", parse_expression(true));  // value
      }
      expect_op("}");
      return e;
    }
    fail_at(pos, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        e = parse_filter(std::move(e));
      } else if (is_name("is")) {
        e = parse_test(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const size_t pos = cur().pos;
    if (skip_op(".")) {
      if (cur().type == Tok::Name) {
        auto e = make_expr(Expr::Kind::Getattr, pos);
        e->name = cur().text;
        e->args.push_back(std::move(obj));
        next();
        return e;
      }
      if (cur().type == Tok::Int) {
        auto e = make_expr(Expr::Kind::Getitem, pos);
        auto k = make_expr(Expr::Kind::Const, cur().pos);
        k->value = Value::integer(cur().i);
        e->args.push_back(std::move(obj));
        e->args.push_back(std::move(k));
        next();
        return e;
      }
      fail_at(cur().pos, "expected an attribute name after '.', got " + describe(cur()));
    }
    expect_op("[");
    ExprPtr start, stop, step;
    bool slice = false;
    if (!is_op(":")) start = parse_expression(true);
    if (skip_op(":")) {
      slice = true;
      if (!is_op("]") && !is_op(":")) stop = parse_expression(true);
      if (skip_op(":") && !is_op("]")) step = parse_expression(true);
    }
    if (is_op(",")) fail_at(cur().pos, "unsupported: tuple subscripts");
    expect_op("]");
    auto e = make_expr(slice ? Expr::Kind::Slice : Expr::Kind::Getitem, pos);
    e->args.push_back(std::move(obj));
    e->args.push_back(std::move(start));
    if (slice) {
      e->args.push_back(std::move(stop));
      e->args.push_back(std::move(step));
    }
    return e;
  }

  // Arguments after e.args' existing entries (the callee, or a filter's / test's input).
  void parse_call_args(Expr& e) {
    expect_op("(");
    const size_t before = e.args.size();
    while (!is_op(")")) {
      if (e.args.size() > before || !e.kwargs.empty()) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) fail_at(cur().pos, "unsupported: *args / **kwargs in calls");
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == "=") {
        std::string key = cur().text;
        next();
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) fail_at(cur().pos, "positional argument after keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = make_expr(Expr::Kind::Call, cur().pos);
    e->args.push_back(std::move(callee));
    parse_call_args(*e);
    return e;
  }

  ExprPtr parse_filter(ExprPtr input) {
    next();  // '|'
    const size_t pos = cur().pos;
    auto e = make_expr(Expr::Kind::Filter, pos);
    e->name = expect_name();
    while (skip_op(".")) e->name += "." + expect_name();
    e->args.push_back(std::move(input));
    if (is_op("(")) {
      e->has_call = true;
      parse_call_args(*e);
    }
    return e;
  }

  ExprPtr parse_test(ExprPtr input) {
    next();  // 'is'
    auto e = make_expr(Expr::Kind::Test, cur().pos);
    e->negated = skip_name("not");
    e->name = expect_name();
    while (skip_op(".")) e->name += "." + expect_name();
    e->args.push_back(std::move(input));
    const Token& t = cur();
    if (is_op("(")) {
      e->has_call = true;
      parse_call_args(*e);
    } else if ((t.type == Tok::Name || t.type == Tok::String || t.type == Tok::Int ||
                t.type == Tok::Float || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail_at(t.pos, "you cannot chain multiple tests with is");
      e->args.push_back(parse_postfix(parse_primary()));  // `x is divisibleby 3`, as jinja2
    }
    return e;
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int loop_depth_ = 0;
};

// ================================================================== evaluation

enum class Flow { Normal, Break, Continue };

struct Scope {
  Scope* parent = nullptr;
  ValueDict vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent)
      if (const Value* v = dict_find(s->vars, name)) return v;
    return nullptr;
  }
};

// Python slice indices (PySlice_AdjustIndices).
std::vector<size_t> slice_indices(int64_t len, const Value* start, const Value* stop,
                                  const Value* step, size_t pos) {
  const auto get = [&](const Value* v, const char* what) -> std::optional<int64_t> {
    if (!v || v->is(Value::Kind::None)) return std::nullopt;
    if (!v->is(Value::Kind::Int) && !v->is(Value::Kind::Bool))
      fail_at(pos, fmt::format("slice {} must be an integer or none, got {}", what, type_name(*v)));
    return as_int(*v);
  };
  const int64_t st = get(step, "step").value_or(1);
  if (st == 0) fail_at(pos, "slice step cannot be zero");
  const auto adjust = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) {
      x += len;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= len) {
      x = st < 0 ? len - 1 : len;
    }
    return x;
  };
  const int64_t b = adjust(get(start, "start"), st < 0 ? len - 1 : 0);
  const int64_t e = adjust(get(stop, "stop"), st < 0 ? -1 : len);
  std::vector<size_t> out;
  for (int64_t k = b; st > 0 ? k < e : k > e; k += st) out.push_back(static_cast<size_t>(k));
  return out;
}

std::string undefined_message(const Value& v) {
  return v.s.empty() ? std::string("undefined value") : v.s;
}

class Renderer {
 public:
  std::string out;

  Flow exec(const Body& body, Scope& scope) {
    for (const auto& s : body) {
      const Flow f = exec(*s, scope);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

 private:
  Flow exec(const Stmt& s, Scope& scope) {
    switch (s.kind) {
      case Stmt::Kind::Text:
        out += s.text;
        return Flow::Normal;
      case Stmt::Kind::Print:
        out += py_str(eval(*s.expr, scope));
        return Flow::Normal;
      case Stmt::Kind::If:
        for (const auto& [cond, body] : s.branches)
          if (truthy(eval(*cond, scope))) return exec(body, scope);
        return exec(s.else_body, scope);
      case Stmt::Kind::For:
        return exec_for(s, scope);
      case Stmt::Kind::Set:
        assign(s.targets, eval(*s.expr, scope), scope, s.pos);
        return Flow::Normal;
      case Stmt::Kind::SetAttr: {
        const Value* target = scope.find(s.text);
        if (!target || !target->is(Value::Kind::Namespace))
          fail_at(s.pos,
                  fmt::format("cannot assign attribute on non-namespace object '{}'", s.text));
        Value v = eval(*s.expr, scope);
        dict_set(target->ns->attrs, s.targets[0], std::move(v));
        return Flow::Normal;
      }
      case Stmt::Kind::SetBlock: {
        std::string saved = std::move(out);
        out.clear();
        exec(s.body, scope);
        std::string captured = std::move(out);
        out = std::move(saved);
        dict_set(scope.vars, s.targets[0], Value::string(std::move(captured)));
        return Flow::Normal;
      }
      case Stmt::Kind::Break:
        return Flow::Break;
      case Stmt::Kind::Continue:
        return Flow::Continue;
      case Stmt::Kind::Generation:
        return exec(s.body, scope);
    }
    return Flow::Normal;
  }

  void assign(const std::vector<std::string>& names, Value v, Scope& scope, size_t pos) {
    if (names.size() == 1) {
      dict_set(scope.vars, names[0], std::move(v));
      return;
    }
    const ValueList items = iterate(v, pos);
    if (items.size() != names.size())
      fail_at(pos,
              fmt::format("cannot unpack {} values into {} names", items.size(), names.size()));
    for (size_t k = 0; k < names.size(); ++k) dict_set(scope.vars, names[k], items[k]);
  }

  // The items a for loop (or unpacking) goes through.
  ValueList iterate(const Value& v, size_t pos) {
    switch (v.kind) {
      case Value::Kind::Undefined:
        return {};
      case Value::Kind::List:
        return *v.list;
      case Value::Kind::Dict: {
        ValueList keys;
        for (const auto& kv : *v.dict) keys.push_back(Value::string(kv.first));
        return keys;
      }
      case Value::Kind::String: {
        ValueList chars;
        const std::vector<size_t> at = code_point_offsets(v.s);
        for (size_t k = 0; k + 1 < at.size(); ++k)
          chars.push_back(Value::string(v.s.substr(at[k], at[k + 1] - at[k])));
        return chars;
      }
      default:
        fail_at(pos, fmt::format("'{}' object is not iterable", type_name(v)));
    }
  }

  Flow exec_for(const Stmt& s, Scope& scope) {
    ValueList items = iterate(eval(*s.expr, scope), s.expr->pos);
    if (s.filter) {
      ValueList kept;
      for (const Value& item : items) {
        Scope probe{&scope, {}};
        assign(s.targets, item, probe, s.pos);
        if (truthy(eval(*s.filter, probe))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(s.else_body, scope);
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      Scope iteration{&scope, {}};
      ValueDict loop{{"index0", Value::integer(k)},
                     {"index", Value::integer(k + 1)},
                     {"revindex0", Value::integer(n - k - 1)},
                     {"revindex", Value::integer(n - k)},
                     {"first", Value::boolean(k == 0)},
                     {"last", Value::boolean(k == n - 1)},
                     {"length", Value::integer(n)},
                     {"depth", Value::integer(1)},
                     {"depth0", Value::integer(0)}};
      loop.emplace_back("previtem", k > 0 ? items[static_cast<size_t>(k - 1)]
                                          : Value::undefined("there is no previous item"));
      loop.emplace_back("nextitem", k + 1 < n ? items[static_cast<size_t>(k + 1)]
                                              : Value::undefined("there is no next item"));
      iteration.vars.emplace_back("loop", Value::make_dict(std::move(loop)));
      assign(s.targets, items[static_cast<size_t>(k)], iteration, s.pos);
      if (exec(s.body, iteration) == Flow::Break) break;
    }
    return Flow::Normal;
  }

  // ---------------------------------------------------------------- expressions

  [[noreturn]] void undefined_error(const Value& v, size_t pos) {
    fail_at(pos, undefined_message(v));
  }

  Value eval(const Expr& e, Scope& scope) {
    switch (e.kind) {
      case Expr::Kind::Const:
        return e.value;
      case Expr::Kind::Name: {
        if (const Value* v = scope.find(e.name)) return *v;
        return Value::undefined(fmt::format("'{}' is undefined", e.name));
      }
      case Expr::Kind::Getattr:
        return getattr(eval(*e.args[0], scope), e.name, e.pos);
      case Expr::Kind::Getitem:
        return getitem(eval(*e.args[0], scope), eval(*e.args[1], scope), e.pos);
      case Expr::Kind::Slice:
        return slice(e, scope);
      case Expr::Kind::Call:
        return call(e, scope);
      case Expr::Kind::Filter:
        return filter(e, scope);
      case Expr::Kind::Test: {
        const bool r = test(e, scope);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::Kind::Unary: {
        const Value v = eval(*e.args[0], scope);
        if (v.is(Value::Kind::Undefined)) undefined_error(v, e.pos);
        if (!v.is_number())
          fail_at(e.pos, fmt::format("bad operand type for unary {}: '{}'", e.name, type_name(v)));
        if (e.name == "+") return v.is(Value::Kind::Bool) ? Value::integer(as_int(v)) : v;
        return v.is(Value::Kind::Float) ? Value::floating(-v.f) : Value::integer(-as_int(v));
      }
      case Expr::Kind::Binary:
        return binary(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope), e.pos);
      case Expr::Kind::Compare: {
        Value left = eval(*e.args[0], scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1], scope);
          if (!compare(e.ops[k], left, right, e.pos)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::And: {
        Value l = eval(*e.args[0], scope);
        return truthy(l) ? eval(*e.args[1], scope) : l;
      }
      case Expr::Kind::Or: {
        Value l = eval(*e.args[0], scope);
        return truthy(l) ? l : eval(*e.args[1], scope);
      }
      case Expr::Kind::Not:
        return Value::boolean(!truthy(eval(*e.args[0], scope)));
      case Expr::Kind::Cond:
        if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined(
            "the inline if-expression evaluated to false and no else section was defined");
      case Expr::Kind::List:
      case Expr::Kind::Tuple: {
        ValueList items;
        for (const auto& a : e.args) items.push_back(eval(*a, scope));
        return Value::make_list(std::move(items), e.kind == Expr::Kind::Tuple);
      }
      case Expr::Kind::Dict: {
        ValueDict items;
        for (size_t k = 0; k < e.args.size(); ++k) {
          const Value key = eval(*e.args[k], scope);
          if (!key.is(Value::Kind::String))
            fail_at(e.args[k]->pos, fmt::format("unsupported: dict keys of type {} (only strings)",
                                                type_name(key)));
          dict_set(items, key.s, eval(*e.kwargs[k].second, scope));
        }
        return Value::make_dict(std::move(items));
      }
      case Expr::Kind::Concat: {
        std::string s;
        for (const auto& a : e.args) s += py_str(eval(*a, scope));
        return Value::string(std::move(s));
      }
    }
    return Value::none();
  }

  Value getattr(const Value& obj, const std::string& name, size_t pos) {
    switch (obj.kind) {
      case Value::Kind::Undefined:
        undefined_error(obj, pos);
      case Value::Kind::Dict:
        if (const Value* v = dict_find(*obj.dict, name)) return *v;
        return Value::undefined(fmt::format("'dict object' has no attribute '{}'", name));
      case Value::Kind::Namespace:
        if (const Value* v = dict_find(obj.ns->attrs, name)) return *v;
        return Value::undefined(fmt::format("'Namespace object' has no attribute '{}'", name));
      default:
        return Value::undefined(
            fmt::format("'{} object' has no attribute '{}'", type_name(obj), name));
    }
  }

  Value getitem(const Value& obj, const Value& key, size_t pos) {
    if (obj.is(Value::Kind::Undefined)) undefined_error(obj, pos);
    const auto index = [&](int64_t len) -> std::optional<size_t> {
      if (!key.is(Value::Kind::Int) && !key.is(Value::Kind::Bool)) return std::nullopt;
      int64_t k = as_int(key);
      if (k < 0) k += len;
      if (k < 0 || k >= len) return std::nullopt;
      return static_cast<size_t>(k);
    };
    switch (obj.kind) {
      case Value::Kind::Dict:
      case Value::Kind::Namespace:
        if (key.is(Value::Kind::String)) return getattr(obj, key.s, pos);
        return Value::undefined(
            fmt::format("'{} object' has no attribute '{}'", type_name(obj), py_str(key)));
      case Value::Kind::List:
        if (auto k = index(static_cast<int64_t>(obj.list->size()))) return (*obj.list)[*k];
        break;
      case Value::Kind::String: {
        const std::vector<size_t> at = code_point_offsets(obj.s);
        if (auto k = index(static_cast<int64_t>(at.size()) - 1))
          return Value::string(obj.s.substr(at[*k], at[*k + 1] - at[*k]));
        break;
      }
      default:
        break;
    }
    return Value::undefined(
        fmt::format("'{} object' has no attribute '{}'", type_name(obj), py_str(key)));
  }

  Value slice(const Expr& e, Scope& scope) {
    const Value obj = eval(*e.args[0], scope);
    Value start, stop, step;
    if (e.args[1]) start = eval(*e.args[1], scope);
    if (e.args[2]) stop = eval(*e.args[2], scope);
    if (e.args[3]) step = eval(*e.args[3], scope);
    const Value* ps = e.args[1] ? &start : nullptr;
    const Value* pe = e.args[2] ? &stop : nullptr;
    const Value* pt = e.args[3] ? &step : nullptr;
    if (obj.is(Value::Kind::Undefined)) undefined_error(obj, e.pos);
    if (obj.is(Value::Kind::List)) {
      ValueList items;
      for (size_t k : slice_indices(static_cast<int64_t>(obj.list->size()), ps, pe, pt, e.pos))
        items.push_back((*obj.list)[k]);
      return Value::make_list(std::move(items), obj.tuple);
    }
    if (obj.is(Value::Kind::String)) {
      const std::vector<size_t> at = code_point_offsets(obj.s);
      std::string s;
      for (size_t k : slice_indices(static_cast<int64_t>(at.size()) - 1, ps, pe, pt, e.pos))
        s.append(obj.s, at[k], at[k + 1] - at[k]);
      return Value::string(std::move(s));
    }
    return Value::undefined(fmt::format("'{}' object is not subscriptable", type_name(obj)));
  }

  Value binary(const std::string& op, const Value& a, const Value& b, size_t pos) {
    if (a.is(Value::Kind::Undefined)) undefined_error(a, pos);
    if (b.is(Value::Kind::Undefined)) undefined_error(b, pos);
    const auto unsupported = [&]() -> Value {
      fail_at(pos, fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op,
                               type_name(a), type_name(b)));
    };
    if (a.is_number() && b.is_number()) {
      const bool fl = a.is(Value::Kind::Float) || b.is(Value::Kind::Float);
      if (op == "/") {
        if (as_double(b) == 0.0) fail_at(pos, "division by zero");
        return Value::floating(as_double(a) / as_double(b));
      }
      if (op == "**") {
        if (!fl && as_int(b) >= 0) {
          int64_t r = 1;
          for (int64_t k = 0; k < as_int(b); ++k) r *= as_int(a);
          return Value::integer(r);
        }
        return Value::floating(std::pow(as_double(a), as_double(b)));
      }
      if (fl) {
        const double x = as_double(a), y = as_double(b);
        if (op == "+") return Value::floating(x + y);
        if (op == "-") return Value::floating(x - y);
        if (op == "*") return Value::floating(x * y);
        if (y == 0.0) fail_at(pos, "float division by zero");
        if (op == "//") return Value::floating(std::floor(x / y));
        if (op == "%") {
          double m = std::fmod(x, y);
          if (m != 0.0 && ((m < 0) != (y < 0))) m += y;
          return Value::floating(m);
        }
      } else {
        const int64_t x = as_int(a), y = as_int(b);
        if (op == "+") return Value::integer(x + y);
        if (op == "-") return Value::integer(x - y);
        if (op == "*") return Value::integer(x * y);
        if (y == 0) fail_at(pos, "integer division or modulo by zero");
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --q;
          m += y;
        }
        if (op == "//") return Value::integer(q);
        if (op == "%") return Value::integer(m);
      }
      return unsupported();
    }
    if (op == "+") {
      if (a.is(Value::Kind::String) && b.is(Value::Kind::String)) return Value::string(a.s + b.s);
      if (a.is(Value::Kind::List) && b.is(Value::Kind::List) && a.tuple == b.tuple) {
        ValueList items = *a.list;
        items.insert(items.end(), b.list->begin(), b.list->end());
        return Value::make_list(std::move(items), a.tuple);
      }
      if (a.is(Value::Kind::String))
        fail_at(pos, fmt::format("can only concatenate str (not \"{}\") to str", type_name(b)));
      return unsupported();
    }
    if (op == "*") {
      const Value* seq = a.is_number() ? &b : &a;
      const Value* times = a.is_number() ? &a : &b;
      if (!times->is(Value::Kind::Int) && !times->is(Value::Kind::Bool)) return unsupported();
      const int64_t n = std::max<int64_t>(0, as_int(*times));
      if (seq->is(Value::Kind::String)) {
        std::string s;
        for (int64_t k = 0; k < n; ++k) s += seq->s;
        return Value::string(std::move(s));
      }
      if (seq->is(Value::Kind::List)) {
        ValueList items;
        for (int64_t k = 0; k < n; ++k)
          items.insert(items.end(), seq->list->begin(), seq->list->end());
        return Value::make_list(std::move(items), seq->tuple);
      }
      return unsupported();
    }
    if (op == "%" && a.is(Value::Kind::String))
      fail_at(pos, "unsupported: printf-style string formatting (%)");
    return unsupported();
  }

  bool contains(const Value& container, const Value& item, size_t pos) {
    switch (container.kind) {
      case Value::Kind::Undefined:
        return false;
      case Value::Kind::String:
        if (!item.is(Value::Kind::String))
          fail_at(pos, fmt::format("'in <string>' requires string as left operand, not {}",
                                   type_name(item)));
        return container.s.find(item.s) != std::string::npos;
      case Value::Kind::List:
        return std::any_of(container.list->begin(), container.list->end(),
                           [&](const Value& v) { return py_equal(v, item); });
      case Value::Kind::Dict:
        return item.is(Value::Kind::String) && dict_find(*container.dict, item.s);
      default:
        fail_at(pos, fmt::format("argument of type '{}' is not iterable", type_name(container)));
    }
  }

  bool compare(const std::string& op, const Value& a, const Value& b, size_t pos) {
    if (op == "==") return py_equal(a, b);
    if (op == "!=") return !py_equal(a, b);
    if (op == "in") return contains(b, a, pos);
    if (op == "not in") return !contains(b, a, pos);
    int c = 0;
    if (a.is_number() && b.is_number()) {
      const double x = as_double(a), y = as_double(b);
      if (!a.is(Value::Kind::Float) && !b.is(Value::Kind::Float)) {
        c = as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b) ? 1 : 0;
      } else {
        c = x < y ? -1 : x > y ? 1 : 0;
      }
    } else if (a.is(Value::Kind::String) && b.is(Value::Kind::String)) {
      c = a.s.compare(b.s);  // UTF-8 byte order = code point order
      c = c < 0 ? -1 : c > 0 ? 1 : 0;
    } else {
      if (a.is(Value::Kind::Undefined)) undefined_error(a, pos);
      if (b.is(Value::Kind::Undefined)) undefined_error(b, pos);
      fail_at(pos, fmt::format("'{}' not supported between instances of '{}' and '{}'", op,
                               type_name(a), type_name(b)));
    }
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;  // ">="
  }

  // ---------------------------------------------------------------- calls

  struct Args {
    std::vector<Value> pos;
    ValueDict kw;
  };

  Args eval_args(const Expr& e, Scope& scope, size_t first) {
    Args a;
    for (size_t k = first; k < e.args.size(); ++k) a.pos.push_back(eval(*e.args[k], scope));
    for (const auto& [name, x] : e.kwargs) a.kw.emplace_back(name, eval(*x, scope));
    return a;
  }

  // Argument `index` or keyword `name` of a function with the given parameters; nullptr if
  // not given. Raises on too many or unknown arguments.
  static void check_args(const Args& a, const std::vector<std::string>& params,
                         const std::string& what, size_t pos) {
    if (a.pos.size() > params.size())
      fail_at(pos, fmt::format("{} takes at most {} arguments, got {}", what, params.size(),
                               a.pos.size()));
    for (const auto& [k, v] : a.kw)
      if (std::find(params.begin(), params.end(), k) == params.end())
        fail_at(pos, fmt::format("{} got an unexpected keyword argument '{}'", what, k));
  }
  static const Value* arg(const Args& a, size_t index, const std::string& name) {
    if (index < a.pos.size()) return &a.pos[index];
    return dict_find(a.kw, name);
  }
  static std::string str_arg(const Value* v, const std::string& what, size_t pos) {
    if (!v || !v->is(Value::Kind::String))
      fail_at(pos, fmt::format("{}: expected a string argument, got {}", what,
                               v ? type_name(*v) : "none"));
    return v->s;
  }

  Value call(const Expr& e, Scope& scope) {
    const Expr& callee = *e.args[0];
    if (callee.kind == Expr::Kind::Getattr) {
      const Value obj = eval(*callee.args[0], scope);
      if (obj.is(Value::Kind::Undefined)) undefined_error(obj, callee.pos);
      return method(obj, callee.name, eval_args(e, scope, 1), e.pos);
    }
    if (callee.kind == Expr::Kind::Name && !scope.find(callee.name)) {
      const Args a = eval_args(e, scope, 1);
      if (callee.name == "raise_exception") {
        check_args(a, {"message"}, "raise_exception", e.pos);
        const Value* m = arg(a, 0, "message");
        throw Error(m ? py_str(*m) : std::string());
      }
      if (callee.name == "namespace") {
        auto ns = std::make_shared<NamespaceObject>();
        for (const Value& p : a.pos) {
          if (!p.is(Value::Kind::Dict))
            fail_at(e.pos, "namespace(): positional arguments must be dicts");
          for (const auto& [k, v] : *p.dict) dict_set(ns->attrs, k, v);
        }
        for (const auto& [k, v] : a.kw) dict_set(ns->attrs, k, v);
        Value v;
        v.kind = Value::Kind::Namespace;
        v.ns = std::move(ns);
        return v;
      }
      if (callee.name == "range") {
        if (a.pos.empty() || a.pos.size() > 3 || !a.kw.empty())
          fail_at(e.pos, "range() takes 1 to 3 integer arguments");
        for (const Value& p : a.pos)
          if (!p.is(Value::Kind::Int) && !p.is(Value::Kind::Bool))
            fail_at(e.pos, "range() takes integer arguments");
        const int64_t start = a.pos.size() == 1 ? 0 : as_int(a.pos[0]);
        const int64_t stop = a.pos.size() == 1 ? as_int(a.pos[0]) : as_int(a.pos[1]);
        const int64_t step = a.pos.size() == 3 ? as_int(a.pos[2]) : 1;
        if (step == 0) fail_at(e.pos, "range() arg 3 must not be zero");
        ValueList items;
        for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
          items.push_back(Value::integer(k));
          if (items.size() > 100000) fail_at(e.pos, "range() too large");
        }
        return Value::make_list(std::move(items));
      }
      fail_at(callee.pos, fmt::format("unsupported function '{}' (moe's chat template renderer "
                                      "implements raise_exception, namespace and range)",
                                      callee.name));
    }
    const Value v = eval(callee, scope);
    if (v.is(Value::Kind::Undefined)) undefined_error(v, callee.pos);
    fail_at(callee.pos, fmt::format("'{}' object is not callable", type_name(v)));
  }

  Value method(const Value& obj, const std::string& name, const Args& a, size_t pos) {
    const std::string what = fmt::format("{}.{}()", type_name(obj), name);
    if (obj.is(Value::Kind::String)) {
      const std::string& s = obj.s;
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        check_args(a, {"chars"}, what, pos);
        const Value* c = arg(a, 0, "chars");
        std::string chars;
        if (c && !c->is(Value::Kind::None)) chars = str_arg(c, what, pos);
        const bool has_chars = c && !c->is(Value::Kind::None);
        return Value::string(
            py_strip(s, has_chars ? &chars : nullptr, name != "rstrip", name != "lstrip"));
      }
      if (name == "split" || name == "rsplit") {
        check_args(a, {"sep", "maxsplit"}, what, pos);
        const Value* sepv = arg(a, 0, "sep");
        const Value* maxv = arg(a, 1, "maxsplit");
        const int64_t maxsplit = maxv ? as_int(*maxv) : -1;
        return Value::make_list(split(s, sepv && !sepv->is(Value::Kind::None) ? &sepv->s : nullptr,
                                      maxsplit, name == "rsplit", pos));
      }
      if (name == "startswith" || name == "endswith") {
        check_args(a, {"prefix"}, what, pos);
        const Value* p = arg(a, 0, "prefix");
        std::vector<std::string> options;
        if (p && p->is(Value::Kind::List)) {
          for (const Value& x : *p->list) options.push_back(str_arg(&x, what, pos));
        } else {
          options.push_back(str_arg(p, what, pos));
        }
        for (const std::string& o : options) {
          if (name == "startswith"
                  ? s.compare(0, o.size(), o) == 0
                  : (s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0))
            return Value::boolean(true);
        }
        return Value::boolean(false);
      }
      if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
        check_args(a, {}, what, pos);
        return Value::string(case_map(s, name));
      }
      if (name == "replace") {
        check_args(a, {"old", "new", "count"}, what, pos);
        const Value* c = arg(a, 2, "count");
        return Value::string(replace(s, str_arg(arg(a, 0, "old"), what, pos),
                                     str_arg(arg(a, 1, "new"), what, pos), c ? as_int(*c) : -1));
      }
      if (name == "find" || name == "count") {
        check_args(a, {"sub"}, what, pos);
        const std::string sub = str_arg(arg(a, 0, "sub"), what, pos);
        if (name == "find") {
          const size_t at = s.find(sub);
          if (at == std::string::npos) return Value::integer(-1);
          return Value::integer(static_cast<int64_t>(code_point_offsets(s.substr(0, at)).size()) -
                                1);
        }
        return Value::integer(count_of(s, sub));
      }
      if (name == "join") {
        check_args(a, {"iterable"}, what, pos);
        const Value* it = arg(a, 0, "iterable");
        std::string out;
        bool first = true;
        for (const Value& x : iterate(it ? *it : Value(), pos)) {
          if (!x.is(Value::Kind::String))
            fail_at(pos, fmt::format("str.join(): expected str instance, {} found", type_name(x)));
          out += (first ? "" : s) + x.s;
          first = false;
        }
        return Value::string(std::move(out));
      }
    }
    if (obj.is(Value::Kind::Dict)) {
      if (name == "get") {
        check_args(a, {"key", "default"}, what, pos);
        const Value* k = arg(a, 0, "key");
        const Value* d = arg(a, 1, "default");
        if (k && k->is(Value::Kind::String))
          if (const Value* v = dict_find(*obj.dict, k->s)) return *v;
        return d ? *d : Value::none();
      }
      if (name == "items" || name == "keys" || name == "values") {
        check_args(a, {}, what, pos);
        ValueList out;
        for (const auto& [k, v] : *obj.dict) {
          if (name == "items")
            out.push_back(Value::make_list({Value::string(k), v}, true));
          else if (name == "keys")
            out.push_back(Value::string(k));
          else
            out.push_back(v);
        }
        return Value::make_list(std::move(out));
      }
    }
    fail_at(pos, fmt::format("unsupported method {} (moe's chat template renderer implements the "
                             "methods listed in data/chat_template.h)",
                             what));
  }

  static std::string case_map(const std::string& s, const std::string& how) {
    if (how == "upper") return ascii_upper(s);
    if (how == "lower") return ascii_lower(s);
    std::string out = ascii_lower(s);
    if (how == "capitalize") {
      if (!out.empty()) out[0] = ascii_upper(out.substr(0, 1))[0];
      return out;
    }
    bool start = true;  // title
    for (char& c : out) {
      const bool alpha = std::isalpha(static_cast<unsigned char>(c));
      if (alpha && start) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      start = !alpha;
    }
    return out;
  }

  static std::string replace(const std::string& s, const std::string& from, const std::string& to,
                             int64_t count) {
    if (from.empty()) {
      // Python inserts `to` between every code point (and at both ends).
      const std::vector<size_t> at = code_point_offsets(s);
      std::string out;
      int64_t done = 0;
      for (size_t k = 0; k < at.size(); ++k) {
        if (count < 0 || done < count) {
          out += to;
          ++done;
        }
        if (k + 1 < at.size()) out.append(s, at[k], at[k + 1] - at[k]);
      }
      return out;
    }
    std::string out;
    size_t p = 0;
    int64_t done = 0;
    while (count < 0 || done < count) {
      const size_t f = s.find(from, p);
      if (f == std::string::npos) break;
      out.append(s, p, f - p);
      out += to;
      p = f + from.size();
      ++done;
    }
    out.append(s, p);
    return out;
  }

  static int64_t count_of(const std::string& s, const std::string& sub) {
    if (sub.empty()) return static_cast<int64_t>(code_point_offsets(s).size());
    int64_t n = 0;
    for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
    return n;
  }

  static ValueList split(const std::string& s, const std::string* sep, int64_t maxsplit,
                         bool from_right, size_t pos) {
    std::vector<std::string> parts;
    if (sep) {
      if (sep->empty()) fail_at(pos, "split(): empty separator");
      if (!from_right) {
        size_t p = 0;
        int64_t done = 0;
        while (maxsplit < 0 || done < maxsplit) {
          const size_t f = s.find(*sep, p);
          if (f == std::string::npos) break;
          parts.push_back(s.substr(p, f - p));
          p = f + sep->size();
          ++done;
        }
        parts.push_back(s.substr(p));
      } else {
        size_t end = s.size();
        int64_t done = 0;
        std::vector<std::string> rev;
        while (maxsplit < 0 || done < maxsplit) {
          if (end < sep->size()) break;
          const size_t f = s.rfind(*sep, end - sep->size());
          if (f == std::string::npos) break;
          rev.push_back(s.substr(f + sep->size(), end - f - sep->size()));
          end = f;
          ++done;
        }
        rev.push_back(s.substr(0, end));
        parts.assign(rev.rbegin(), rev.rend());
      }
    } else {
      // Runs of whitespace separate; leading and trailing whitespace make no empty parts.
      const std::vector<size_t> at = code_point_offsets(s);
      std::vector<std::pair<size_t, size_t>> words;  // byte ranges
      size_t n = 0;
      for (size_t k = 0; k + 1 < at.size();) {
        if (py_isspace(decode_at(s, at[k], &n))) {
          ++k;
          continue;
        }
        size_t j = k;
        while (j + 1 < at.size() && !py_isspace(decode_at(s, at[j], &n))) ++j;
        words.emplace_back(at[k], at[j]);
        k = j;
      }
      if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit) {
        if (!from_right) {
          for (int64_t k = 0; k < maxsplit; ++k)
            parts.push_back(s.substr(words[k].first, words[k].second - words[k].first));
          parts.push_back(s.substr(words[maxsplit].first));  // the rest, trailing space kept
        } else {
          const size_t keep = words.size() - static_cast<size_t>(maxsplit);
          parts.push_back(s.substr(0, words[keep - 1].second));  // leading space kept
          for (size_t k = keep; k < words.size(); ++k)
            parts.push_back(s.substr(words[k].first, words[k].second - words[k].first));
        }
      } else {
        for (const auto& [b, e] : words) parts.push_back(s.substr(b, e - b));
      }
    }
    ValueList out;
    for (std::string& p : parts) out.push_back(Value::string(std::move(p)));
    return out;
  }

  // ---------------------------------------------------------------- filters and tests

  static int64_t length_of(const Value& v, size_t pos) {
    switch (v.kind) {
      case Value::Kind::Undefined:
        return 0;
      case Value::Kind::String:
        return static_cast<int64_t>(code_point_offsets(v.s).size()) - 1;
      case Value::Kind::List:
        return static_cast<int64_t>(v.list->size());
      case Value::Kind::Dict:
        return static_cast<int64_t>(v.dict->size());
      default:
        fail_at(pos, fmt::format("object of type '{}' has no len()", type_name(v)));
    }
  }

  Value filter(const Expr& e, Scope& scope) {
    const Value in = eval(*e.args[0], scope);
    const Args a = eval_args(e, scope, 1);
    const std::string& f = e.name;
    const std::string what = "filter '" + f + "'";
    const size_t pos = e.pos;
    if (f == "default" || f == "d") {
      check_args(a, {"default_value", "boolean"}, what, pos);
      const Value* d = arg(a, 0, "default_value");
      const Value* boolean = arg(a, 1, "boolean");
      const bool use_default =
          in.is(Value::Kind::Undefined) || (boolean && truthy(*boolean) && !truthy(in));
      return use_default ? (d ? *d : Value::string("")) : in;
    }
    if (f == "length" || f == "count") {
      check_args(a, {}, what, pos);
      return Value::integer(length_of(in, pos));
    }
    if (f == "trim") {
      check_args(a, {"chars"}, what, pos);
      const Value* c = arg(a, 0, "chars");
      std::string chars = c && !c->is(Value::Kind::None) ? str_arg(c, what, pos) : "";
      return Value::string(
          py_strip(py_str(in), c && !c->is(Value::Kind::None) ? &chars : nullptr, true, true));
    }
    if (f == "tojson") {
      check_args(a, {"ensure_ascii", "indent", "separators", "sort_keys"}, what, pos);
      JsonStyle st;
      if (const Value* v = arg(a, 0, "ensure_ascii")) st.ensure_ascii = truthy(*v);
      const Value* indent = arg(a, 1, "indent");
      if (indent && !indent->is(Value::Kind::None)) {
        if (indent->is(Value::Kind::String))
          st.indent = indent->s;
        else
          st.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, as_int(*indent))), ' ');
      }
      st.item_sep = st.indent ? "," : ", ";
      st.key_sep = ": ";
      if (const Value* sep = arg(a, 2, "separators"); sep && !sep->is(Value::Kind::None)) {
        if (!sep->is(Value::Kind::List) || sep->list->size() != 2)
          fail_at(pos, "tojson: separators must be a pair of strings");
        st.item_sep = str_arg(&(*sep->list)[0], what, pos);
        st.key_sep = str_arg(&(*sep->list)[1], what, pos);
      }
      if (const Value* v = arg(a, 3, "sort_keys")) st.sort_keys = truthy(*v);
      std::string out;
      to_json(out, in, st, 0, pos);
      return Value::string(std::move(out));
    }
    if (f == "string") {
      check_args(a, {}, what, pos);
      return Value::string(py_str(in));
    }
    if (f == "safe") {
      check_args(a, {}, what, pos);
      return in;
    }
    if (f == "upper" || f == "lower" || f == "title" || f == "capitalize") {
      check_args(a, {}, what, pos);
      return Value::string(case_map(py_str(in), f));
    }
    if (f == "replace") {
      check_args(a, {"old", "new", "count"}, what, pos);
      const Value* c = arg(a, 2, "count");
      return Value::string(replace(py_str(in), str_arg(arg(a, 0, "old"), what, pos),
                                   str_arg(arg(a, 1, "new"), what, pos),
                                   c && !c->is(Value::Kind::None) ? as_int(*c) : -1));
    }
    if (f == "join") {
      check_args(a, {"d", "attribute"}, what, pos);
      if (arg(a, 1, "attribute")) fail_at(pos, "unsupported: join(attribute=...)");
      const Value* d = arg(a, 0, "d");
      const std::string sep = d ? py_str(*d) : "";
      std::string out;
      bool first = true;
      for (const Value& x : iterate(in, pos)) {
        out += (first ? "" : sep) + py_str(x);
        first = false;
      }
      return Value::string(std::move(out));
    }
    if (f == "first" || f == "last") {
      check_args(a, {}, what, pos);
      const ValueList items = iterate(in, pos);
      if (items.empty()) return Value::undefined(fmt::format("No {} item, sequence was empty.", f));
      return f == "first" ? items.front() : items.back();
    }
    if (f == "list") {
      check_args(a, {}, what, pos);
      return Value::make_list(iterate(in, pos));
    }
    if (f == "reverse") {
      check_args(a, {}, what, pos);
      if (in.is(Value::Kind::String)) {
        ValueList chars = iterate(in, pos);
        std::string out;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += it->s;
        return Value::string(std::move(out));
      }
      ValueList items = iterate(in, pos);
      std::reverse(items.begin(), items.end());
      return Value::make_list(std::move(items));
    }
    if (f == "items") {
      check_args(a, {}, what, pos);
      if (in.is(Value::Kind::Undefined)) return Value::make_list({});
      if (!in.is(Value::Kind::Dict)) fail_at(pos, "items: can only get items from a mapping");
      return method(in, "items", {}, pos);
    }
    if (f == "int" || f == "float") {
      check_args(a, {"default", "base"}, what, pos);
      const Value* d = arg(a, 0, "default");
      const Value fallback = d ? *d : (f == "int" ? Value::integer(0) : Value::floating(0.0));
      if (in.is_number())
        return f == "int" ? Value::integer(in.is(Value::Kind::Float) ? static_cast<int64_t>(in.f)
                                                                     : as_int(in))
                          : Value::floating(as_double(in));
      if (in.is(Value::Kind::String)) {
        const std::string t = py_strip(in.s, nullptr, true, true);
        char* end = nullptr;
        const double x = std::strtod(t.c_str(), &end);
        if (!t.empty() && end == t.c_str() + t.size())
          return f == "int" ? Value::integer(static_cast<int64_t>(x)) : Value::floating(x);
      }
      return fallback;
    }
    if (f == "abs") {
      check_args(a, {}, what, pos);
      if (!in.is_number())
        fail_at(pos, fmt::format("bad operand type for abs(): '{}'", type_name(in)));
      return in.is(Value::Kind::Float) ? Value::floating(std::fabs(in.f))
                                       : Value::integer(std::llabs(as_int(in)));
    }
    fail_at(pos, fmt::format("unsupported filter '{}' (moe's chat template renderer implements the "
                             "filters listed in data/chat_template.h)",
                             f));
  }

  bool test(const Expr& e, Scope& scope) {
    const Value in = eval(*e.args[0], scope);
    const Args a = eval_args(e, scope, 1);
    const std::string& t = e.name;
    const size_t pos = e.pos;
    const std::string what = "test '" + t + "'";
    const auto no_args = [&] { check_args(a, {}, what, pos); };
    using K = Value::Kind;
    if (t == "defined") return no_args(), !in.is(K::Undefined);
    if (t == "undefined") return no_args(), in.is(K::Undefined);
    if (t == "none") return no_args(), in.is(K::None);
    if (t == "string") return no_args(), in.is(K::String);
    if (t == "number") return no_args(), in.is_number();
    if (t == "integer") return no_args(), in.is(K::Int);
    if (t == "float") return no_args(), in.is(K::Float);
    if (t == "boolean") return no_args(), in.is(K::Bool);
    if (t == "true") return no_args(), in.is(K::Bool) && in.b;
    if (t == "false") return no_args(), in.is(K::Bool) && !in.b;
    if (t == "mapping") return no_args(), in.is(K::Dict);
    if (t == "iterable")
      return no_args(), in.is(K::List) || in.is(K::Dict) || in.is(K::String) || in.is(K::Undefined);
    if (t == "sequence")
      return no_args(), in.is(K::List) || in.is(K::Dict) || in.is(K::String) || in.is(K::Undefined);
    if (t == "lower")
      return no_args(), in.is(K::String) && ascii_lower(in.s) == in.s && ascii_upper(in.s) != in.s;
    if (t == "upper")
      return no_args(), in.is(K::String) && ascii_upper(in.s) == in.s && ascii_lower(in.s) != in.s;
    if (t == "even" || t == "odd") {
      no_args();
      if (!in.is(K::Int) && !in.is(K::Bool))
        fail_at(pos, fmt::format("{}: expected an integer, got {}", what, type_name(in)));
      return (as_int(in) % 2 == 0) == (t == "even");
    }
    if (t == "divisibleby") {
      check_args(a, {"num"}, what, pos);
      const Value* n = arg(a, 0, "num");
      if (!n || !n->is_number() || as_int(*n) == 0 || !in.is_number())
        fail_at(pos, what + ": expected integers");
      return as_int(in) % as_int(*n) == 0;
    }
    if (t == "eq" || t == "equalto" || t == "==" || t == "ne" || t == "!=") {
      check_args(a, {"other"}, what, pos);
      const Value* o = arg(a, 0, "other");
      if (!o) fail_at(pos, what + ": expected one argument");
      const bool eq = py_equal(in, *o);
      return (t == "ne" || t == "!=") ? !eq : eq;
    }
    if (t == "in") {
      check_args(a, {"seq"}, what, pos);
      const Value* s = arg(a, 0, "seq");
      if (!s) fail_at(pos, what + ": expected one argument");
      return contains(*s, in, pos);
    }
    fail_at(pos, fmt::format("unsupported test '{}' (moe's chat template renderer implements the "
                             "tests listed in data/chat_template.h)",
                             t));
  }
};

// jinja2's lexer sees "\n" for "\r\n" and "\r", and keep_trailing_newline=False drops one final
// newline.
std::string normalize_newlines(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

// ================================================================== ChatTemplate

struct ChatTemplate::Impl {
  std::string source;      // as given
  std::string normalized;  // what positions refer to
  std::string bos_token, eos_token;
  Body body;
};

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token) {
  auto impl = std::make_shared<Impl>();
  impl->source = std::move(source);
  impl->normalized = normalize_newlines(impl->source);
  impl->bos_token = std::move(bos_token);
  impl->eos_token = std::move(eos_token);
  try {
    impl->body = Parser(Lexer(impl->normalized).run()).parse_template();
  } catch (const Located& e) {
    throw Error(fmt::format("{}: {}", where(impl->normalized, e.pos), e.message));
  }
  impl_ = std::move(impl);
}

std::string ChatTemplate::render(const nlohmann::ordered_json& variables) const {
  MOE_CHECK(variables.is_object(), "chat template variables: expected a JSON object, got {}",
            variables.type_name());
  Scope globals;
  for (auto it = variables.begin(); it != variables.end(); ++it)
    globals.vars.emplace_back(it.key(), from_json(it.value()));
  Scope top{&globals, {}};
  Renderer r;
  try {
    r.exec(impl_->body, top);
  } catch (const Located& e) {
    throw Error(fmt::format("{}: {}", where(impl_->normalized, e.pos), e.message));
  }
  return std::move(r.out);
}

std::string ChatTemplate::apply(const nlohmann::ordered_json& messages,
                                bool add_generation_prompt) const {
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  vars["messages"] = messages;
  vars["tools"] = nullptr;
  vars["add_generation_prompt"] = add_generation_prompt;
  vars["bos_token"] = impl_->bos_token;
  vars["eos_token"] = impl_->eos_token;
  return render(vars);
}

const std::string& ChatTemplate::source() const { return impl_->source; }
const std::string& ChatTemplate::bos_token() const { return impl_->bos_token; }
const std::string& ChatTemplate::eos_token() const { return impl_->eos_token; }

std::optional<ChatTemplate> load_chat_template(const std::filesystem::path& tokenizer_config) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(tokenizer_config, ec)) return std::nullopt;
  const std::string file = tokenizer_config.string();
  const nlohmann::json j =
      nlohmann::json::parse(read_text_file_capped(tokenizer_config, "the tokenizer config"),
                            json_depth_limit<nlohmann::json>(file), /*allow_exceptions=*/false);
  MOE_CHECK(!j.is_discarded(), "{}: not valid JSON", file);
  MOE_CHECK(j.is_object(), "{}: expected a JSON object, got {}", file, j.type_name());
  const auto it = j.find("chat_template");
  std::string source;
  std::string origin = file + ": field \"chat_template\"";
  if (it == j.end() || it->is_null()) {
    // Newer transformers save the template beside the config instead.
    const std::filesystem::path beside = tokenizer_config.parent_path() / "chat_template.jinja";
    std::ifstream jinja(beside, std::ios::binary);
    if (!jinja.good()) return std::nullopt;
    std::stringstream t;
    t << jinja.rdbuf();
    source = t.str();
    origin = beside.string();
  } else if (it->is_string()) {
    source = it->get<std::string>();
  } else if (it->is_array()) {
    for (const auto& t : *it)
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
          t["template"].is_string())
        source = t["template"].get<std::string>();
    MOE_CHECK(!source.empty(),
              "{}: field \"chat_template\": a list of named templates without one "
              "named \"default\"",
              file);
  } else {
    fail(
        "{}: field \"chat_template\": expected a string or a list of {{\"name\", \"template\"}}, "
        "got {}",
        file, it->type_name());
  }
  const auto token = [&](const char* key) -> std::string {
    const auto t = j.find(key);
    if (t == j.end() || t->is_null()) return "";
    if (t->is_string()) return t->get<std::string>();
    if (t->is_object() && t->contains("content") && (*t)["content"].is_string())
      return (*t)["content"].get<std::string>();
    fail("{}: field \"{}\": expected a string or an object with a string \"content\", got {}", file,
         key, t->type_name());
  };
  const std::string bos = token("bos_token");
  const std::string eos = token("eos_token");
  try {
    return ChatTemplate(std::move(source), bos, eos);
  } catch (const Error& e) {
    fail("{}: {}", origin, e.what());
  }
}

}  // namespace moe
