#include "core/limits.h"

#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/memory.h"

namespace moe {

namespace {

int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return std::numeric_limits<int64_t>::max();
  int64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<int64_t>(pages), static_cast<int64_t>(page_size), &bytes))
    return std::numeric_limits<int64_t>::max();
  return bytes;
}

int64_t parse_cap(const char* text) {
  const std::string_view s(text);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  int shift = 0;
  const std::string_view suffix(end, static_cast<size_t>(s.data() + s.size() - end));
  if (suffix == "K" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "m") shift = 20;
  else if (suffix == "G" || suffix == "g") shift = 30;
  else if (suffix == "T" || suffix == "t") shift = 40;
  else if (!suffix.empty()) value = -1;
  MOE_CHECK(ec == std::errc() && value > 0 && value <= (std::numeric_limits<int64_t>::max() >> shift),
            "{}={}: expected a positive number of bytes (optionally with a K, M, G or T suffix)",
            kMaxLoadBytesEnv, text);
  return value << shift;
}

}  // namespace

int64_t max_load_bytes() {
  static const int64_t cap = [] {
    const char* env = std::getenv(kMaxLoadBytesEnv);
    return env != nullptr && *env != '\0' ? parse_cap(env) : physical_memory_bytes();
  }();
  return cap;
}

void check_load_bytes(std::string_view file, std::string_view field, int64_t bytes) {
  const int64_t cap = max_load_bytes();
  MOE_CHECK(bytes <= cap, "{}: {} needs {}, more than one load may allocate ({}; the machine's "
            "memory unless {} says otherwise)", file, field, format_bytes(bytes),
            format_bytes(cap), kMaxLoadBytesEnv);
}

int64_t checked_size_product(int64_t a, int64_t b, std::string_view file, std::string_view field) {
  int64_t product = 0;
  MOE_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &product),
            "{}: {}: {} x {} does not fit in 64 bits", file, field, a, b);
  return product;
}

std::string read_text_file_capped(const std::filesystem::path& file, std::string_view what) {
  std::error_code ec;
  // A directory opens as a stream on Linux, and its "size" is a hash offset.
  MOE_CHECK(!std::filesystem::is_directory(file, ec), "{}: is a directory, expected a file",
            file.string());
  std::ifstream in(file, std::ios::binary | std::ios::ate);
  MOE_CHECK(in.good(), "{}: cannot open {}: {}", file.string(), what, std::strerror(errno));
  const std::streamoff size = in.tellg();
  MOE_CHECK(size >= 0, "{}: cannot tell its size", file.string());
  check_load_bytes(file.string(), fmt::format("parsing this {}-byte file", static_cast<int64_t>(size)),
                   checked_size_product(size, kParsedBytesPerTextByte, file.string(), "file size"));
  std::string text(static_cast<size_t>(size), '\0');
  in.seekg(0);
  in.read(text.data(), size);
  MOE_CHECK(in.gcount() == size, "{}: read error (the file changed while it was read?)",
            file.string());
  return text;
}

}  // namespace moe
