#include "data/corpus.h"

#include "core/error.h"
#include "data/tokenizer.h"

namespace moe {

namespace {

std::string joined(const std::vector<std::string>& paths) {
  std::string out;
  for (const std::string& p : paths) out += (out.empty() ? "" : ", ") + p;
  return out;
}

}  // namespace

Corpus load_corpus(const CorpusOptions& o) {
  MOE_CHECK(!o.paths.empty(), "no data paths given");
  std::vector<std::string> docs;
  for (const std::string& p : o.paths) {
    std::vector<std::string> more = read_documents(p, o.documents);
    for (std::string& d : more) docs.push_back(std::move(d));
  }
  std::vector<int32_t> stream = o.tokenizer ? pack_documents(docs, *o.tokenizer) : pack_documents(docs);
  Corpus c;
  c.documents = static_cast<int64_t>(docs.size());
  docs.clear();
  c.total_tokens = static_cast<int64_t>(stream.size());
  c.fingerprint = token_fingerprint(stream);
  const int64_t need = o.seq_len + 1;
  MOE_CHECK(c.total_tokens >= need,
            "{}: {} tokens of data, fewer than one sequence (seq_len + 1 = {} tokens); "
            "add text or lower data.seq_len",
            joined(o.paths), c.total_tokens, need);
  TokenSplit split = split_tokens(std::move(stream), o.val_fraction, o.seq_len);
  const int64_t n_train = static_cast<int64_t>(split.train.size());
  MOE_CHECK(n_train >= need,
            "{}: {} tokens of data leave {} for training after the validation split ({} tokens), "
            "fewer than one sequence (seq_len + 1 = {} tokens); add text, lower data.seq_len "
            "or data.val_fraction",
            joined(o.paths), c.total_tokens, n_train, split.val.size(), need);
  c.train_unigram_entropy = unigram_entropy(split.train);
  c.train = PackedSequences(std::move(split.train), o.seq_len);
  c.val = PackedSequences(std::move(split.val), o.seq_len);
  return c;
}

}  // namespace moe
