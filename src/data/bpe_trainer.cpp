#include "data/bpe_trainer.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "data/byte_level.h"

namespace moe {

namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}
int32_t left_of(uint64_t k) { return static_cast<int32_t>(k >> 32); }
int32_t right_of(uint64_t k) { return static_cast<int32_t>(k & 0xffffffffu); }

struct Word {
  std::vector<int32_t> sym;
  int64_t count;
};

class PairTable {
 public:
  void add_word(const Word& w, int64_t sign, int32_t index) {
    for (size_t i = 0; i + 1 < w.sym.size(); ++i) {
      const uint64_t k = pair_key(w.sym[i], w.sym[i + 1]);
      int64_t& c = count_[k];
      c += sign * w.count;
      if (c == 0) count_.erase(k);
      if (sign > 0) where_[k].push_back(index);
    }
  }
  bool empty() const { return count_.empty(); }
  // Highest count; ties to the smallest (left bytes, right bytes).
  uint64_t best(const std::vector<std::string>& vocab) const {
    uint64_t best_key = 0;
    int64_t best_count = -1;
    for (const auto& [k, c] : count_) {
      if (c < best_count) continue;
      if (c == best_count) {
        const std::string& a = vocab[static_cast<size_t>(left_of(k))];
        const std::string& ba = vocab[static_cast<size_t>(left_of(best_key))];
        if (a > ba) continue;
        if (a == ba && vocab[static_cast<size_t>(right_of(k))] >= vocab[static_cast<size_t>(right_of(best_key))])
          continue;
      }
      best_key = k, best_count = c;
    }
    return best_key;
  }
  // Words that held the pair when it was counted (possibly stale or repeated).
  std::vector<int32_t> take_words(uint64_t k) {
    std::vector<int32_t> w = std::move(where_[k]);
    where_.erase(k);
    std::sort(w.begin(), w.end());
    w.erase(std::unique(w.begin(), w.end()), w.end());
    return w;
  }

 private:
  std::unordered_map<uint64_t, int64_t> count_;
  std::unordered_map<uint64_t, std::vector<int32_t>> where_;
};

bool merge_in(std::vector<int32_t>& sym, int32_t a, int32_t b, int32_t merged) {
  bool changed = false;
  size_t out = 0;
  for (size_t i = 0; i < sym.size(); ++i) {
    if (i + 1 < sym.size() && sym[i] == a && sym[i + 1] == b) {
      sym[out++] = merged;
      ++i;
      changed = true;
    } else {
      sym[out++] = sym[i];
    }
  }
  sym.resize(out);
  return changed;
}

}  // namespace

BpeTokenizer train_bpe(const std::vector<std::string>& documents, int64_t vocab_size,
                       BpeTrainStats* stats) {
  MOE_CHECK(vocab_size >= 257, "--vocab-size: expected at least 257 (256 bytes + {}), got {}",
            kEndOfTextToken, vocab_size);
  std::unordered_map<std::string_view, int64_t> counts;
  int64_t total = 0;
  for (const std::string& d : documents)
    for (std::string_view piece : pre_tokenize(d)) ++counts[piece], ++total;
  // Sorted so ids of equal-count merges never depend on hash order.
  std::vector<std::pair<std::string_view, int64_t>> sorted(counts.begin(), counts.end());
  std::sort(sorted.begin(), sorted.end());

  std::vector<std::string> vocab;
  for (int b = 0; b < 256; ++b) vocab.emplace_back(1, static_cast<char>(b));
  vocab.emplace_back();  // end-of-text: no bytes
  const int32_t eot = 256;
  std::unordered_map<std::string, int32_t> id_of;
  for (int32_t id = 0; id < 256; ++id) id_of[vocab[static_cast<size_t>(id)]] = id;

  std::vector<Word> words;
  words.reserve(sorted.size());
  PairTable pairs;
  for (const auto& [piece, count] : sorted) {
    Word w{{}, count};
    for (char c : piece) w.sym.push_back(static_cast<unsigned char>(c));
    words.push_back(std::move(w));
    pairs.add_word(words.back(), +1, static_cast<int32_t>(words.size() - 1));
  }

  std::vector<std::pair<int32_t, int32_t>> merges;
  while (static_cast<int64_t>(vocab.size()) < vocab_size && !pairs.empty()) {
    const uint64_t k = pairs.best(vocab);
    const int32_t a = left_of(k), b = right_of(k);
    std::string joined = vocab[static_cast<size_t>(a)] + vocab[static_cast<size_t>(b)];
    // Two different merges can spell the same bytes ("ab"+"c", "a"+"bc"): one token for both.
    auto [it, fresh] = id_of.emplace(joined, static_cast<int32_t>(vocab.size()));
    if (fresh) vocab.push_back(std::move(joined));
    merges.emplace_back(a, b);
    for (int32_t wi : pairs.take_words(k)) {
      Word& w = words[static_cast<size_t>(wi)];
      std::vector<int32_t> before = w.sym;
      if (!merge_in(w.sym, a, b, it->second)) continue;
      std::swap(before, w.sym);
      pairs.add_word(w, -1, wi);
      std::swap(before, w.sym);
      pairs.add_word(w, +1, wi);
    }
  }
  if (stats) *stats = {total, static_cast<int64_t>(words.size()), static_cast<int64_t>(merges.size())};
  return BpeTokenizer(std::move(vocab), std::move(merges), eot);
}

}  // namespace moe
