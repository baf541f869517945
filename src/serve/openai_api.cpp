#include "serve/openai_api.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace moe {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// Request text quoted back in an error message (a model name, an unknown field) is cut to this
// many bytes, so an error never echoes a megabyte.
constexpr size_t kMaxQuotedBytes = 64;

[[noreturn]] void reject(int status, std::string param, std::string message, std::string code = "") {
  throw ApiException(ApiError{status, "invalid_request_error", std::move(message), std::move(param),
                              std::move(code)});
}

[[noreturn]] void bad_request(std::string param, std::string message) {
  reject(400, std::move(param), std::move(message));
}

// At most kMaxQuotedBytes of `s`, cut on a character boundary (parsed JSON strings are valid
// UTF-8, so backing up over continuation bytes finds one).
std::string truncated(std::string_view s) {
  if (s.size() <= kMaxQuotedBytes) return std::string(s);
  size_t n = kMaxQuotedBytes;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return std::string(s.substr(0, n)) + "...";
}

const char* json_type(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

[[noreturn]] void wrong_type(const std::string& param, std::string_view expected, const json& got) {
  bad_request(param, fmt::format("Invalid type for '{}': expected {}, but got {} instead.", param,
                                 expected, json_type(got)));
}

// The field's value, or nullptr when it is absent or null.
const json* field(const json& object, const char* name) {
  const auto it = object.find(name);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

std::optional<bool> get_bool(const json& object, const char* name) {
  const json* v = field(object, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(name, "a boolean", *v);
  return v->get<bool>();
}

std::optional<std::string> get_string(const json& object, const char* name) {
  const json* v = field(object, name);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(name, "a string", *v);
  return v->get<std::string>();
}

// JSON integers only (1.0 is a number, not an integer, as in OpenAI's schema). Unsigned values
// above int64's range are refused by the range check, not wrapped.
std::optional<int64_t> get_integer(const json& object, const char* name, int64_t min, int64_t max) {
  const json* v = field(object, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type(name, "an integer", *v);
  // nlohmann stores every non-negative integer as unsigned, so both kinds need both bounds.
  bool in_range;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    in_range = u <= static_cast<uint64_t>(max) && (min <= 0 || u >= static_cast<uint64_t>(min));
  } else {
    in_range = v->get<int64_t>() >= min && v->get<int64_t>() <= max;
  }
  if (!in_range) {
    const std::string got = v->is_number_unsigned() ? std::to_string(v->get<uint64_t>())
                                                    : std::to_string(v->get<int64_t>());
    if (max == std::numeric_limits<int64_t>::max())
      bad_request(name, fmt::format("Invalid '{}': expected an integer >= {}, but got {}.", name, min, got));
    bad_request(name, fmt::format("Invalid '{}': expected an integer from {} to {}, but got {}.", name,
                                  min, max, got));
  }
  return v->get<int64_t>();
}

enum class Bound { inclusive, exclusive };

// A JSON number (integer or not) within [min, max] (or (min, max] with an exclusive minimum).
std::optional<double> get_number(const json& object, const char* name, double min, double max,
                                 Bound min_bound = Bound::inclusive) {
  const json* v = field(object, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(name, "a number", *v);
  const double x = v->get<double>();
  const bool above_min = min_bound == Bound::inclusive ? x >= min : x > min;
  if (!(above_min && x <= max)) {
    const char open = min_bound == Bound::inclusive ? '[' : '(';
    if (std::isinf(max))
      bad_request(name, fmt::format("Invalid '{}': expected a number {} {}, but got {}.", name,
                                    min_bound == Bound::inclusive ? ">=" : ">", min, x));
    bad_request(name, fmt::format("Invalid '{}': expected a number in {}{}, {}], but got {}.", name,
                                  open, min, max, x));
  }
  return x;
}

// nlohmann's parser is iterative, but a million nested arrays would still cost memory and a deep
// recursive destruction; nothing valid here is more than a few levels deep.
struct TooDeep {};

json parse_body(std::string_view body, const ApiLimits& limits) {
  MOE_CHECK(limits.max_body_bytes > 0, "the API's max_body_bytes must be positive, got {}",
            limits.max_body_bytes);
  if (body.size() > static_cast<uint64_t>(limits.max_body_bytes))
    reject(413, "", fmt::format("The request body is {} bytes; the limit is {} bytes.", body.size(),
                                limits.max_body_bytes));
  const json::parser_callback_t limit_depth = [](int depth, json::parse_event_t, json&) {
    if (depth >= kMaxJsonDepth) throw TooDeep{};
    return true;
  };
  json j;
  try {
    j = json::parse(body.begin(), body.end(), limit_depth);
  } catch (const TooDeep&) {
    bad_request("", fmt::format("The request body is nested more than {} levels deep.", kMaxJsonDepth));
  } catch (const json::parse_error& e) {
    // The byte offset, not e.what(): that quotes the request's bytes, unbounded and possibly
    // not UTF-8.
    bad_request("", fmt::format("The request body is not valid JSON (error at byte {}).", e.byte));
  } catch (const json::exception&) {
    bad_request("", "The request body holds a number too large to represent.");
  }
  if (!j.is_object())
    bad_request("", fmt::format("The request body must be a JSON object, not {}.", json_type(j)));
  return j;
}

void reject_unknown_fields(const json& object, std::initializer_list<std::string_view> known,
                           std::string_view prefix, std::string_view what) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    const std::string name = std::string(prefix) + truncated(key);
    bad_request(name, fmt::format("Unrecognized {} argument supplied: {}", what, name));
  }
}

void parse_model(const json& body, const ApiLimits& limits) {
  const std::optional<std::string> model = get_string(body, "model");
  if (model && *model != limits.model_id)
    reject(404, "model",
           fmt::format("The model '{}' does not exist; this server serves '{}'.", truncated(*model),
                       limits.model_id),
           "model_not_found");
}

std::vector<std::string> parse_stop(const json& body) {
  const json* v = field(body, "stop");
  if (!v) return {};
  auto one = [](const json& s, const std::string& param) {
    if (!s.is_string()) wrong_type(param, "a string", s);
    const std::string& text = s.get_ref<const std::string&>();
    if (text.empty()) bad_request(param, fmt::format("Invalid '{}': stop strings must not be empty.", param));
    if (text.size() > kMaxStopBytes)
      bad_request(param, fmt::format("Invalid '{}': a stop string is at most {} bytes, but got {}.", param,
                                     kMaxStopBytes, text.size()));
    return text;
  };
  if (v->is_string()) return {one(*v, "stop")};
  if (!v->is_array()) wrong_type("stop", "a string or an array of strings", *v);
  if (v->size() > kMaxStopStrings)
    bad_request("stop", fmt::format("Invalid 'stop': at most {} stop strings, but got {}.", kMaxStopStrings,
                                    v->size()));
  std::vector<std::string> stops;
  for (size_t i = 0; i < v->size(); ++i) stops.push_back(one((*v)[i], fmt::format("stop[{}]", i)));
  return stops;
}

// The fields both endpoints share.
void parse_common(const json& body, const ApiLimits& limits, GenerationParams& p) {
  parse_model(body, limits);
  if (const auto n = get_integer(body, "n", std::numeric_limits<int64_t>::min(),
                                 std::numeric_limits<int64_t>::max());
      n && *n != 1)
    bad_request("n", fmt::format("Invalid 'n': only n = 1 is supported, but got {}.", *n));

  p.sampling = limits.sampling_defaults;
  if (auto v = get_number(body, "temperature", 0, 2)) p.sampling.temperature = *v;
  if (auto v = get_number(body, "top_p", 0, 1, Bound::exclusive)) p.sampling.top_p = *v;
  if (auto v = get_integer(body, "top_k", -1, std::numeric_limits<int64_t>::max()))
    p.sampling.top_k = std::max<int64_t>(*v, 0);
  if (auto v = get_number(body, "min_p", 0, 1)) p.sampling.min_p = *v;
  const double inf = std::numeric_limits<double>::infinity();
  if (auto v = get_number(body, "repetition_penalty", 0, inf, Bound::exclusive))
    p.sampling.repetition_penalty = *v;
  if (auto v = get_number(body, "presence_penalty", -2, 2)) p.sampling.presence_penalty = *v;
  if (auto v = get_number(body, "frequency_penalty", -2, 2)) p.sampling.frequency_penalty = *v;

  if (const json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) wrong_type("seed", "an integer", *seed);
    p.seed = seed->is_number_unsigned() ? seed->get<uint64_t>()
                                        : static_cast<uint64_t>(seed->get<int64_t>());
  }
  p.stop = parse_stop(body);
  get_string(body, "user");  // accepted for compatibility, unused

  p.stream = get_bool(body, "stream").value_or(false);
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) wrong_type("stream_options", "an object", *options);
    if (!p.stream)
      bad_request("stream_options", "Invalid 'stream_options': only allowed when 'stream' is true.");
    reject_unknown_fields(*options, {"include_usage"}, "stream_options.", "stream_options");
    if (const json* usage = field(*options, "include_usage")) {
      if (!usage->is_boolean()) wrong_type("stream_options.include_usage", "a boolean", *usage);
      p.include_usage = usage->get<bool>();
    }
  }

  p.max_tokens = limits.max_tokens_default;
  if (auto v = get_integer(body, "max_tokens", 1, std::numeric_limits<int64_t>::max())) {
    p.max_tokens = *v;
    p.max_tokens_requested = true;
  }
}

std::string parse_prompt(const json& body) {
  const json* v = field(body, "prompt");
  if (!v) bad_request("prompt", "Missing required parameter: 'prompt'.");
  if (v->is_string()) return v->get<std::string>();
  if (!v->is_array()) wrong_type("prompt", "a string or an array of one string", *v);
  if (v->empty()) bad_request("prompt", "Invalid 'prompt': the array is empty.");
  const json& first = v->front();
  if (first.is_number_integer() || first.is_array())
    bad_request("prompt", "Invalid 'prompt': token id prompts are not supported; send the prompt as text.");
  if (!first.is_string()) wrong_type("prompt[0]", "a string", first);
  if (v->size() > 1)
    bad_request("prompt", fmt::format("Invalid 'prompt': only one prompt per request is supported, "
                                      "but got an array of {}.", v->size()));
  return first.get<std::string>();
}

std::string parse_content(const json& message, const std::string& param) {
  const json* content = field(message, "content");
  if (!content) bad_request(param, fmt::format("Missing required parameter: '{}'.", param));
  if (content->is_string()) return content->get<std::string>();
  if (!content->is_array()) wrong_type(param, "a string or an array of text parts", *content);
  std::string text;
  for (size_t i = 0; i < content->size(); ++i) {
    const json& part = (*content)[i];
    const std::string part_param = fmt::format("{}[{}]", param, i);
    if (!part.is_object()) wrong_type(part_param, "an object", part);
    reject_unknown_fields(part, {"type", "text"}, part_param + ".", "content part");
    const std::optional<std::string> type = get_string(part, "type");
    if (type != "text")
      bad_request(part_param + ".type",
                  fmt::format("Invalid '{}.type': only \"text\" content parts are supported, but got {}.",
                              part_param, type ? "\"" + truncated(*type) + "\"" : "none"));
    const json* piece = field(part, "text");
    if (!piece) bad_request(part_param + ".text", fmt::format("Missing required parameter: '{}.text'.", part_param));
    if (!piece->is_string()) wrong_type(part_param + ".text", "a string", *piece);
    text += piece->get_ref<const std::string&>();
  }
  return text;
}

ojson parse_messages(const json& body) {
  const json* v = field(body, "messages");
  if (!v) bad_request("messages", "Missing required parameter: 'messages'.");
  if (!v->is_array()) wrong_type("messages", "an array", *v);
  if (v->empty()) bad_request("messages", "Invalid 'messages': expected a non-empty array.");
  ojson messages = ojson::array();
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) wrong_type(param, "an object", m);
    reject_unknown_fields(m, {"role", "content", "name"}, param + ".", "message");
    const json* role = field(m, "role");
    if (!role) bad_request(param + ".role", fmt::format("Missing required parameter: '{}.role'.", param));
    if (!role->is_string()) wrong_type(param + ".role", "a string", *role);
    const std::string& r = role->get_ref<const std::string&>();
    if (r != "system" && r != "user" && r != "assistant")
      bad_request(param + ".role",
                  fmt::format("Invalid '{}.role': expected \"system\", \"user\" or \"assistant\", but got \"{}\".",
                              param, truncated(r)));
    if (const json* name = field(m, "name"); name && !name->is_string())
      wrong_type(param + ".name", "a string", *name);
    ojson message = ojson::object();
    message["role"] = r;
    message["content"] = parse_content(m, param + ".content");
    messages.push_back(std::move(message));
  }
  return messages;
}

ojson usage_object(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

ojson response_head(const ResponseInfo& info, const char* object) {
  return {{"id", info.id}, {"object", object}, {"created", info.created}, {"model", info.model}};
}

ojson chat_chunk(const ResponseInfo& info, ojson delta, const ojson& finish_reason, bool include_usage) {
  ojson chunk = response_head(info, "chat.completion.chunk");
  chunk["choices"] = ojson::array(
      {{{"index", 0}, {"delta", std::move(delta)}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}});
  if (include_usage) chunk["usage"] = nullptr;
  return chunk;
}

}  // namespace

std::string error_body(const ApiError& e) {
  const ojson body = {{"error",
                       {{"message", e.message},
                        {"type", e.type},
                        {"param", e.param.empty() ? ojson(nullptr) : ojson(e.param)},
                        {"code", e.code.empty() ? ojson(nullptr) : ojson(e.code)}}}};
  return dump_json(body);
}

GenerationParams parse_completion_request(std::string_view body_text, const ApiLimits& limits) {
  const json body = parse_body(body_text, limits);
  reject_unknown_fields(body,
                        {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream",
                         "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
                         "echo", "user", "logprobs", "top_k", "min_p", "repetition_penalty"},
                        "", "request");
  GenerationParams p;
  p.chat = false;
  parse_common(body, limits, p);
  p.prompt = parse_prompt(body);
  p.echo = get_bool(body, "echo").value_or(false);
  if (const json* logprobs = field(body, "logprobs"))
    bad_request("logprobs", fmt::format("Invalid 'logprobs': log probabilities are not supported, but got {}.",
                                        json_type(*logprobs)));
  return p;
}

GenerationParams parse_chat_request(std::string_view body_text, const ApiLimits& limits) {
  const json body = parse_body(body_text, limits);
  reject_unknown_fields(body,
                        {"model", "messages", "max_tokens", "max_completion_tokens", "temperature",
                         "top_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty",
                         "frequency_penalty", "user", "logprobs", "top_logprobs", "top_k", "min_p",
                         "repetition_penalty"},
                        "", "request");
  GenerationParams p;
  p.chat = true;
  parse_common(body, limits, p);
  if (auto v = get_integer(body, "max_completion_tokens", 1, std::numeric_limits<int64_t>::max())) {
    if (p.max_tokens_requested && p.max_tokens != *v)
      bad_request("max_completion_tokens",
                  "Invalid 'max_completion_tokens': 'max_tokens' is also set, to a different value; "
                  "set only one.");
    p.max_tokens = *v;
    p.max_tokens_requested = true;
  }
  p.messages = parse_messages(body);
  if (get_bool(body, "logprobs").value_or(false))
    bad_request("logprobs", "Invalid 'logprobs': log probabilities are not supported.");
  if (field(body, "top_logprobs"))
    bad_request("top_logprobs", "Invalid 'top_logprobs': log probabilities are not supported.");
  return p;
}

std::vector<ChatMessage> chat_messages(const GenerationParams& params) {
  std::vector<ChatMessage> messages;
  for (const auto& m : params.messages)
    messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  return messages;
}

void check_token_budget(int64_t prompt_tokens, int64_t max_tokens, const ApiLimits& limits) {
  MOE_CHECK(prompt_tokens >= 0 && max_tokens >= 0, "token counts must be >= 0, got {} and {}",
            prompt_tokens, max_tokens);
  const int64_t context = limits.context_length;
  if (prompt_tokens >= context)
    reject(400, "",
           fmt::format("This model's maximum context length is {} tokens, but the prompt is {} tokens, "
                       "which leaves no room for the completion. Please reduce the length of the prompt.",
                       context, prompt_tokens),
           "context_length_exceeded");
  if (max_tokens > context - prompt_tokens)
    reject(400, "max_tokens",
           fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                       "({} in the prompt, {} for the completion). Please reduce the length of the "
                       "prompt or the completion.",
                       context, static_cast<uint64_t>(prompt_tokens) + static_cast<uint64_t>(max_tokens),
                       prompt_tokens, max_tokens),
           "context_length_exceeded");
}

int64_t completion_budget(const GenerationParams& params, int64_t prompt_tokens, const ApiLimits& limits) {
  if (params.max_tokens_requested) {
    check_token_budget(prompt_tokens, params.max_tokens, limits);
    return params.max_tokens;
  }
  check_token_budget(prompt_tokens, 1, limits);
  return std::min(params.max_tokens, limits.context_length - prompt_tokens);
}

// ---------------------------------------------------------------- responses

const char* finish_reason_name(ApiFinish reason) {
  return reason == ApiFinish::stop ? "stop" : "length";
}

ojson completion_response(const ResponseInfo& info, std::string_view text, ApiFinish finish,
                          const Usage& usage) {
  ojson r = response_head(info, "text_completion");
  r["choices"] = ojson::array(
      {{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish_reason_name(finish)}}});
  r["usage"] = usage_object(usage);
  return r;
}

ojson chat_response(const ResponseInfo& info, std::string_view content, ApiFinish finish,
                    const Usage& usage) {
  ojson r = response_head(info, "chat.completion");
  r["choices"] = ojson::array({{{"index", 0},
                                {"message", {{"role", "assistant"}, {"content", content}}},
                                {"logprobs", nullptr},
                                {"finish_reason", finish_reason_name(finish)}}});
  r["usage"] = usage_object(usage);
  return r;
}

ojson completion_chunk(const ResponseInfo& info, std::string_view text, std::optional<ApiFinish> finish,
                       bool include_usage) {
  ojson chunk = response_head(info, "text_completion");
  chunk["choices"] = ojson::array({{{"index", 0},
                                    {"text", text},
                                    {"logprobs", nullptr},
                                    {"finish_reason", finish ? ojson(finish_reason_name(*finish)) : ojson(nullptr)}}});
  if (include_usage) chunk["usage"] = nullptr;
  return chunk;
}

ojson chat_role_chunk(const ResponseInfo& info, bool include_usage) {
  return chat_chunk(info, {{"role", "assistant"}, {"content", ""}}, nullptr, include_usage);
}

ojson chat_content_chunk(const ResponseInfo& info, std::string_view content, bool include_usage) {
  return chat_chunk(info, {{"content", content}}, nullptr, include_usage);
}

ojson chat_finish_chunk(const ResponseInfo& info, ApiFinish finish, bool include_usage) {
  return chat_chunk(info, ojson::object(), finish_reason_name(finish), include_usage);
}

ojson usage_chunk(const ResponseInfo& info, bool chat, const Usage& usage) {
  ojson chunk = response_head(info, chat ? "chat.completion.chunk" : "text_completion");
  chunk["choices"] = ojson::array();
  chunk["usage"] = usage_object(usage);
  return chunk;
}

ojson model_object(const std::string& model_id, int64_t created) {
  return {{"id", model_id}, {"object", "model"}, {"created", created}, {"owned_by", "moe"}};
}

ojson models_response(const std::string& model_id, int64_t created) {
  return {{"object", "list"}, {"data", ojson::array({model_object(model_id, created)})}};
}

std::string dump_json(const ojson& j) {
  return j.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

std::string sse_event(const ojson& j) {
  return "data: " + dump_json(j) + "\n\n";
}

}  // namespace moe
