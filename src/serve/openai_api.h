#pragma once
// The OpenAI-compatible API without the HTTP: request bodies of /v1/completions and
// /v1/chat/completions parsed and validated into generation parameters, the context-length
// check, and the JSON of responses, stream chunks, errors and /v1/models.
//
// Request bodies come from the network, so parsing is written for hostile input: the size is
// capped (413) before parsing, nesting deeper than kMaxJsonDepth is refused while parsing, every
// field's JSON type and range is checked, unknown fields are refused by name (a misspelt
// "max_token" must not silently become the default), and the request text quoted back in
// messages is truncated. Every failure is an ApiException carrying the HTTP status and OpenAI's
// error object; nothing else is thrown for any body.
//
// Accepted fields (null is the same as absent for the optional ones):
//   both:  model (absent, or the served model's id: else 404 model_not_found), max_tokens
//          (integer >= 1), temperature [0, 2], top_p (0, 1], n (1 only), stream (bool),
//          stream_options ({include_usage: bool}, only with stream: true), stop (string or
//          array of at most kMaxStopStrings non-empty strings of at most kMaxStopBytes bytes),
//          seed (integer), presence_penalty and frequency_penalty [-2, 2], user (string,
//          ignored), and the extensions of vLLM and llama.cpp's servers: top_k (integer; 0 or
//          -1 = no limit), min_p [0, 1], repetition_penalty (> 0).
//   /v1/completions:      prompt (required: a string, or an array of exactly one string; token
//                         id arrays are refused), echo (bool), logprobs (null only).
//   /v1/chat/completions: messages (required, non-empty: {role: system | user | assistant,
//                         content: string or array of {type: "text", text: string}, name:
//                         ignored}), max_completion_tokens (OpenAI's newer name for
//                         max_tokens), logprobs (false only), top_logprobs (null only).
#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/finetune_data.h"
#include "infer/sampling.h"

namespace moe {

inline constexpr size_t kMaxStopStrings = 4;  // as OpenAI
// Stop strings are matched against every generated token (infer/text_stream.h); the cap keeps
// that cheap whatever a client sends.
inline constexpr size_t kMaxStopBytes = 256;
// Request bodies are a few levels deep; a cap keeps hostile nesting from costing anything.
inline constexpr int kMaxJsonDepth = 32;

// OpenAI's error object. `param` and `code` are null in the JSON when empty.
struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string param;  // the offending field, e.g. "temperature" or "messages[1].content"
  std::string code;   // e.g. "model_not_found", "context_length_exceeded"
};

class ApiException : public std::exception {
 public:
  explicit ApiException(ApiError error) : error_(std::move(error)) {}
  const ApiError& error() const noexcept { return error_; }
  const char* what() const noexcept override { return error_.message.c_str(); }

 private:
  ApiError error_;
};

// {"error": {"message", "type", "param", "code"}}, serialised.
std::string error_body(const ApiError& error);

struct ApiLimits {
  std::string model_id;            // the one model served: "model" must name it or be absent
  int64_t context_length = 0;      // prompt + completion tokens
  int64_t max_tokens_default = 0;  // completion tokens when the request sets no max_tokens
  int64_t max_body_bytes = 0;      // larger bodies get 413
  // What a request that leaves a sampling field out gets (the server's command line);
  // OpenAI's own default temperature is 1.
  SamplingOptions sampling_defaults = [] {
    SamplingOptions s;
    s.temperature = 1.0;
    return s;
  }();
};

struct GenerationParams {
  bool chat = false;
  std::string prompt;                                                 // completions
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // chat: [{role, content}]
  int64_t max_tokens = 0;          // the request's, else ApiLimits::max_tokens_default
  bool max_tokens_requested = false;  // false: max_tokens is the default (see completion_budget)
  bool stream = false;
  bool include_usage = false;      // stream_options.include_usage
  SamplingOptions sampling;        // ApiLimits::sampling_defaults where the request is silent
  std::optional<uint64_t> seed;    // a negative seed is kept as its two's complement bits
  std::vector<std::string> stop;   // non-empty valid UTF-8, as infer/text_stream.h requires
  bool echo = false;               // completions: prepend the prompt to the text
};

GenerationParams parse_completion_request(std::string_view body, const ApiLimits& limits);
GenerationParams parse_chat_request(std::string_view body, const ApiLimits& limits);

// A validated chat request's messages as the chat template takes them.
std::vector<ChatMessage> chat_messages(const GenerationParams& params);

// OpenAI's context-length rule: the prompt alone must leave room for a token, and prompt +
// max_tokens must fit in context_length; else 400 with code "context_length_exceeded" and the
// numbers in the message.
void check_token_budget(int64_t prompt_tokens, int64_t max_tokens, const ApiLimits& limits);

// The completion tokens to generate once the prompt is tokenised: the requested max_tokens
// after check_token_budget, or the default cut to the room the prompt leaves (a default is not
// the client's fault, so it never makes a request fail).
int64_t completion_budget(const GenerationParams& params, int64_t prompt_tokens, const ApiLimits& limits);

// ---------------------------------------------------------------- responses

// A response's finish_reason (the engine's own reasons map onto these two).
enum class ApiFinish { stop, length };
const char* finish_reason_name(ApiFinish reason);

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};

// What every response and stream chunk of one request repeats.
struct ResponseInfo {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // Unix seconds
  std::string model;
};

// Complete (non-streamed) responses: "text_completion" and "chat.completion".
nlohmann::ordered_json completion_response(const ResponseInfo& info, std::string_view text,
                                           ApiFinish finish, const Usage& usage);
nlohmann::ordered_json chat_response(const ResponseInfo& info, std::string_view content,
                                     ApiFinish finish, const Usage& usage);

// Stream chunks. A completion stream is text chunks with finish_reason null, then one with ""
// and the finish reason. A chat stream is chat_role_chunk, content chunks, then
// chat_finish_chunk (empty delta). With include_usage every chunk carries "usage": null and
// usage_chunk (no choices, the totals) comes last, as OpenAI's streams do; then kSseDone.
nlohmann::ordered_json completion_chunk(const ResponseInfo& info, std::string_view text,
                                        std::optional<ApiFinish> finish, bool include_usage);
nlohmann::ordered_json chat_role_chunk(const ResponseInfo& info, bool include_usage);
nlohmann::ordered_json chat_content_chunk(const ResponseInfo& info, std::string_view content,
                                          bool include_usage);
nlohmann::ordered_json chat_finish_chunk(const ResponseInfo& info, ApiFinish finish,
                                         bool include_usage);
nlohmann::ordered_json usage_chunk(const ResponseInfo& info, bool chat, const Usage& usage);

// GET /v1/models/{id} and GET /v1/models.
nlohmann::ordered_json model_object(const std::string& model_id, int64_t created);
nlohmann::ordered_json models_response(const std::string& model_id, int64_t created);

// Serialises compactly. Generated text may hold invalid UTF-8 (a model can emit any bytes):
// such bytes become U+FFFD instead of throwing, as nlohmann::json's dump() otherwise does.
std::string dump_json(const nlohmann::ordered_json& json);
// One server-sent event: "data: <json>\n\n" (the JSON has no raw newlines to break it).
std::string sse_event(const nlohmann::ordered_json& json);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

}  // namespace moe
