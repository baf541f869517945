#pragma once
// A table of typed configuration keys ("section.key" -> a field of a config struct) that reads
// values from TOML nodes or command-line strings, checks types and ranges, and words every
// error the same way: "<source>: <section.key>: expected <what>, got <value>".
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <toml++/toml.h>

namespace moe {

// Numeric range of a key; bounds are inclusive unless marked open.
struct ConfigRange {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;
};

class ConfigKeys {
 public:
  using Range = ConfigRange;

  void add_int(const std::string& name, int64_t* target, Range range = {});
  void add_float(const std::string& name, double* target, Range range = {});
  void add_bool(const std::string& name, bool* target);
  // `choices` empty: any non-empty string.
  void add_string(const std::string& name, std::string* target, std::vector<std::string> choices = {});
  // Any string, "" meaning "not set".
  void add_optional_string(const std::string& name, std::string* target);
  // A string or an array of strings in TOML; one string on the command line.
  void add_string_list(const std::string& name, std::vector<std::string>* target);

  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // Names of one section's keys, comma-separated (for "unknown key" messages).
  std::string keys_of(const std::string& section) const;
  std::vector<std::string> sections() const;

  void set_from_toml(const std::string& name, const toml::node& node, const std::string& source) const;
  void set_from_string(const std::string& name, const std::string& text, const std::string& source) const;
  // The current values as a TOML table of sections, in registration order.
  void write_toml(toml::table& out) const;

 private:
  enum class Kind { Int, Float, Bool, String, StringList };
  struct Entry {
    std::string name;  // "section.key"
    Kind kind;
    void* target;
    Range range;
    std::vector<std::string> choices;
    bool may_be_empty = false;
  };
  const Entry* find(const std::string& name) const;
  std::string expected(const Entry& e) const;
  void check_range(const Entry& e, double v, const std::string& shown, const std::string& source) const;
  void check_choice(const Entry& e, const std::string& v, const std::string& source) const;

  std::vector<Entry> entries_;
};

// "%g"-like rendering of a TOML node for error messages (strings quoted).
std::string describe_toml(const toml::node& node);

}  // namespace moe
