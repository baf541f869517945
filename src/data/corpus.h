#pragma once
// A training corpus ready for the trainer: documents read, tokenized, packed, split.
#include <cstdint>
#include <string>
#include <vector>

#include "data/documents.h"
#include "data/packing.h"

namespace moe {

struct CorpusOptions {
  std::vector<std::string> paths;  // read in the given order
  DocumentOptions documents;
  double val_fraction = 0.0;
  int64_t seq_len = 0;
  const Tokenizer* tokenizer = nullptr;  // nullptr: the byte tokenizer
};

struct Corpus {
  PackedSequences train, val;
  int64_t documents = 0;
  int64_t total_tokens = 0;
  double train_unigram_entropy = 0.0;  // nats per token
  uint64_t fingerprint = 0;            // of the whole stream, train and validation
};

// Raises moe::Error naming the paths when the training split holds less than one sample.
Corpus load_corpus(const CorpusOptions& options);

}  // namespace moe
