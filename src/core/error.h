#pragma once
// One exception type for every user-facing failure: the CLI prints what() and exits non-zero.
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace moe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace moe

// Internal invariant or user-input check; the message must name what was expected.
#define MOE_CHECK(cond, ...)          \
  do {                                \
    if (!(cond)) ::moe::fail(__VA_ARGS__); \
  } while (0)
