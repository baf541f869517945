// tiktoken tokenizers (data/tiktoken_tokenizer.h, Moonlight / Kimi's tiktoken.model) against
// js-tiktoken, OpenAI's algorithm in JavaScript.
//
// Without node: tests/fixtures/tokenizers/tiktoken_kimi_small (cl100k_base's first 4,096 ranks as
// a tiktoken.model, a Moonlight-like tokenizer_config.json) with the ids and regex pieces
// js-tiktoken gave for the corpus and special-token texts, with Kimi's pattern and cl100k's.
// Regenerate with tests/tokenizer_ref/tiktoken.mjs (see expected.jsonl's fields).
//
// With node and tests/tokenizer_ref/node_modules/js-tiktoken: the full cl100k_base ranks exported
// to a tiktoken.model, encoded live by js-tiktoken with both patterns on the corpus, and compared
// with js-tiktoken's own cl100k_base encoder. These skip, saying why, when node or the package is
// missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/limits.h"
#include "data/tiktoken_tokenizer.h"
#include "data/tokenizer.h"
#include "test_util.h"

using namespace moe;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path kSource = MOE_SOURCE_DIR;
const fs::path kRefDir = kSource / "tests" / "tokenizer_ref";
const fs::path kSmall = kSource / "tests" / "fixtures" / "tokenizers" / "tiktoken_kimi_small";

std::string shown(const std::string& s) { return json(s).dump().substr(0, 160); }

struct Counts {
  int64_t cases = 0, tokens = 0, id_mismatches = 0, piece_mismatches = 0, decode_mismatches = 0;
};

Counts compare(const TiktokenTokenizer& tok, const std::vector<json>& refs, const std::string& label,
               const char* ids_key, const char* pieces_key) {
  Counts c;
  for (const json& r : refs) {
    const std::string text = r.at("text").get<std::string>();
    const auto want = r.at(ids_key).get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok.encode(text);
    ++c.cases;
    c.tokens += static_cast<int64_t>(want.size());
    if (got != want && ++c.id_mismatches <= 8)
      ADD_FAILURE() << label << " " << r.at("file") << "#" << r.at("case") << " " << shown(text)
                    << "\n  ours:        " << ::testing::PrintToString(got)
                    << "\n  js-tiktoken: " << ::testing::PrintToString(want);
    if (pieces_key && r.contains(pieces_key) && r.at(pieces_key).is_array()) {
      const auto want_pieces = r.at(pieces_key).get<std::vector<std::string>>();
      if (tok.pieces(text) != want_pieces && ++c.piece_mismatches <= 8)
        ADD_FAILURE() << label << ": pieces differ for " << r.at("file") << "#" << r.at("case") << " "
                      << shown(text) << "\n  want: " << json(want_pieces).dump().substr(0, 400)
                      << "\n  ours: " << json(tok.pieces(text)).dump().substr(0, 400);
    }
    if (tok.decode(got) != text && ++c.decode_mismatches <= 8)
      ADD_FAILURE() << label << ": decode(encode(x)) != x for " << shown(text);
  }
  std::cout << "[ compared ] " << label << ": " << c.cases << " texts, " << c.tokens << " tokens, "
            << c.id_mismatches << " id mismatches, " << c.piece_mismatches << " piece mismatches, "
            << c.decode_mismatches << " round-trip failures\n";
  return c;
}

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

std::string reference_unavailable() {
  if (std::system("node --version > /dev/null 2>&1") != 0) return "node is not on PATH";
  if (!fs::exists(kRefDir / "node_modules" / "js-tiktoken"))
    return "tests/tokenizer_ref/node_modules/js-tiktoken is missing: `npm ci` there needs the npm registry";
  const std::string check = "node " + quote((kRefDir / "tiktoken.mjs").string()) + " --check > /dev/null 2>&1";
  if (std::system(check.c_str()) != 0) return "js-tiktoken does not load under this node";
  return {};
}

std::string run(const std::string& cmd) {
  const moe::testing::CommandResult r = moe::testing::run_command(cmd);
  if (r.status != 0) throw std::runtime_error("failed: " + cmd);
  return r.output;
}

std::string corpus_args() {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(kRefDir / "corpus")) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  std::string s;
  for (const auto& f : files) s += " " + quote(f);
  return s;
}

}  // namespace

// ================================================================== without node

TEST(TiktokenFixture, MatchesTheIdsAndPiecesJsTiktokenGave) {
  const std::vector<json> refs = moe::testing::parse_jsonl(moe::testing::read_file(kSmall / "expected.jsonl"));
  ASSERT_GE(refs.size(), 150u);
  const auto kimi = TiktokenTokenizer::load(kSmall);
  const Counts a = compare(kimi, refs, "tiktoken_kimi_small, Kimi pattern (committed)", "ids", "pieces");
  const auto cl = TiktokenTokenizer::load(kSmall / "tiktoken.model", TiktokenTokenizer::kCl100kPattern);
  const Counts b = compare(cl, refs, "tiktoken_kimi_small, cl100k pattern (committed)", "ids_cl100k", "pieces_cl100k");
  EXPECT_GT(a.tokens, 4000);
  EXPECT_GT(b.tokens, 4000);
  // The two patterns split differently somewhere in these texts (Han runs, CamelCase).
  int64_t differ = 0;
  for (const json& r : refs) differ += r.at("pieces") != r.at("pieces_cl100k");
  EXPECT_GT(differ, 5);
}

TEST(TiktokenFixture, ConfigSpecialTokensAndReservedSlots) {
  const auto tok = TiktokenTokenizer::load(kSmall);
  EXPECT_EQ(tok.kind(), "tiktoken");
  EXPECT_EQ(tok.num_ranks(), 4096);
  EXPECT_EQ(tok.vocab_size(), 4096 + 256);
  EXPECT_EQ(tok.bos_id(), 4096);
  EXPECT_EQ(tok.eos_id(), 4097);
  EXPECT_EQ(tok.end_of_text(), 4097);
  EXPECT_EQ(tok.pad_id(), 4351);
  EXPECT_TRUE(tok.add_bos());
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), 4098);
  EXPECT_EQ(tok.token_to_id("<|reserved_token_4101|>"), 4101);
  EXPECT_EQ(tok.token_to_id("<|reserved_token_4351|>"), -1);  // named [PAD]
  EXPECT_TRUE(tok.is_special(4200));
  EXPECT_FALSE(tok.is_special(4095));
  EXPECT_EQ(tok.token_bytes(4098), "<|im_end|>");
  EXPECT_EQ(tok.token_bytes(4096 + 256), "");
  EXPECT_EQ(tok.encode("[BOS]Hi<|im_end|>").front(), 4096);
  EXPECT_EQ(tok.encode("[BOS]Hi<|im_end|>").back(), 4098);

  // load_tokenizer: the directory, and the file itself.
  for (const fs::path& spec : {kSmall, kSmall / "tiktoken.model"}) {
    const std::unique_ptr<Tokenizer> t = load_tokenizer(spec.string());
    EXPECT_EQ(t->kind(), "tiktoken") << spec;
    EXPECT_EQ(t->vocab_size(), 4352);
    EXPECT_EQ(t->encode("Hello world"), tok.encode("Hello world"));
  }
  // A ranks file alone: no special tokens, the special text is ordinary text.
  const fs::path tmp = fs::temp_directory_path() / fmt::format("moe_tiktoken_{}", ::getpid());
  fs::create_directories(tmp);
  fs::copy_file(kSmall / "tiktoken.model", tmp / "x.tiktoken", fs::copy_options::overwrite_existing);
  const std::unique_ptr<Tokenizer> bare = load_tokenizer((tmp / "x.tiktoken").string());
  EXPECT_EQ(bare->vocab_size(), 4096);
  EXPECT_EQ(bare->bos_id(), -1);
  const std::vector<int32_t> ids = bare->encode("[BOS]");
  EXPECT_GT(ids.size(), 1u);
  for (int32_t id : ids) EXPECT_LT(id, 4096);
  fs::remove_all(tmp);
}

TEST(TiktokenFixture, InvalidUtf8RoundTripsAndErrorsNameTheFile) {
  const auto tok = TiktokenTokenizer::load(kSmall);
  const std::string bad = "ok \xff\xfe bytes \xe4\xb8 cut \xc3";
  const std::vector<int32_t> ids = tok.encode(bad);
  EXPECT_EQ(tok.decode(ids), bad);
  try {
    TiktokenTokenizer::from_text("IQ== 0\nnot-base64!! 1\n", "bad.model");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("bad.model:2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TiktokenTokenizer::from_text("IQ== 0\n", "few.model"), std::exception);  // bytes without ranks
}

// A tiktoken.model giving each single byte its own value as rank.
std::string single_byte_ranks() {
  std::string ranks;
  for (int b = 0; b < 256; ++b) {
    static const char* const kDigits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const auto u = static_cast<unsigned char>(b);
    ranks += std::string{kDigits[u >> 2], kDigits[(u & 3) << 4], '=', '='} + " " + std::to_string(b) + "\n";
  }
  return ranks;
}

// Found by tests/fuzz/fuzz_tiktoken: a special token whose id lies in a gap of the ranks (allowed:
// it clashes with no rank) decoded to nothing, so decode(encode(text)) lost it.
TEST(TiktokenFixture, ASpecialIdInAGapOfTheRanksDecodesToItsText) {
  std::string ranks = single_byte_ranks();
  ranks += "YWI= 300\n";  // "ab" at 300: ids 256..299 are a gap
  const auto tok = TiktokenTokenizer::from_text(
      ranks, "gap.model", R"({"added_tokens_decoder": {"260": {"content": "[BOS]", "special": true}}})");
  const std::vector<int32_t> ids = tok.encode("[BOS]ab");
  EXPECT_EQ(ids, (std::vector<int32_t>{260, 300}));
  EXPECT_EQ(tok.decode(ids), "[BOS]ab");
}

// Found by tests/fuzz/fuzz_tiktoken: added_tokens_decoder keys " 300" and "300" both read as id
// 300, so the id had two texts; "<|a|>" encoded to 300 and decoded as "<|b|>". Keys are now
// digits only, and an id given two texts is an error either way.
TEST(TiktokenFixture, AnIdWithTwoTokensIsAnError) {
  const std::string ranks = single_byte_ranks();
  for (const char* key : {" 300", "+300", "0300", "3e2", ""}) {
    const std::string config = std::string(R"({"added_tokens_decoder": {")") + key +
                               R"(": {"content": "<|a|>", "special": true}, "300": {"content": "<|b|>", "special": true}}})";
    try {
      TiktokenTokenizer::from_text(ranks, "two.model", config, "two_config.json");
      FAIL() << "no error for key `" << key << "`";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("two_config.json"), std::string::npos) << what;
      EXPECT_NE(what.find(std::string("key `") + key + "`"), std::string::npos) << what;
    }
  }
  // And one text at two ids stays an error too.
  try {
    TiktokenTokenizer::from_text(ranks, "two.model",
                                 R"({"added_tokens_decoder": {"300": {"content": "<|a|>"}, "301": {"content": "<|a|>"}}})",
                                 "two_config.json");
    FAIL() << "no error for one text at two ids";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("has two ids"), std::string::npos) << e.what();
  }
}

// tiktoken's byte_pair_merge as OpenAI wrote it (O(n^2)): the reference for our heap-based merge.
std::vector<int32_t> quadratic_byte_pair_merge(const TiktokenTokenizer& tok, const std::string& piece) {
  auto rank = [&](size_t a, size_t b) {
    const std::string bytes = piece.substr(a, b - a);
    const int32_t id = tok.token_to_id(bytes);
    return id >= 0 && !tok.is_special(id) ? id : INT32_MAX;
  };
  if (rank(0, piece.size()) != INT32_MAX) return {rank(0, piece.size())};
  std::vector<std::pair<size_t, int32_t>> parts;  // (start, rank of this part joined with the next)
  for (size_t i = 0; i + 1 < piece.size(); ++i) parts.emplace_back(i, rank(i, i + 2));
  parts.emplace_back(piece.size() - 1, INT32_MAX);
  parts.emplace_back(piece.size(), INT32_MAX);
  for (;;) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < parts.size(); ++i)
      if (parts[i].second < parts[best].second) best = i;
    if (parts[best].second == INT32_MAX) break;
    auto joined = [&](size_t i) { return i + 3 < parts.size() ? rank(parts[i].first, parts[i + 3].first) : INT32_MAX; };
    if (best > 0) parts[best - 1].second = joined(best - 1);
    parts[best].second = joined(best);
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < parts.size(); ++i) ids.push_back(rank(parts[i].first, parts[i + 1].first));
  return ids;
}

// Random texts over an alphabet that makes long pieces with repeated pairs (equal ranks at
// several places: the leftmost must merge first), Han, accents and punctuation runs.
TEST(TiktokenFixture, HeapMergeEqualsTiktokensQuadraticMergeOnRandomTexts) {
  const auto tok = TiktokenTokenizer::load(kSmall);
  const std::vector<std::string> alphabet = {"a", "a", "b", "an", "the", "in", "e", "s", " ", "\n", "\xe4\xb8\xad",
                                             "\xc3\xa9", "!", "=", "0", "1", "T", "ing", "ation"};
  std::mt19937 rng(7);
  int64_t pieces = 0, longest = 0;
  for (int t = 0; t < 400; ++t) {
    std::string text;
    const int len = 1 + static_cast<int>(rng() % (t < 390 ? 60 : 2000));
    for (int i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
    if (t % 50 == 0) text += std::string(1500, 'e');  // "ee" has a rank: 1,499 equal candidates
    std::vector<int32_t> want;
    for (const std::string& piece : tok.pieces(text)) {
      const std::vector<int32_t> ids = quadratic_byte_pair_merge(tok, piece);
      want.insert(want.end(), ids.begin(), ids.end());
      ++pieces;
      longest = std::max<int64_t>(longest, static_cast<int64_t>(piece.size()));
    }
    ASSERT_EQ(tok.encode(text), want) << shown(text);
  }
  EXPECT_GT(pieces, 4000);
  EXPECT_GE(longest, 1500);
}

// A megabyte of letters is one regex piece: tiktoken's own O(n^2) merge would take hours for
// its half a million merges (a hostile request to `moe serve`), ours a fraction of a second.
TEST(TiktokenFixture, AMegabyteOfLettersIsOnePieceEncodedInNLogNTime) {
  const auto tok = TiktokenTokenizer::load(kSmall);
  std::string text;
  for (int i = 0; i < (1 << 19); ++i) text += "in";
  ASSERT_EQ(tok.pieces(text).size(), 1u);
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_LE(ids.size(), text.size() / 2);
  EXPECT_EQ(tok.decode(ids), text);
}

// Special tokens match leftmost first, then longest there, wherever they overlap.
TEST(TiktokenFixture, SpecialTokensMatchLeftmostThenLongest) {
  const auto tok = TiktokenTokenizer::from_text(single_byte_ranks(), "specials.model", R"({"added_tokens_decoder": {
      "300": {"content": "<|x|>"}, "301": {"content": "<|x|>y"}, "302": {"content": "x|>"},
      "303": {"content": "y<"}}})");
  auto ids_of = [](const std::string& s) {
    std::vector<int32_t> ids;
    for (char c : s) ids.push_back(static_cast<unsigned char>(c));
    return ids;
  };
  EXPECT_EQ(tok.encode("<|x|>"), (std::vector<int32_t>{300}));
  EXPECT_EQ(tok.encode("<|x|>y"), (std::vector<int32_t>{301}));
  EXPECT_EQ(tok.encode("<|x|>z"), (std::vector<int32_t>{300, 'z'}));
  EXPECT_EQ(tok.encode("|x|>"), (std::vector<int32_t>{'|', 302}));
  EXPECT_EQ(tok.encode("zy<|x|>"), (std::vector<int32_t>{'z', 303, '|', 302}));
  std::vector<int32_t> want = ids_of("<|x");
  want.push_back(300);
  EXPECT_EQ(tok.encode("<|x<|x|>"), want);
  // Reserved slots: 256 more specials of several lengths.
  EXPECT_EQ(tok.vocab_size(), 256 + 256);
  EXPECT_EQ(tok.encode("a<|reserved_token_256|><|reserved_token_299|>b").size(), 4u);
}

// The rank table is sized by the largest rank: one line with rank 2^30 - 2 asked for 32 GiB.
TEST(TiktokenFixture, AHugeRankIsAnErrorNotAnAllocation) {
  constexpr int64_t kRank = 1073741822;
  if (max_load_bytes() >= (kRank + 1) * static_cast<int64_t>(sizeof(std::string)))
    GTEST_SKIP() << "this machine could hold the table";
  try {
    TiktokenTokenizer::from_text("YQ== 1073741822\n", "huge.model");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("huge.model"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1073741822"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(kMaxLoadBytesEnv), std::string::npos) << e.what();
  }
}

// ================================================================== with node

TEST(TiktokenReference, FullCl100kRanksMatchJsTiktokenOnTheCorpus) {
  if (const std::string why = reference_unavailable(); !why.empty()) GTEST_SKIP() << "tiktoken reference skipped: " << why;
  const fs::path tmp = fs::temp_directory_path() / fmt::format("moe_tiktoken_ref_{}", ::getpid());
  fs::create_directories(tmp);
  const std::string script = "node " + quote((kRefDir / "tiktoken.mjs").string());
  const fs::path model = tmp / "tiktoken.model";
  run(script + " --export-cl100k " + quote(model.string()));
  // Special-token texts (the small fixture's config renumbered would not fit; these use none).
  const std::string specials = " --texts " + quote((kSmall / "specials.json").string());
  int64_t total_tokens = 0;
  for (const std::string pattern : {"kimi", "cl100k", "builtin-cl100k"}) {
    const std::vector<json> refs =
        moe::testing::parse_jsonl(run(script + " --ranks " + quote(model.string()) + " --pattern " + pattern + specials + corpus_args()));
    ASSERT_GE(refs.size(), 150u);
    const auto tok = TiktokenTokenizer::load(
        model, pattern == std::string("kimi") ? TiktokenTokenizer::kKimiPattern : TiktokenTokenizer::kCl100kPattern);
    EXPECT_EQ(tok.num_ranks(), 100256);
    if (pattern == std::string("builtin-cl100k")) {
      // js-tiktoken's own encoder uses JavaScript's \s (U+FEFF in, U+0085 out); we use Unicode
      // White_Space as tiktoken's Rust regex does, so only texts with those may differ.
      std::vector<json> same;
      for (const json& r : refs) {
        const std::string t = r.at("text").get<std::string>();
        if (t.find("\xef\xbb\xbf") == std::string::npos && t.find("\xc2\x85") == std::string::npos) same.push_back(r);
      }
      EXPECT_GE(refs.size() - same.size(), 0u);
      const Counts c = compare(tok, same, "cl100k_base vs js-tiktoken's built-in encoder (live)", "ids", nullptr);
      total_tokens += c.tokens;
    } else {
      const Counts c = compare(tok, refs, std::string("cl100k_base ranks, ") + pattern + " pattern (live)", "ids", "pieces");
      total_tokens += c.tokens;
    }
  }
  EXPECT_GT(total_tokens, 5000);
  fs::remove_all(tmp);
}
