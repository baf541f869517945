// `moe generate` (alias `moe sample`): continue prompts with a model, batched over the latent KV
// cache (infer/generation.h). Prompts come from --prompt (repeatable) or --prompts FILE ("-":
// stdin): a text file holds one prompt per line, a .jsonl file {"prompt": ...} or
// {"messages": [...]} objects. --chat renders each prompt as a user message with the model's chat
// template. One prompt streams to the terminal as it is generated; several print each reply as it
// finishes; --output writes them all as JSONL. Ends with prompt and generation tokens/s.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/inference_options.h"
#include "core/error.h"
#include "io/atomic_file.h"

namespace moe::cli {

namespace {

struct GenerateArgs {
  InferenceArgs inference;
  std::vector<std::string> prompts;
  std::string prompts_file;
  std::string output;
  bool chat = false;
  std::string system;
  int64_t max_tokens = 200;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  SamplingOptions sampling;
  bool quiet = false;
};

struct Prompt {
  std::string text;                   // completion mode
  std::vector<ChatMessage> messages;  // chat mode
};

std::vector<Prompt> read_prompts(const GenerateArgs& a) {
  std::vector<Prompt> out;
  for (const std::string& p : a.prompts) out.push_back({p, {}});
  if (a.prompts_file.empty()) return out;
  std::ifstream file;
  if (a.prompts_file != "-") {
    file.open(a.prompts_file);
    MOE_CHECK(file.good(), "--prompts {}: cannot open the file", a.prompts_file);
  }
  std::istream& in = a.prompts_file == "-" ? std::cin : file;
  const bool jsonl = a.prompts_file.ends_with(".jsonl");
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!jsonl) {
      if (!line.empty()) out.push_back({line, {}});
      continue;
    }
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("{}:{}: not JSON ({})", a.prompts_file, n, e.what());
    }
    MOE_CHECK(j.is_object() && (j.contains("prompt") != j.contains("messages")),
              "{}:{}: expected an object with \"prompt\" (a string) or \"messages\" (a list)",
              a.prompts_file, n);
    Prompt p;
    if (j.contains("prompt")) {
      MOE_CHECK(j["prompt"].is_string(), "{}:{}: \"prompt\" must be a string", a.prompts_file, n);
      p.text = j["prompt"].get<std::string>();
    } else {
      // The fine-tuning data's chat format, without its need for an assistant reply.
      p.messages = parse_chat_messages(j, fmt::format("{}:{}", a.prompts_file, n),
                                       /*need_assistant=*/false);
    }
    out.push_back(std::move(p));
  }
  return out;
}

struct Result {
  std::string text;
  std::string finish_reason;
  int64_t prompt_tokens = 0, completion_tokens = 0;
  bool done = false;
};

void run_generate(const GenerateArgs& a) {
  a.sampling.validate("sampling options");
  std::vector<Prompt> prompts = read_prompts(a);
  if (prompts.empty()) prompts.push_back({"", {}});  // an empty prompt starts a new document
  // Every prompt is queued up front, so the queue holds them all.
  InferenceArgs inference = a.inference;
  inference.engine.max_queued = std::max<int64_t>(inference.engine.max_queued,
                                                  static_cast<int64_t>(prompts.size()));
  std::optional<InferenceSession> session = open_inference(inference);
  if (!session) return;  // an expert-parallel rank other than 0: its experts were served
  const InferenceModel& m = session->model;
  GenerationEngine& engine = *session->engine;

  const bool stream = prompts.size() == 1 && a.output.empty();
  std::vector<Result> results(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    Prompt& p = prompts[i];
    if (a.chat && p.messages.empty()) {
      if (!a.system.empty()) p.messages.push_back({"system", a.system});
      p.messages.push_back({"user", p.text});
    }
    r.prompt = p.messages.empty() ? encode_completion_prompt(*m.tokenizer, p.text)
                                  : encode_chat_prompt(m, p.messages);
    r.max_tokens = a.max_tokens;
    r.sampling = a.sampling;
    r.seed = a.seed + i;
    r.stop = a.stop;
    r.stop_ids = stop_ids(m);
    Result& out = results[i];
    if (stream && p.messages.empty()) {
      fmt::print("{}", p.text);
      std::fflush(stdout);
    }
    const int64_t id = engine.submit(std::move(r), [&out, stream, i, &a](const GenerationUpdate& u) {
      out.text += u.text;
      if (stream) {
        std::fwrite(u.text.data(), 1, u.text.size(), stdout);
        std::fflush(stdout);
      }
      if (!u.finished) return;
      out.done = true;
      out.finish_reason = finish_reason_name(u.reason);
      out.prompt_tokens = u.prompt_tokens;
      out.completion_tokens = u.completion_tokens;
      if (!stream && a.output.empty())
        fmt::print("[{}] {}\n\n", i + 1, out.text);
    });
    MOE_CHECK(id >= 0, "internal: the engine refused prompt {} (queue full)", i + 1);
  }
  engine.run_until_idle();
  engine.shutdown();
  if (stream) {
    fmt::print("\n");
    std::fflush(stdout);  // before the tokens/s line on stderr
  }

  if (!a.output.empty()) {
    std::string jsonl;
    for (size_t i = 0; i < prompts.size(); ++i) {
      nlohmann::ordered_json j;
      if (prompts[i].messages.empty()) j["prompt"] = prompts[i].text;
      else {
        j["messages"] = nlohmann::ordered_json::array();
        for (const ChatMessage& msg : prompts[i].messages)
          j["messages"].push_back({{"role", msg.role}, {"content", msg.content}});
      }
      j["text"] = results[i].text;
      j["finish_reason"] = results[i].finish_reason;
      j["prompt_tokens"] = results[i].prompt_tokens;
      j["completion_tokens"] = results[i].completion_tokens;
      jsonl += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    }
    write_file_atomic(a.output, jsonl);
  }
  if (!a.quiet) {
    const EngineStats s = engine.stats();
    auto rate = [](int64_t n, double sec) { return sec > 0 ? static_cast<double>(n) / sec : 0.0; };
    fmt::print(stderr,
               "generate: {} prompt{}, prompt {} tokens at {:.1f} tokens/s, generation {} tokens "
               "at {:.1f} tokens/s, {} forwards{}{}\n",
               prompts.size(), prompts.size() == 1 ? "" : "s", s.prompt_tokens,
               rate(s.prompt_tokens, s.prompt_seconds), s.generated_tokens,
               rate(s.generated_tokens, s.generate_seconds), s.steps,
               session->ep_size > 1 ? fmt::format(" (EP {})", session->ep_size) : "",
               a.inference.expert_activations == ExpertActivations::Int8
                   ? ", int8 expert activations" : "");
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "continue prompts with a model (KV-cached, batched)");
  cmd->alias("sample");
  auto a = std::make_shared<GenerateArgs>();
  add_inference_options(cmd, a->inference);
  cmd->add_option("--prompt", a->prompts, "a prompt (repeatable; empty: start a new document)")
      ->allow_extra_args(false);
  cmd->add_option("--prompts", a->prompts_file,
                  "file of prompts, \"-\" for stdin: one per line, or a .jsonl file with "
                  "{\"prompt\": ...} or {\"messages\": [...]} per line");
  cmd->add_flag("--chat", a->chat,
                "render each prompt as a user message with the model's chat template");
  cmd->add_option("--system", a->system, "system message for --chat");
  cmd->add_option("--max-tokens", a->max_tokens, "most tokens to generate per prompt")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--seed", a->seed, "sampling seed (prompt i uses seed + i)")
      ->capture_default_str();
  cmd->add_option("--stop", a->stop, "stop string (repeatable): generation ends before it")
      ->allow_extra_args(false);
  cmd->add_option("--output", a->output, "write every reply as JSONL here (atomically)");
  cmd->add_flag("--quiet", a->quiet, "no tokens/s line at the end");
  add_sampling_options(cmd, a->sampling);
  cmd->callback([a] { run_generate(*a); });
}

}  // namespace moe::cli
