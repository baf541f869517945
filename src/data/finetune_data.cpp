#include "data/finetune_data.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/limits.h"
#include "data/chat_template.h"
#include "data/documents.h"
#include "data/tokenizer.h"
#include "model/lm_head_loss.h"

namespace moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

const char* example_format_name(ExampleFormat f) {
  switch (f) {
    case ExampleFormat::Text: return "text";
    case ExampleFormat::PromptCompletion: return "prompt_completion";
    case ExampleFormat::Chat: return "chat";
  }
  return "?";
}

// ------------------------------------------------------------------ rendering and tokenizing

namespace {

std::string chat_header(std::string_view role) { return "<|" + std::string(role) + "|>\n"; }

bool known_role(std::string_view role) {
  return role == "system" || role == "user" || role == "assistant";
}

void append_text(TokenizedExample& ex, std::string_view text, bool loss, const Tokenizer& tok) {
  tok.encode(text, ex.ids);
  ex.loss.resize(ex.ids.size(), loss ? 1 : 0);
}

void append_end_of_text(TokenizedExample& ex, const Tokenizer& tok) {
  ex.ids.push_back(tok.end_of_text());
  ex.loss.push_back(1);
}

// Encoding piece by piece (see the header) is what makes the generation prompt an exact prefix
// of the training ids; one string encoded whole could merge across those boundaries.
void render_messages(const std::vector<ChatMessage>& messages, const Tokenizer& tok,
                     TokenizedExample& ex) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    MOE_CHECK(known_role(m.role),
              "chat message {}: role: expected \"system\", \"user\" or \"assistant\", got \"{}\"",
              i, m.role);
    if (m.role != "assistant") {
      append_text(ex, chat_header(m.role) + m.content + "\n", false, tok);
      continue;
    }
    append_text(ex, chat_header(m.role), false, tok);
    append_text(ex, m.content, true, tok);
    append_end_of_text(ex, tok);
  }
}

bool has_assistant(const std::vector<ChatMessage>& messages) {
  return std::any_of(messages.begin(), messages.end(),
                     [](const ChatMessage& m) { return m.role == "assistant"; });
}

}  // namespace

TokenizedExample tokenize_text(std::string_view text, const Tokenizer& tokenizer) {
  TokenizedExample ex;
  append_text(ex, text, true, tokenizer);
  append_end_of_text(ex, tokenizer);
  ex.loss[0] = 0;  // nothing precedes the first id, so it is never a target
  return ex;
}

TokenizedExample tokenize_prompt_completion(std::string_view prompt, std::string_view completion,
                                            const Tokenizer& tokenizer) {
  TokenizedExample ex;
  append_text(ex, prompt, false, tokenizer);
  append_text(ex, completion, true, tokenizer);
  append_end_of_text(ex, tokenizer);
  return ex;
}

TokenizedExample tokenize_chat(const std::vector<ChatMessage>& messages,
                               const Tokenizer& tokenizer) {
  MOE_CHECK(has_assistant(messages),
            "chat: expected at least one \"assistant\" message (the loss is taken on assistant "
            "replies only), got none among {} messages",
            messages.size());
  TokenizedExample ex;
  render_messages(messages, tokenizer, ex);
  return ex;
}

std::vector<int32_t> chat_generation_prompt(const std::vector<ChatMessage>& messages,
                                            const Tokenizer& tokenizer) {
  TokenizedExample ex;
  render_messages(messages, tokenizer, ex);
  append_text(ex, chat_header("assistant"), false, tokenizer);
  return std::move(ex.ids);
}

// ------------------------------------------------------------------ a model's chat template

namespace {

nlohmann::ordered_json messages_json(const std::vector<ChatMessage>& messages, size_t count) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t i = 0; i < count; ++i)
    out.push_back(
        nlohmann::ordered_json{{"role", messages[i].role}, {"content", messages[i].content}});
  return out;
}

std::string render_prefix(const ChatTemplate& t, const std::vector<ChatMessage>& messages,
                          size_t count, bool add_generation_prompt) {
  return t.apply(messages_json(messages, count), add_generation_prompt);
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

// Bytes `a` and `b` share at the start, backed off to a UTF-8 character boundary of `b`.
size_t common_prefix(const std::string& a, const std::string& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  while (n > 0 && n < b.size() && (static_cast<unsigned char>(b[n]) & 0xC0) == 0x80) --n;
  return n;
}

std::string role_at(const std::vector<ChatMessage>& messages, size_t i) {
  return fmt::format("messages[{}] ({})", i, messages[i].role);
}

void append_pieces(TokenizedExample& ex, const std::vector<ChatPiece>& pieces,
                   const Tokenizer& tok) {
  for (const ChatPiece& p : pieces)
    if (!p.text.empty()) append_text(ex, p.text, p.loss, tok);
}

}  // namespace

std::vector<ChatPiece> chat_template_pieces(const std::vector<ChatMessage>& messages,
                                            const ChatTemplate& chat_template) {
  std::vector<ChatPiece> pieces;
  std::string prev;
  try {
    prev = render_prefix(chat_template, messages, 0, false);
  } catch (const Error&) {
    prev.clear();  // a template that indexes messages[0] cannot render no messages
  }
  pieces.push_back({prev, false});
  for (size_t i = 0; i < messages.size(); ++i) {
    std::string cur = render_prefix(chat_template, messages, i + 1, false);
    MOE_CHECK(starts_with(cur, prev),
              "chat template: adding {} changes how the earlier messages render (the rendering of "
              "messages[:{}] is not a prefix of that of messages[:{}]), so its turns cannot be "
              "located for the loss mask; this template cannot be fine-tuned on as it is",
              role_at(messages, i), i, i + 1);
    std::string turn = cur.substr(prev.size());
    if (messages[i].role == "assistant") {
      const std::string prompted = render_prefix(chat_template, messages, i, true);
      const std::string generation_prompt =
          starts_with(prompted, prev) ? prompted.substr(prev.size()) : std::string();
      const size_t header = common_prefix(generation_prompt, turn);
      pieces.push_back({turn.substr(0, header), false});
      pieces.push_back({turn.substr(header), true});
    } else {
      pieces.push_back({std::move(turn), false});
    }
    prev = std::move(cur);
  }
  return pieces;
}

TokenizedExample tokenize_chat(const std::vector<ChatMessage>& messages,
                               const Tokenizer& tokenizer, const ChatTemplate& chat_template) {
  MOE_CHECK(has_assistant(messages),
            "chat: expected at least one \"assistant\" message (the loss is taken on assistant "
            "replies only), got none among {} messages",
            messages.size());
  for (size_t i = 0; i < messages.size(); ++i)
    MOE_CHECK(known_role(messages[i].role),
              "chat message {}: role: expected \"system\", \"user\" or \"assistant\", got \"{}\"",
              i, messages[i].role);
  TokenizedExample ex;
  append_pieces(ex, chat_template_pieces(messages, chat_template), tokenizer);
  return ex;
}

std::vector<int32_t> chat_generation_prompt(const std::vector<ChatMessage>& messages,
                                            const Tokenizer& tokenizer,
                                            const ChatTemplate& chat_template) {
  std::vector<ChatPiece> pieces = chat_template_pieces(messages, chat_template);
  const std::string plain = render_prefix(chat_template, messages, messages.size(), false);
  const std::string prompted = render_prefix(chat_template, messages, messages.size(), true);
  MOE_CHECK(starts_with(prompted, plain),
            "chat template: the generation prompt changes how the messages render (the rendering "
            "without it is not a prefix of the rendering with it)");
  pieces.push_back({prompted.substr(plain.size()), false});
  TokenizedExample ex;
  append_pieces(ex, pieces, tokenizer);
  return std::move(ex.ids);
}

// ------------------------------------------------------------------ JSONL examples

namespace {

enum class FormatChoice { Auto, Text, Jsonl, PromptCompletion, Chat };

FormatChoice parse_format_choice(const std::string& name) {
  if (name == "auto") return FormatChoice::Auto;
  if (name == "text") return FormatChoice::Text;
  if (name == "jsonl") return FormatChoice::Jsonl;
  if (name == "prompt_completion") return FormatChoice::PromptCompletion;
  if (name == "chat") return FormatChoice::Chat;
  fail("data.format: expected \"auto\", \"text\", \"jsonl\", \"prompt_completion\" or \"chat\", "
       "got \"{}\"",
       name);
}

std::string found(const json* v) {
  return v ? std::string("got ") + v->type_name() : std::string("absent");
}

const std::string& string_field(const json& obj, const std::string& key, const std::string& where,
                                const std::string& name) {
  const auto it = obj.find(key);
  const json* v = it == obj.end() ? nullptr : &*it;
  MOE_CHECK(v && v->is_string(), "{}: field \"{}\": expected a string, {}", where, name, found(v));
  return v->get_ref<const std::string&>();
}

// The format a JSONL line itself points at; nullopt when it names none of the formats' fields.
std::optional<ExampleFormat> line_format(const json& line, const std::string& text_field) {
  if (line.contains("messages")) return ExampleFormat::Chat;
  if (line.contains("prompt") && line.contains("completion")) return ExampleFormat::PromptCompletion;
  if (line.contains(text_field)) return ExampleFormat::Text;
  if (line.contains("prompt") || line.contains("completion")) return ExampleFormat::PromptCompletion;
  return std::nullopt;
}

bool blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(),
                     [](char c) { return std::isspace(static_cast<unsigned char>(c)); });
}

std::string joined(const std::vector<std::string>& paths) {
  std::string out;
  for (const std::string& p : paths) out += (out.empty() ? "" : ", ") + p;
  return out;
}

// ------------------------------------------------------------------ rows

class FinetuneLoader {
 public:
  explicit FinetuneLoader(const FinetuneDataOptions& o)
      : o_(o), tok_(*o.tokenizer), choice_(parse_format_choice(o.format)) {}

  void read_path(const std::string& path) {
    for (const fs::path& f : list_data_files(path)) read_file(f);
  }

  Corpus finish(FinetuneDataStats* stats);

 private:
  void read_file(const fs::path& file);
  void read_jsonl(const fs::path& file);
  TokenizedExample with_bos(TokenizedExample ex, ExampleFormat f) const;
  std::optional<TokenizedExample> parse_example(const json& line, ExampleFormat f,
                                                const std::string& where) const;
  void add(const TokenizedExample& ex, ExampleFormat f);
  bool add_row(const TokenizedExample& ex, size_t begin, size_t end);
  int64_t rows() const { return static_cast<int64_t>(inputs_.size()) / o_.seq_len; }

  const FinetuneDataOptions& o_;
  const Tokenizer& tok_;
  FormatChoice choice_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<int64_t> example_rows_{0};  // first row of each kept example, then the row count
  uint64_t fingerprint_ = kFingerprintStart;
  int64_t total_tokens_ = 0;
  FinetuneDataStats stats_;
};

void FinetuneLoader::read_file(const fs::path& file) {
  const bool jsonl = choice_ != FormatChoice::Text &&
                     (choice_ != FormatChoice::Auto || file.extension() == ".jsonl");
  if (jsonl) return read_jsonl(file);
  const std::string text = read_whole_file(file);
  if (!text.empty()) add(with_bos(tokenize_text(text, tok_), ExampleFormat::Text), ExampleFormat::Text);
}

// A tokenizer whose config asks for a BOS (add_bos_token, e.g. DeepSeek's) gets it in front of
// every example, as transformers' tokenizer(text) would add it; a model chat template writes its
// own bos_token, so its renderings are left alone.
TokenizedExample FinetuneLoader::with_bos(TokenizedExample ex, ExampleFormat f) const {
  if (!tok_.add_bos() || tok_.bos_id() < 0 || ex.ids.empty()) return ex;
  ex.ids.insert(ex.ids.begin(), tok_.bos_id());
  ex.loss.insert(ex.loss.begin(), 0);
  if (f == ExampleFormat::Text) ex.loss[1] = 1;  // the first token is now predicted, from BOS
  return ex;
}

void FinetuneLoader::read_jsonl(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  MOE_CHECK(in.good(), "{}: cannot open for reading", file.string());
  std::optional<ExampleFormat> format;
  if (choice_ == FormatChoice::Jsonl) format = ExampleFormat::Text;
  if (choice_ == FormatChoice::PromptCompletion) format = ExampleFormat::PromptCompletion;
  if (choice_ == FormatChoice::Chat) format = ExampleFormat::Chat;
  int64_t detected_at = 0;  // line that fixed the format under auto
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (blank(line)) continue;
    const std::string where = fmt::format("{}:{}", file.string(), line_no);
    const json j = json::parse(line, json_depth_limit<json>(where), /*allow_exceptions=*/false);
    MOE_CHECK(!j.is_discarded(), "{}: not valid JSON", where);
    MOE_CHECK(j.is_object(), "{}: expected a JSON object, got {}", where, j.type_name());
    const std::optional<ExampleFormat> own = line_format(j, o_.jsonl_field);
    if (!format) {
      format = own.value_or(ExampleFormat::Text);
      detected_at = line_no;
    } else if (detected_at > 0 && own && *own != *format) {
      fail("{}: a {} example in a file of {} examples (detected from line {}); one file must "
           "hold one format",
           where, example_format_name(*own), example_format_name(*format), detected_at);
    }
    if (auto ex = parse_example(j, *format, where)) {
      const bool templated = *format == ExampleFormat::Chat && o_.chat_template != nullptr;
      add(templated ? std::move(*ex) : with_bos(std::move(*ex), *format), *format);
    }
  }
  MOE_CHECK(!in.bad(), "{}: read error", file.string());
}

std::optional<TokenizedExample> FinetuneLoader::parse_example(const json& line, ExampleFormat f,
                                                              const std::string& where) const {
  switch (f) {
    case ExampleFormat::Text: {
      const std::string& text = string_field(line, o_.jsonl_field, where, o_.jsonl_field);
      // Empty documents are skipped, as in pretraining (data/documents.h).
      if (text.empty()) return std::nullopt;
      return tokenize_text(text, tok_);
    }
    case ExampleFormat::PromptCompletion: {
      // Separate statements: argument order is unspecified, and the error should not be.
      const std::string& prompt = string_field(line, "prompt", where, "prompt");
      const std::string& completion = string_field(line, "completion", where, "completion");
      return tokenize_prompt_completion(prompt, completion, tok_);
    }
    case ExampleFormat::Chat: {
      const std::vector<ChatMessage> messages = parse_chat_messages(line, where, /*need_assistant=*/true);
      if (!o_.chat_template) return tokenize_chat(messages, tok_);
      try {
        return tokenize_chat(messages, tok_, *o_.chat_template);
      } catch (const Error& e) {
        fail("{}: rendering with the model's chat template: {}", where, e.what());
      }
    }
  }
  return std::nullopt;
}

// Every id with its loss flag (a flagged-off id stored as ~id, never equal to an id), then a
// separator, so a change of ids, masks or example boundaries changes the fingerprint. The first
// id's flag is left out: it never matters (see TokenizedExample).
std::vector<int32_t> fingerprint_words(const TokenizedExample& ex) {
  std::vector<int32_t> words;
  words.reserve(ex.ids.size() + 1);
  for (size_t i = 0; i < ex.ids.size(); ++i)
    words.push_back(i > 0 && ex.loss[i] ? ex.ids[i] : ~ex.ids[i]);
  words.push_back(std::numeric_limits<int32_t>::min());
  return words;
}

void FinetuneLoader::add(const TokenizedExample& ex, ExampleFormat f) {
  ++stats_.examples;
  fingerprint_ = token_fingerprint(fingerprint_words(ex), fingerprint_);
  const size_t row_ids = static_cast<size_t>(o_.seq_len) + 1;
  size_t n = ex.ids.size();
  const int64_t rows_before = rows();
  if (f == ExampleFormat::Text) {
    // Windows overlap by one id: a window's last id (a target) is the next one's first input.
    for (size_t begin = 0; begin + 1 < n; begin += row_ids - 1)
      add_row(ex, begin, std::min(begin + row_ids, n));
  } else {
    if (n > row_ids) ++stats_.truncated;
    n = std::min(n, row_ids);
    add_row(ex, 0, n);
  }
  if (rows() == rows_before) return;
  example_rows_.push_back(rows());
  total_tokens_ += static_cast<int64_t>(n);
}

bool FinetuneLoader::add_row(const TokenizedExample& ex, size_t begin, size_t end) {
  if (std::none_of(ex.loss.begin() + static_cast<std::ptrdiff_t>(begin) + 1,
                   ex.loss.begin() + static_cast<std::ptrdiff_t>(end),
                   [](uint8_t l) { return l != 0; })) {
    ++stats_.dropped_empty;
    return false;
  }
  for (size_t p = begin; p < begin + static_cast<size_t>(o_.seq_len); ++p) {
    if (p + 1 < end) {
      inputs_.push_back(ex.ids[p]);
      targets_.push_back(ex.loss[p + 1] ? ex.ids[p + 1] : kIgnoreIndex);
    } else {
      // Padding is never a target, so its id only has to be a valid input.
      inputs_.push_back(tok_.end_of_text());
      targets_.push_back(kIgnoreIndex);
      ++stats_.padding;
    }
  }
  return true;
}

// The tail of the kept examples; never all of them, so training keeps at least one row.
int64_t validation_examples(int64_t kept, double fraction) {
  if (fraction <= 0.0 || kept < 2) return 0;
  const int64_t n = std::llround(fraction * static_cast<double>(kept));
  return std::clamp<int64_t>(n, 1, kept - 1);
}

std::vector<int32_t> counted_targets_of(const std::vector<int32_t>& targets) {
  std::vector<int32_t> out;
  std::copy_if(targets.begin(), targets.end(), std::back_inserter(out),
               [](int32_t t) { return t != kIgnoreIndex; });
  return out;
}

Corpus FinetuneLoader::finish(FinetuneDataStats* stats) {
  const std::string paths = joined(o_.paths);
  MOE_CHECK(stats_.examples > 0, "{}: no examples found (the files are empty or hold only empty "
            "documents)", paths);
  const auto kept = static_cast<int64_t>(example_rows_.size()) - 1;
  MOE_CHECK(kept > 0,
            "{}: no training row left: all {} examples lost every target when truncated to "
            "seq_len + 1 = {} ids (prompts longer than a row?); raise data.seq_len",
            paths, stats_.examples, o_.seq_len + 1);
  const int64_t n_val = validation_examples(kept, o_.val_fraction);
  const auto cut = static_cast<std::ptrdiff_t>(example_rows_[static_cast<size_t>(kept - n_val)] *
                                               o_.seq_len);
  std::vector<int32_t> val_in(inputs_.begin() + cut, inputs_.end());
  std::vector<int32_t> val_tg(targets_.begin() + cut, targets_.end());
  inputs_.resize(static_cast<size_t>(cut));
  targets_.resize(static_cast<size_t>(cut));

  Corpus c;
  c.documents = stats_.examples;
  c.total_tokens = total_tokens_;
  c.fingerprint = fingerprint_;
  c.train_unigram_entropy = unigram_entropy(counted_targets_of(targets_));
  c.train = PackedSequences::from_rows(std::move(inputs_), std::move(targets_), o_.seq_len);
  c.val = PackedSequences::from_rows(std::move(val_in), std::move(val_tg), o_.seq_len);
  stats_.val_examples = n_val;
  stats_.rows = c.train.size() + c.val.size();
  stats_.val_rows = c.val.size();
  stats_.counted_targets = c.train.counted_targets() + c.val.counted_targets();
  if (stats) *stats = stats_;
  return c;
}

}  // namespace

std::vector<ChatMessage> parse_chat_messages(const json& line, const std::string& where,
                                             bool need_assistant) {
  const auto it = line.find("messages");
  const json* v = it == line.end() ? nullptr : &*it;
  MOE_CHECK(v && v->is_array() && !v->empty(),
            "{}: field \"messages\": expected a non-empty array of {{\"role\", \"content\"}} "
            "objects, {}",
            where, v && v->is_array() ? std::string("got an empty array") : found(v));
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string name = fmt::format("messages[{}]", i);
    MOE_CHECK(m.is_object(), "{}: field \"{}\": expected an object with string \"role\" and "
              "\"content\", got {}", where, name, m.type_name());
    ChatMessage msg{string_field(m, "role", where, name + ".role"),
                    string_field(m, "content", where, name + ".content")};
    MOE_CHECK(known_role(msg.role),
              "{}: field \"{}.role\": expected \"system\", \"user\" or \"assistant\", got \"{}\"",
              where, name, msg.role);
    messages.push_back(std::move(msg));
  }
  MOE_CHECK(!need_assistant || has_assistant(messages),
            "{}: field \"messages\": expected at least one \"assistant\" message (the loss is "
            "taken on assistant replies only), got none",
            where);
  return messages;
}

Corpus load_finetune_corpus(const FinetuneDataOptions& options, FinetuneDataStats* stats) {
  MOE_CHECK(options.tokenizer, "fine-tuning data: a tokenizer is required");
  MOE_CHECK(!options.paths.empty(), "no data paths given");
  MOE_CHECK(options.seq_len > 0, "data.seq_len: expected a positive length, got {}",
            options.seq_len);
  MOE_CHECK(options.val_fraction >= 0.0 && options.val_fraction < 1.0,
            "data.val_fraction: expected a value in [0, 1), got {}", options.val_fraction);
  FinetuneLoader loader(options);
  for (const std::string& p : options.paths) loader.read_path(p);
  return loader.finish(stats);
}

}  // namespace moe
