#pragma once
// Token-id files for `moe logits`: plain text, one sequence per line, ids separated by spaces.
#include <filesystem>

#include "core/tensor.h"
#include "model/param.h"

namespace moe {

struct TokenBatch {
  Tensor tokens;  // I32 [batch * seq]
  BatchShape shape;
};

// Every non-empty line is one sequence; all must have the same length. Errors name the file,
// the line and what was expected.
TokenBatch read_token_file(const std::filesystem::path& path);

}  // namespace moe
