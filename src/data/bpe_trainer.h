#pragma once
// Learning a byte-level BPE from text: start from the 256 bytes and the end-of-text token,
// then repeatedly merge the most frequent adjacent pair within pre-tokenized words.
#include <cstdint>
#include <string>
#include <vector>

#include "data/bpe.h"

namespace moe {

struct BpeTrainStats {
  int64_t words = 0;         // pre-tokenized pieces in the text
  int64_t unique_words = 0;
  int64_t merges = 0;
};

// Deterministic: the result depends only on the documents' contents and order-free word counts;
// among pairs of equal count the one with the lexicographically smallest (left, right) bytes
// wins. Ids: 0..255 the bytes, 256 end-of-text, then one per merge that makes a new token.
// Stops early when no pair is left to merge. `vocab_size` must be at least 257.
BpeTokenizer train_bpe(const std::vector<std::string>& documents, int64_t vocab_size,
                       BpeTrainStats* stats = nullptr);

}  // namespace moe
