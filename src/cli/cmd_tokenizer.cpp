// `moe tokenizer train`: learn a byte-level BPE on a corpus and save it as a Hugging Face
// tokenizer.json, for [data] tokenizer = "path/to/tokenizer.json".
#include <fmt/format.h>

#include <chrono>
#include <filesystem>

#include "cli/commands.h"
#include "core/error.h"
#include "data/bpe_trainer.h"
#include "data/documents.h"
#include "io/atomic_file.h"

namespace moe::cli {

namespace {

namespace fs = std::filesystem;

struct TokenizerTrainArgs {
  std::vector<std::string> data;
  std::string format = "auto";
  std::string jsonl_field = "text";
  int64_t vocab_size = 2048;
  std::string out;
};

void run_tokenizer_train(const TokenizerTrainArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  DocumentOptions options;
  options.format = parse_data_format(a.format, "--format");
  options.jsonl_field = a.jsonl_field;
  std::vector<std::string> docs;
  int64_t bytes = 0;
  for (const std::string& p : a.data) {
    MOE_CHECK(fs::exists(p), "--data: {}: no such file or directory", p);
    for (std::string& d : read_documents(p, options)) {
      bytes += static_cast<int64_t>(d.size());
      docs.push_back(std::move(d));
    }
  }
  MOE_CHECK(bytes > 0, "--data: no text in {}", a.data.front());
  BpeTrainStats stats;
  const BpeTokenizer tok = train_bpe(docs, a.vocab_size, &stats);
  const fs::path out(a.out);
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  write_file_atomic(out, tok.to_json());

  int64_t tokens = 0;
  for (const std::string& d : docs) tokens += static_cast<int64_t>(tok.encode(d).size());
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("{} document{}, {} bytes, {} words ({} distinct)\n", docs.size(),
             docs.size() == 1 ? "" : "s", bytes, stats.words, stats.unique_words);
  fmt::print("vocabulary {} ({} merges{}), {:.2f} bytes per token on this data\n",
             tok.vocab_size(), stats.merges,
             tok.vocab_size() < a.vocab_size ? ", stopped early: nothing left to merge" : "",
             tokens ? static_cast<double>(bytes) / static_cast<double>(tokens) : 0.0);
  fmt::print("wrote {} in {:.1f}s\n", out.string(), secs);
}

}  // namespace

void add_tokenizer_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenizer", "byte-level BPE tokenizers");
  cmd->require_subcommand(1);
  auto* train = cmd->add_subcommand(
      "train", "learn a byte-level BPE on text and write it as a Hugging Face tokenizer.json");
  auto a = std::make_shared<TokenizerTrainArgs>();
  train->add_option("--data", a->data, "text/JSONL file or directory (repeatable)")->required();
  train->add_option("--format", a->format, "auto | text | jsonl")->capture_default_str();
  train->add_option("--jsonl-field", a->jsonl_field, "string field of JSONL records")
      ->capture_default_str();
  train->add_option("--vocab-size", a->vocab_size,
                    "ids in the vocabulary: 256 bytes, <|endoftext|>, then merges")
      ->capture_default_str();
  train->add_option("--out", a->out, "output tokenizer.json")->required();
  train->callback([a] { run_tokenizer_train(*a); });
}

}  // namespace moe::cli
