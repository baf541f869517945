// A request body of `moe serve` and what the server does with it before the model runs: the
// first byte picks /v1/completions or /v1/chat/completions, the rest is the body. A valid
// request's messages go through the chat template and the tokenizer of a DeepSeek-V3 fixture,
// its prompt through the tokenizer, its token budget through the context-length rule, and its
// text into the response and stream JSON; a refused one into OpenAI's error object. The API
// promises that an ApiException is the only thing any body can raise; the template's own errors
// (raise_exception) are moe::Error, which the server answers with 400 as well.
#include "data/chat_template.h"
#include "data/finetune_data.h"
#include "data/hf_tokenizer.h"
#include "fuzz_util.h"
#include "serve/openai_api.h"

using namespace moe;

namespace {

const std::filesystem::path kFixture = std::filesystem::path(MOE_SOURCE_DIR) / "tests/fixtures/tokenizers/deepseek_v3_small";

const HfTokenizer& tokenizer() {
  static const HfTokenizer t = HfTokenizer::load(kFixture);
  return t;
}

const ChatTemplate& chat_template() {
  static const ChatTemplate t = *load_chat_template(kFixture / "tokenizer_config.json");
  return t;
}

ApiLimits limits() {
  ApiLimits l;
  l.model_id = "moe-small";
  l.context_length = 256;
  l.max_tokens_default = 64;
  l.max_body_bytes = 1 << 20;
  return l;
}

void serve(bool chat, std::string_view body) {
  const ApiLimits l = limits();
  const GenerationParams p = chat ? parse_chat_request(body, l) : parse_completion_request(body, l);
  std::vector<int32_t> prompt;
  try {
    if (chat) {
      prompt = chat_generation_prompt(chat_messages(p), tokenizer(), chat_template());
    } else {
      tokenizer().encode(p.prompt, prompt);
    }
  } catch (const Error&) {
    return;  // the server's 400
  }
  const int64_t budget = completion_budget(p, static_cast<int64_t>(prompt.size()), l);
  if (budget < 1 || static_cast<int64_t>(prompt.size()) + budget > l.context_length)
    fuzz::finding("completion_budget gave " + std::to_string(budget) + " tokens for a prompt of " +
                  std::to_string(prompt.size()));
  const ResponseInfo info{"cmpl-0", 0, l.model_id};
  const std::string text = p.echo ? p.prompt : tokenizer().decode(prompt);
  const Usage usage{static_cast<int64_t>(prompt.size()), budget};
  (void)dump_json(chat ? chat_response(info, text, ApiFinish::stop, usage)
                       : completion_response(info, text, ApiFinish::length, usage));
  (void)sse_event(chat ? chat_content_chunk(info, text, p.include_usage)
                       : completion_chunk(info, text, std::nullopt, p.include_usage));
  for (const std::string& stop : p.stop)
    if (stop.empty() || stop.size() > kMaxStopBytes) fuzz::finding("a stop string outside the limits");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  (void)chat_template();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) != 0;
  try {
    serve(chat, fuzz::as_text(data + 1, size - 1));
  } catch (const ApiException& e) {
    (void)error_body(e.error());
  }
  return 0;
}
