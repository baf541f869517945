// Data pipeline: tokenizer, document reading (text, directories, JSONL), packing with
// end-of-text, the validation split, deterministic shuffling and resumable positions.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/corpus.h"
#include "data/documents.h"
#include "data/packing.h"
#include "data/sampler.h"
#include "data/tokenizer.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;

namespace {

std::vector<int32_t> iota_tokens(int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = i;
  return t;
}

}  // namespace

TEST(Tokenizer, BytesRoundTripAndVocabPadding) {
  const std::string text = "In the beginning\n\xc3\xa9\xff";
  const std::vector<int32_t> ids = ByteTokenizer::encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[0], 'I');
  EXPECT_EQ(ids.back(), 255);
  std::vector<int32_t> with_eot = ids;
  with_eot.push_back(ByteTokenizer::kEndOfText);
  EXPECT_EQ(ByteTokenizer::decode(with_eot), text);
  EXPECT_EQ(padded_vocab_size(ByteTokenizer::kVocab), 264);
  EXPECT_EQ(padded_vocab_size(256), 256);
}

TEST(Packing, DocumentsEndWithEndOfText) {
  const std::vector<int32_t> s = pack_documents({"ab", "c"});
  const std::vector<int32_t> want = {'a', 'b', ByteTokenizer::kEndOfText, 'c',
                                     ByteTokenizer::kEndOfText};
  EXPECT_EQ(s, want);
}

TEST(Packing, SamplesShiftTargetsByOne) {
  const PackedSequences p(iota_tokens(10), 3);  // samples start at 0, 3, 6 (6..9 fits)
  ASSERT_EQ(p.size(), 3);
  std::vector<int32_t> in(3), tg(3);
  p.copy(2, in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int32_t>{6, 7, 8}));
  EXPECT_EQ(tg, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(PackedSequences(iota_tokens(3), 3).size(), 0);  // needs seq_len + 1 tokens
  const Batch b = make_batch(p, {1, 0});
  EXPECT_EQ(b.shape.batch, 2);
  EXPECT_EQ(b.tokens.i32()[0], 3);
  EXPECT_EQ(b.targets.i32()[3 + 2], 3);
}

TEST(Packing, ValidationIsTheTailAndAtLeastOneSample) {
  const TokenSplit a = split_tokens(iota_tokens(1000), 0.1, 8);
  ASSERT_EQ(a.val.size(), 100u);
  EXPECT_EQ(a.train.size(), 900u);
  EXPECT_EQ(a.val.front(), 900);
  const TokenSplit b = split_tokens(iota_tokens(1000), 0.1, 8);
  EXPECT_EQ(a.val, b.val);
  EXPECT_EQ(a.train, b.train);
  // 0.1% of 1000 would be one token; a validation split always holds a full sample.
  EXPECT_EQ(split_tokens(iota_tokens(1000), 0.001, 8).val.size(), 9u);
  EXPECT_TRUE(split_tokens(iota_tokens(1000), 0.0, 8).val.empty());
}

TEST(Packing, UnigramEntropy) {
  EXPECT_NEAR(unigram_entropy({1, 2, 1, 2}), std::log(2.0), 1e-12);
  EXPECT_EQ(unigram_entropy({7, 7, 7}), 0.0);
}

TEST(Sampler, ShuffleIsDeterministicPerSeedAndEpoch) {
  const PackedSequences p(iota_tokens(401), 4);  // 100 samples
  const TrainSampler a(p, 7, true), b(p, 7, true), c(p, 8, true);
  EXPECT_EQ(a.epoch_order(0), b.epoch_order(0));
  EXPECT_EQ(a.epoch_order(3), b.epoch_order(3));
  EXPECT_NE(a.epoch_order(0), a.epoch_order(1));
  EXPECT_NE(a.epoch_order(0), c.epoch_order(0));
  std::vector<int64_t> sorted = a.epoch_order(1);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);
  EXPECT_EQ(TrainSampler(p, 7, false).epoch_order(2)[5], 5);
}

TEST(Sampler, PositionResumesTheSameStreamAcrossEpochs) {
  const PackedSequences p(iota_tokens(41), 4);  // 10 samples: batches of 3 cross epochs
  TrainSampler full(p, 3, true);
  std::vector<std::vector<int64_t>> batches;
  DataPosition after_two;
  for (int i = 0; i < 9; ++i) {
    batches.push_back(full.next_indices(3));
    if (i == 1) after_two = full.position();
  }
  EXPECT_EQ(full.position().epoch, 2);
  EXPECT_EQ(full.position().index, 7);
  // Epoch 0 yields each sample once, then epoch 1 starts its own order.
  std::set<int64_t> first_epoch;
  for (int i = 0; i < 3; ++i) first_epoch.insert(batches[static_cast<size_t>(i)].begin(), batches[static_cast<size_t>(i)].end());
  first_epoch.insert(batches[3][0]);
  EXPECT_EQ(first_epoch.size(), 10u);

  TrainSampler resumed(p, 3, true);
  resumed.set_position(after_two);
  for (int i = 2; i < 9; ++i) EXPECT_EQ(resumed.next_indices(3), batches[static_cast<size_t>(i)]) << i;
}

TEST(Documents, DirectoriesAreSortedRecursiveAndSkipHidden) {
  const fs::path d = scratch_dir("test_data_tmp");
  write_text(d / "b.txt", "second");
  write_text(d / "a" / "z.txt", "first");
  write_text(d / "c.jsonl", "{\"text\": \"third\"}\n\n{\"text\": \"fourth\", \"id\": 3}\n");
  write_text(d / ".hidden.txt", "never");
  write_text(d / ".git" / "x.txt", "never");
  write_text(d / "empty.txt", "");
  const auto docs = read_documents(d, {});
  EXPECT_EQ(docs, (std::vector<std::string>{"first", "second", "third", "fourth"}));
  // Forced text format: the JSONL file is one plain document.
  DocumentOptions text;
  text.format = DataFormat::Text;
  EXPECT_EQ(read_documents(d / "c.jsonl", text).size(), 1u);
}

TEST(Documents, JsonlFieldAndErrorsNameFileAndLine) {
  const fs::path d = scratch_dir("test_data_tmp");
  write_text(d / "x.jsonl", "{\"body\": \"hello\"}\n");
  DocumentOptions o;
  o.jsonl_field = "body";
  EXPECT_EQ(read_documents(d / "x.jsonl", o), (std::vector<std::string>{"hello"}));
  const std::string missing = error_of([&] { read_documents(d / "x.jsonl", {}); });
  EXPECT_NE(missing.find("x.jsonl:1"), std::string::npos) << missing;
  EXPECT_NE(missing.find("'text'"), std::string::npos) << missing;
  write_text(d / "bad.jsonl", "{\"text\": \"ok\"}\n{not json\n");
  const std::string bad = error_of([&] { read_documents(d / "bad.jsonl", {}); });
  EXPECT_NE(bad.find("bad.jsonl:2"), std::string::npos) << bad;
  const std::string absent = error_of([&] { read_documents(d / "nope.txt", {}); });
  EXPECT_NE(absent.find("nope.txt"), std::string::npos) << absent;
}

TEST(Corpus, DataSmallerThanOneSequenceNamesThePath) {
  const fs::path d = scratch_dir("test_data_tmp");
  write_text(d / "tiny.txt", "just a few words");
  CorpusOptions o;
  o.paths = {(d / "tiny.txt").string()};
  o.seq_len = 64;
  const std::string e = error_of([&] { load_corpus(o); });
  EXPECT_NE(e.find("tiny.txt"), std::string::npos) << e;
  EXPECT_NE(e.find("fewer than one sequence"), std::string::npos) << e;
  // Enough for a sample overall, but not once validation takes its share.
  o.seq_len = 10;
  o.val_fraction = 0.3;
  const std::string e2 = error_of([&] { load_corpus(o); });
  EXPECT_NE(e2.find("tiny.txt"), std::string::npos) << e2;
  o.val_fraction = 0.0;
  const Corpus c = load_corpus(o);
  EXPECT_EQ(c.total_tokens, 17);
  EXPECT_EQ(c.train.size(), 1);
}
