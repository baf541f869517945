#pragma once
// What one load of a file may allocate (issue 14). A model directory, a tokenizer or a request is
// untrusted input: sizes read from it (a header length, a tensor's shape, the largest token id,
// a file's length) are multiplied with overflow checks and compared with one cap before
// anything is allocated, so a corrupt or hostile file ends in an error naming the file, the
// field and the cap instead of std::bad_alloc or the kernel's OOM killer.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/error.h"

namespace moe {

// The cap, in bytes: MOE_MAX_LOAD_BYTES when set (an integer, optionally with a K, M, G or T
// suffix for powers of 1024), else the machine's physical memory, which no single allocation
// could exceed without the process being killed. Read once.
int64_t max_load_bytes();
// The environment variable that sets it; errors name it so the cap can be raised on purpose.
inline constexpr const char* kMaxLoadBytesEnv = "MOE_MAX_LOAD_BYTES";

// Raises "<file>: <field> needs <bytes>, more than one load may allocate (...)" when `bytes`
// exceeds max_load_bytes().
void check_load_bytes(std::string_view file, std::string_view field, int64_t bytes);

// a * b for sizes read from `file` (both >= 0), or an error naming the file and the field when
// the product does not fit in 64 bits.
int64_t checked_size_product(int64_t a, int64_t b, std::string_view file, std::string_view field);

// A whole text file (config.json, tokenizer.json, a TOML config, ...), after checking that
// holding and parsing it stays under the cap: parsed JSON takes several times the text's bytes,
// so the file may use at most 1 / kParsedBytesPerTextByte of it.
// `what` names the file in the error when it cannot be opened ("the model config").
std::string read_text_file_capped(const std::filesystem::path& file, std::string_view what = "file");
inline constexpr int64_t kParsedBytesPerTextByte = 32;

// JSON read from files nests at most this deep (a tokenizer.json, the deepest, has 6 levels).
// nlohmann's parser is iterative, but printing a value (into an error message) and copying one
// recurse once per level: a megabyte of "[[[[" would overflow the stack.
inline constexpr int kMaxJsonFileDepth = 64;
// A parser callback for nlohmann's Json::parse (json or ordered_json) that refuses deeper
// nesting with an error naming `source`.
template <typename Json>
typename Json::parser_callback_t json_depth_limit(std::string source) {
  return [source = std::move(source)](int depth, typename Json::parse_event_t, Json&) {
    MOE_CHECK(depth <= kMaxJsonFileDepth, "{}: JSON nested more than {} levels deep", source,
              kMaxJsonFileDepth);
    return true;
  };
}

}  // namespace moe
