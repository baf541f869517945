#include "train/config_keys.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/error.h"

namespace moe {

namespace {

std::string fmt_bound(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

std::string section_of(const std::string& name) { return name.substr(0, name.find('.')); }
std::string key_of(const std::string& name) { return name.substr(name.find('.') + 1); }

bool parse_int(const std::string& s, int64_t& out) {
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && ptr == end && !s.empty();
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(out);
}

}  // namespace

std::string describe_toml(const toml::node& node) {
  if (const auto* s = node.as_string()) return fmt::format("\"{}\"", s->get());
  std::ostringstream os;
  node.visit([&](const auto& n) { os << n; });
  std::string type;
  switch (node.type()) {
    case toml::node_type::table: type = "a table "; break;
    case toml::node_type::array: type = "an array "; break;
    default: break;
  }
  return type + os.str();
}

void ConfigKeys::add_int(const std::string& name, int64_t* target, Range range) {
  entries_.push_back({name, Kind::Int, target, range, {}});
}
void ConfigKeys::add_float(const std::string& name, double* target, Range range) {
  entries_.push_back({name, Kind::Float, target, range, {}});
}
void ConfigKeys::add_bool(const std::string& name, bool* target) {
  entries_.push_back({name, Kind::Bool, target, {}, {}});
}
void ConfigKeys::add_string(const std::string& name, std::string* target,
                            std::vector<std::string> choices) {
  entries_.push_back({name, Kind::String, target, {}, std::move(choices)});
}
void ConfigKeys::add_optional_string(const std::string& name, std::string* target) {
  entries_.push_back({name, Kind::String, target, {}, {}, /*may_be_empty=*/true});
}
void ConfigKeys::add_string_list(const std::string& name, std::vector<std::string>* target) {
  entries_.push_back({name, Kind::StringList, target, {}, {}});
}

const ConfigKeys::Entry* ConfigKeys::find(const std::string& name) const {
  for (const Entry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

std::string ConfigKeys::keys_of(const std::string& section) const {
  std::string out;
  for (const Entry& e : entries_)
    if (section_of(e.name) == section) out += (out.empty() ? "" : ", ") + key_of(e.name);
  return out;
}

std::vector<std::string> ConfigKeys::sections() const {
  std::vector<std::string> out;
  for (const Entry& e : entries_) {
    const std::string s = section_of(e.name);
    if (out.empty() || out.back() != s) out.push_back(s);
  }
  return out;
}

std::string ConfigKeys::expected(const Entry& e) const {
  std::string what;
  switch (e.kind) {
    case Kind::Int: what = "an integer"; break;
    case Kind::Float: what = "a number"; break;
    case Kind::Bool: return "true or false";
    case Kind::String:
      if (e.choices.empty()) return e.may_be_empty ? "a string" : "a non-empty string";
      what = "one of";
      for (size_t i = 0; i < e.choices.size(); ++i)
        what += fmt::format("{} \"{}\"", i ? "," : "", e.choices[i]);
      return what;
    case Kind::StringList: return "a non-empty string or an array of non-empty strings";
  }
  const Range& r = e.range;
  const bool has_lo = std::isfinite(r.lo), has_hi = std::isfinite(r.hi);
  if (has_lo && has_hi)
    what += fmt::format(" in {}{}, {}{}", r.lo_open ? "(" : "[", fmt_bound(r.lo), fmt_bound(r.hi),
                        r.hi_open ? ")" : "]");
  else if (has_lo)
    what += fmt::format(" {} {}", r.lo_open ? ">" : ">=", fmt_bound(r.lo));
  else if (has_hi)
    what += fmt::format(" {} {}", r.hi_open ? "<" : "<=", fmt_bound(r.hi));
  return what;
}

void ConfigKeys::check_range(const Entry& e, double v, const std::string& shown,
                             const std::string& source) const {
  const Range& r = e.range;
  const bool ok = (r.lo_open ? v > r.lo : v >= r.lo) && (r.hi_open ? v < r.hi : v <= r.hi);
  if (!ok) fail("{}: {}: expected {}, got {}", source, e.name, expected(e), shown);
}

void ConfigKeys::check_choice(const Entry& e, const std::string& v, const std::string& source) const {
  const bool ok = e.choices.empty()
                      ? e.may_be_empty || !v.empty()
                      : std::find(e.choices.begin(), e.choices.end(), v) != e.choices.end();
  if (!ok) fail("{}: {}: expected {}, got \"{}\"", source, e.name, expected(e), v);
}

void ConfigKeys::set_from_toml(const std::string& name, const toml::node& node,
                               const std::string& source) const {
  const Entry* e = find(name);
  MOE_CHECK(e != nullptr, "{}: unknown key '{}'", source, name);
  auto wrong = [&] { fail("{}: {}: expected {}, got {}", source, name, expected(*e), describe_toml(node)); };
  switch (e->kind) {
    case Kind::Int: {
      if (!node.is_integer()) wrong();
      const int64_t v = node.as_integer()->get();
      check_range(*e, static_cast<double>(v), std::to_string(v), source);
      *static_cast<int64_t*>(e->target) = v;
      break;
    }
    case Kind::Float: {
      double v = 0;
      if (node.is_integer())
        v = static_cast<double>(node.as_integer()->get());
      else if (node.is_floating_point())
        v = node.as_floating_point()->get();
      else
        wrong();
      if (!std::isfinite(v)) wrong();
      check_range(*e, v, describe_toml(node), source);
      *static_cast<double*>(e->target) = v;
      break;
    }
    case Kind::Bool:
      if (!node.is_boolean()) wrong();
      *static_cast<bool*>(e->target) = node.as_boolean()->get();
      break;
    case Kind::String:
      if (!node.is_string()) wrong();
      check_choice(*e, node.as_string()->get(), source);
      *static_cast<std::string*>(e->target) = node.as_string()->get();
      break;
    case Kind::StringList: {
      std::vector<std::string> list;
      if (const auto* s = node.as_string()) {
        list.push_back(s->get());
      } else if (const auto* a = node.as_array()) {
        for (const toml::node& item : *a) {
          if (!item.is_string()) wrong();
          list.push_back(item.as_string()->get());
        }
      } else {
        wrong();
      }
      if (list.empty()) wrong();
      for (const std::string& s : list)
        if (s.empty()) wrong();
      *static_cast<std::vector<std::string>*>(e->target) = std::move(list);
      break;
    }
  }
}

void ConfigKeys::set_from_string(const std::string& name, const std::string& text,
                                 const std::string& source) const {
  const Entry* e = find(name);
  MOE_CHECK(e != nullptr, "{}: unknown key '{}'", source, name);
  auto wrong = [&] { fail("{}: {}: expected {}, got \"{}\"", source, name, expected(*e), text); };
  switch (e->kind) {
    case Kind::Int: {
      int64_t v = 0;
      if (!parse_int(text, v)) wrong();
      check_range(*e, static_cast<double>(v), text, source);
      *static_cast<int64_t*>(e->target) = v;
      break;
    }
    case Kind::Float: {
      double v = 0;
      if (!parse_double(text, v)) wrong();
      check_range(*e, v, text, source);
      *static_cast<double*>(e->target) = v;
      break;
    }
    case Kind::Bool:
      if (text != "true" && text != "false") wrong();
      *static_cast<bool*>(e->target) = text == "true";
      break;
    case Kind::String:
      check_choice(*e, text, source);
      *static_cast<std::string*>(e->target) = text;
      break;
    case Kind::StringList:
      if (text.empty()) wrong();
      *static_cast<std::vector<std::string>*>(e->target) = {text};
      break;
  }
}

void ConfigKeys::write_toml(toml::table& out) const {
  for (const Entry& e : entries_) {
    const std::string section = section_of(e.name), key = key_of(e.name);
    if (!out.contains(section)) out.insert(section, toml::table{});
    toml::table& t = *out[section].as_table();
    switch (e.kind) {
      case Kind::Int: t.insert_or_assign(key, *static_cast<int64_t*>(e.target)); break;
      case Kind::Float: t.insert_or_assign(key, *static_cast<double*>(e.target)); break;
      case Kind::Bool: t.insert_or_assign(key, *static_cast<bool*>(e.target)); break;
      case Kind::String: t.insert_or_assign(key, *static_cast<std::string*>(e.target)); break;
      case Kind::StringList: {
        toml::array a;
        for (const std::string& s : *static_cast<std::vector<std::string>*>(e.target)) a.push_back(s);
        t.insert_or_assign(key, std::move(a));
        break;
      }
    }
  }
}

}  // namespace moe
