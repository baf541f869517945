#pragma once
// What the fuzz targets share: the input as a file for loaders that take a path, and the rule
// that a moe::Error is the expected answer to bad input while anything else (another exception,
// a crash, a sanitizer report, an allocation over libFuzzer's -malloc_limit_mb) is a finding.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/error.h"

namespace moe::fuzz {

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// An input of several files: `input` cut at its first N - 1 NUL bytes (missing parts are empty;
// the last part may hold NULs).
template <size_t N>
std::array<std::string_view, N> split_at_nuls(std::string_view input) {
  std::array<std::string_view, N> parts;
  for (size_t i = 0; i < N; ++i) {
    const size_t nul = i + 1 < N ? input.find('\0') : std::string_view::npos;
    parts[i] = input.substr(0, nul);
    input = nul == std::string_view::npos ? std::string_view() : input.substr(nul + 1);
  }
  return parts;
}

// The input as an anonymous in-memory file, opened by path (/proc/self/fd/N) like a file on
// disk: the loaders' own open, stat and read run, and nothing touches the disk.
class MemoryFile {
 public:
  explicit MemoryFile(std::string_view bytes) : fd_(::memfd_create("fuzz-input", MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
  }
  ~MemoryFile() { ::close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  std::filesystem::path path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

// A private directory for loaders that read fixed file names from a directory (an index, an
// adapter_config.json); removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "moe-fuzz-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    static const std::filesystem::path made = pattern;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(made, ec);
    });
    return made;
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& file, std::string_view bytes) {
  std::FILE* f = std::fopen(file.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

// Runs `parse`; a moe::Error is the parser refusing bad input, which is what it should do.
template <typename F>
void expect_ok_or_error(F&& parse) {
  try {
    parse();
  } catch (const Error&) {
  }
}

// A broken invariant the parser promised (a round trip that does not come back): a finding.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz finding: %s\n", what.c_str());
  std::abort();
}

}  // namespace moe::fuzz
