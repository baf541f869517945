#include "io/token_file.h"

#include <charconv>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/limits.h"

namespace moe {

TokenBatch read_token_file(const std::filesystem::path& path) {
  // A pipe or device has no size to check in advance (and opening a FIFO would block): only
  // regular files are read.
  std::error_code ec;
  MOE_CHECK(std::filesystem::is_regular_file(path, ec) || !std::filesystem::exists(path, ec),
            "{}: not a regular file; expected a file of token ids", path.string());
  std::ifstream in(path);
  MOE_CHECK(in.good(), "{}: cannot open token file", path.string());
  // Per byte of text at most: the line being read (1), the ids of one id per two bytes at 4 bytes
  // each with the list's growth room (4), then the tensor (2).
  const auto file_bytes = std::filesystem::file_size(path, ec);
  MOE_CHECK(!ec, "{}: cannot tell its size ({})", path.string(), ec.message());
  check_load_bytes(path.string(), fmt::format("the ids of this {}-byte file", file_bytes),
                   checked_size_product(static_cast<int64_t>(file_bytes), 7, path.string(), "file size"));
  std::vector<int32_t> ids;
  int64_t batch = 0, seq = -1, line_no = 0, first_line = 0;
  std::string line;
  while (std::getline(in, line)) {
    ++line_no;
    int64_t count = 0;
    const char* p = line.data();
    const char* end = p + line.size();
    while (p < end) {
      while (p < end && (*p == ' ' || *p == '\t' || *p == '\r')) ++p;
      if (p == end) break;
      int64_t v = 0;
      auto [next, ec] = std::from_chars(p, end, v);
      MOE_CHECK(ec == std::errc() && (next == end || *next == ' ' || *next == '\t' || *next == '\r'),
                "{}:{}: expected token ids (non-negative integers separated by spaces), got \"{}\"",
                path.string(), line_no, std::string(p, std::min<size_t>(static_cast<size_t>(end - p), 20)));
      MOE_CHECK(v >= 0 && v <= INT32_MAX, "{}:{}: token id {} must be a non-negative 32-bit integer",
                path.string(), line_no, v);
      ids.push_back(static_cast<int32_t>(v));
      ++count;
      p = next;
    }
    if (count == 0) continue;
    if (seq < 0) {
      seq = count;
      first_line = line_no;
    }
    MOE_CHECK(count == seq, "{}:{}: every sequence must have the same length; line {} has {} tokens "
              "but line {} has {}", path.string(), line_no, line_no, count, first_line, seq);
    ++batch;
  }
  MOE_CHECK(batch > 0, "{}: no token ids found (expected one sequence per line)", path.string());
  TokenBatch out;
  out.shape = {batch, seq};
  out.tokens = Tensor::empty({batch * seq}, DType::I32, MemCategory::Activations);
  std::copy(ids.begin(), ids.end(), out.tokens.i32());
  return out;
}

}  // namespace moe
