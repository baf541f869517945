#include "serve/http_server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <thread>

#include "core/error.h"
#include "core/memory.h"
#include "core/rng.h"
#include "serve/openai_api.h"

namespace moe {

namespace {

using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// How often a connection thread that waits for the engine looks up from its channel: to notice
// a client that went away while its request produced nothing (queued, or a long prefill), and
// a server that is going down.
constexpr std::chrono::milliseconds kPoll{100};

// What one request's log line reports. Set on the connection thread that serves the request:
// httplib calls the handler, the stream's content provider and the logger on that one thread.
struct RequestLog {
  std::optional<Clock::time_point> start;
  int64_t prompt_tokens = -1;
  int64_t completion_tokens = -1;
  std::string note;
};
thread_local RequestLog t_log;

// The updates of one request, from the engine thread to the connection thread. The engine's
// sink and the connection thread each hold it by shared_ptr, so a client that went away
// leaves it to the sink, which drops it after the request's final update. Text accumulates
// (the engine never waits for a client): a slow reader gets bigger events, not a slower
// engine.
class Channel {
 public:
  struct News {
    std::string text;
    bool finished = false;
    FinishReason reason = FinishReason::Stop;
    int64_t prompt_tokens = 0, completion_tokens = 0;
  };

  void push(const GenerationUpdate& u) {
    {
      std::lock_guard lock(mutex_);
      pending_.text += u.text;
      pending_.prompt_tokens = u.prompt_tokens;
      pending_.completion_tokens = u.completion_tokens;
      if (u.finished) {
        pending_.finished = true;
        pending_.reason = u.reason;
      }
    }
    ready_.notify_all();
  }

  // What arrived since the last call, waiting up to `timeout` for something.
  News take(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    ready_.wait_for(lock, timeout, [&] { return !pending_.text.empty() || pending_.finished; });
    News out = pending_;
    pending_.text.clear();
    return out;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  News pending_;
};

int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return -1;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

ApiError api_error(int status, std::string message, std::string code = "") {
  ApiError e;
  e.status = status;
  e.type = status >= 500 ? "server_error" : "invalid_request_error";
  e.message = std::move(message);
  e.code = std::move(code);
  return e;
}

void reply_error(httplib::Response& res, const ApiError& error) {
  res.status = error.status;
  res.set_content(error_body(error), "application/json");
}

void reply_json(httplib::Response& res, const ojson& body) {
  res.set_content(dump_json(body), "application/json");
}

ApiFinish api_finish(FinishReason reason) {
  return reason == FinishReason::Length ? ApiFinish::length : ApiFinish::stop;
}

// A route and the one method it answers; any other method gets 405.
struct Route {
  const char* pattern;
  const char* method;
};
constexpr Route kRoutes[] = {
    {"/health", "GET"},
    {"/v1/models", "GET"},
    {R"(/v1/models/([^/]+))", "GET"},
    {"/v1/completions", "POST"},
    {"/v1/chat/completions", "POST"},
};

class Server {
 public:
  Server(GenerationEngine& engine, const InferenceModel& model, const ServeOptions& options)
      : engine_(engine),
        model_(model),
        options_(options),
        stop_ids_(stop_ids(model)),
        created_(static_cast<int64_t>(std::time(nullptr))),
        seed_base_(std::random_device{}()) {
    limits_.model_id = model.name;
    limits_.context_length = engine.options().context;
    limits_.max_tokens_default = options.max_tokens_default;
    limits_.max_body_bytes = options.max_body_bytes;
    limits_.sampling_defaults = options.sampling;
    for (const Route& r : kRoutes) routes_.emplace_back(std::regex(r.pattern), r.method);
    install();
  }

  int run(const std::function<bool()>& stop_requested);

 private:
  // One generation request counted from admission until its response is written; while any
  // is, a shutdown waits.
  class Ticket {
   public:
    explicit Ticket(Server& s) : s_(s) {}
    ~Ticket() { --s_.in_flight_; }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

   private:
    Server& s_;
  };

  // A streamed request, owned by the response's content provider and releaser.
  struct Stream {
    std::unique_ptr<Ticket> ticket;
    std::shared_ptr<Channel> channel;
    int64_t id = 0;
    ResponseInfo info;
    bool chat = false;
    bool include_usage = false;
    std::string echo;  // completions with "echo": the prompt, sent first
    bool finished = false;
    bool cancelled = false;
  };

  void install();
  std::unique_ptr<Ticket> admit();
  uint64_t next_seed() { return splitmix64(seed_base_ + seed_counter_.fetch_add(1)); }

  void health(const httplib::Request& req, httplib::Response& res);
  void models(const httplib::Request& req, httplib::Response& res);
  void generate(const httplib::Request& req, httplib::Response& res, bool chat);
  // Writes a stream's events as the engine produces them; false when the client went away.
  bool pump(Stream& s, httplib::DataSink& sink);
  void unrouted(const httplib::Request& req, httplib::Response& res);
  void log(const httplib::Request& req, const httplib::Response& res);

  GenerationEngine& engine_;
  const InferenceModel& model_;
  ServeOptions options_;
  ApiLimits limits_;
  std::vector<int32_t> stop_ids_;
  int64_t created_;
  uint64_t seed_base_;
  std::atomic<uint64_t> seed_counter_{0};
  std::vector<std::pair<std::regex, std::string>> routes_;

  std::atomic<bool> draining_{false};   // SIGTERM seen: no new generation requests
  std::atomic<bool> engine_down_{false};  // the engine loop ended: nobody will answer
  std::atomic<int64_t> in_flight_{0};
  // Requests the engine finished, by reason (FinishReason's order).
  std::array<std::atomic<int64_t>, 3> finished_{};
  std::mutex log_mutex_;

  httplib::Server http_;
};

std::unique_ptr<Server::Ticket> Server::admit() {
  // Counted before draining_ is read, and the shutdown sets draining_ before it reads the
  // count (both sequentially consistent): either this request sees the shutdown or the
  // shutdown sees this request.
  ++in_flight_;
  auto ticket = std::make_unique<Ticket>(*this);
  if (draining_) throw ApiException(api_error(503, "The server is shutting down.", "shutting_down"));
  return ticket;
}

void Server::health(const httplib::Request&, httplib::Response& res) {
  const MemSnapshot mem = MemoryTracker::instance().snapshot();
  ojson tracked = ojson::object();
  for (int c = 0; c < static_cast<int>(MemCategory::Count); ++c)
    tracked[mem_category_name(static_cast<MemCategory>(c))] = mem.current[c];
  const EngineStats stats = engine_.stats();
  ojson body = {
      {"status", draining_ ? "shutting_down" : "ok"},
      {"model", model_.name},
      {"active", engine_.active()},
      {"queued", engine_.queued()},
      {"in_flight", in_flight_.load()},
      {"slots", engine_.options().max_sequences},
      {"context", engine_.options().context},
      {"requests",
       {{"stop", finished_[0].load()}, {"length", finished_[1].load()}, {"cancelled", finished_[2].load()}}},
      {"tokens", {{"prompt", stats.prompt_tokens}, {"generated", stats.generated_tokens}}},
      {"memory",
       {{"tracked", tracked}, {"tracked_total", mem.total_current()}, {"rss_bytes", resident_bytes()}}},
  };
  reply_json(res, body);
}

void Server::models(const httplib::Request& req, httplib::Response& res) {
  if (req.matches.size() < 2) return reply_json(res, models_response(model_.name, created_));
  const std::string id = req.matches[1].str();
  if (id != model_.name) {
    ApiError e = api_error(404, fmt::format("The model '{}' does not exist.", id.substr(0, 64)),
                              "model_not_found");
    e.param = "model";
    return reply_error(res, e);
  }
  reply_json(res, model_object(model_.name, created_));
}

void Server::generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  const GenerationParams p =
      chat ? parse_chat_request(req.body, limits_) : parse_completion_request(req.body, limits_);
  std::unique_ptr<Ticket> ticket = admit();

  std::vector<int32_t> prompt;
  try {
    if (chat) {
      prompt = encode_chat_prompt(model_, chat_messages(p));
    } else {
      prompt = encode_completion_prompt(*model_.tokenizer, p.prompt);
    }
  } catch (const Error& e) {
    // The chat template's raise_exception (e.g. roles that do not alternate) is the client's.
    ApiError error = api_error(400, e.what());
    error.param = chat ? "messages" : "prompt";
    throw ApiException(error);
  }
  const int64_t prompt_tokens = static_cast<int64_t>(prompt.size());
  t_log.prompt_tokens = prompt_tokens;

  GenerationRequest g;
  g.max_tokens = completion_budget(p, prompt_tokens, limits_);
  g.prompt = std::move(prompt);
  g.sampling = p.sampling;
  g.seed = p.seed ? *p.seed : next_seed();
  g.stop = p.stop;
  g.stop_ids = stop_ids_;

  auto channel = std::make_shared<Channel>();
  int64_t id = -1;
  try {
    id = engine_.submit(std::move(g), [this, channel](const GenerationUpdate& u) {
      if (u.finished) ++finished_[static_cast<int>(u.reason)];
      channel->push(u);
    });
  } catch (const Error& e) {
    throw ApiException(api_error(400, e.what()));
  }
  if (id < 0) {
    res.set_header("Retry-After", "1");
    throw ApiException(api_error(
        503, fmt::format("The server is busy: {} requests are waiting already. Retry later.",
                         engine_.options().max_queued),
        "queue_full"));
  }
  // From here every way out of this handler cancels the request, until a stream takes it over.
  struct CancelGuard {
    GenerationEngine& engine;
    int64_t id;
    bool armed = true;
    ~CancelGuard() {
      if (armed) engine.cancel(id);
    }
  } guard{engine_, id};

  const char* prefix = chat ? "chatcmpl-" : "cmpl-";
  ResponseInfo info{fmt::format("{}{:016x}", prefix, splitmix64(seed_base_ ^ static_cast<uint64_t>(id))),
                    static_cast<int64_t>(std::time(nullptr)), model_.name};
  const std::string echo = !chat && p.echo ? p.prompt : "";

  if (p.stream) {
    auto s = std::make_shared<Stream>();
    s->ticket = std::move(ticket);
    s->channel = channel;
    s->id = id;
    s->info = std::move(info);
    s->chat = chat;
    s->include_usage = p.include_usage;
    s->echo = echo;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream", [this, s](size_t, httplib::DataSink& sink) { return pump(*s, sink); },
        // Also when the provider never ran (the headers could not be written).
        [this, s](bool) {
          if (!s->finished && !s->cancelled) engine_.cancel(s->id);
        });
    guard.armed = false;
    return;
  }

  std::string text = echo;
  Channel::News news;
  for (;;) {
    news = channel->take(kPoll);
    text += news.text;
    if (news.finished) break;
    if (engine_down_) throw ApiException(api_error(503, "The server is shutting down.", "shutting_down"));
  }
  guard.armed = false;
  t_log.completion_tokens = news.completion_tokens;
  t_log.note = finish_reason_name(news.reason);
  if (news.reason == FinishReason::Cancelled)
    throw ApiException(api_error(500, "The request was cancelled."));
  const Usage usage{news.prompt_tokens, news.completion_tokens};
  reply_json(res, chat ? chat_response(info, text, api_finish(news.reason), usage)
                       : completion_response(info, text, api_finish(news.reason), usage));
}

bool Server::pump(Stream& s, httplib::DataSink& sink) {
  auto send = [&](const std::string& event) { return sink.write(event.data(), event.size()); };
  auto abandon = [&] {
    // The client went away: its slot is worth more to the others than its text.
    engine_.cancel(s.id);
    s.cancelled = true;
    t_log.note = "cancelled (client gone)";
    return false;
  };
  if (s.chat && !send(sse_event(chat_role_chunk(s.info, s.include_usage)))) return abandon();
  if (!s.echo.empty() && !send(sse_event(completion_chunk(s.info, s.echo, std::nullopt, s.include_usage))))
    return abandon();
  for (;;) {
    const Channel::News news = s.channel->take(kPoll);
    t_log.completion_tokens = news.completion_tokens;
    if (!news.text.empty()) {
      const ojson chunk = s.chat ? chat_content_chunk(s.info, news.text, s.include_usage)
                                 : completion_chunk(s.info, news.text, std::nullopt, s.include_usage);
      if (!send(sse_event(chunk))) return abandon();
    } else if (!news.finished && !sink.is_writable()) {
      return abandon();
    }
    if (news.finished) {
      s.finished = true;
      t_log.note = finish_reason_name(news.reason);
      // Cancelled only by someone else (the server going down): the stream ends unfinished.
      if (news.reason == FinishReason::Cancelled) return false;
      const ApiFinish finish = api_finish(news.reason);
      std::string tail = sse_event(s.chat ? chat_finish_chunk(s.info, finish, s.include_usage)
                                          : completion_chunk(s.info, "", finish, s.include_usage));
      if (s.include_usage)
        tail += sse_event(usage_chunk(s.info, s.chat, {news.prompt_tokens, news.completion_tokens}));
      tail += kSseDone;
      if (!send(tail)) return false;
      sink.done();
      return true;
    }
    if (engine_down_) return abandon();
  }
}

void Server::unrouted(const httplib::Request& req, httplib::Response& res) {
  std::string allowed;
  for (const auto& [pattern, method] : routes_)
    if (std::regex_match(req.path, pattern)) allowed = method;
  if (allowed.empty()) {
    return reply_error(res, api_error(404, fmt::format("Unknown path {} {}.", req.method,
                                                          req.path.substr(0, 128))));
  }
  res.set_header("Allow", allowed);
  reply_error(res, api_error(405, fmt::format("Method {} is not allowed on {}; use {}.",
                                              req.method.substr(0, 16), req.path.substr(0, 128),
                                              allowed)));
}

void Server::log(const httplib::Request& req, const httplib::Response& res) {
  std::string line = fmt::format("{} {} {}", req.method, req.path.substr(0, 128), res.status);
  if (t_log.prompt_tokens >= 0) line += fmt::format(" prompt {}", t_log.prompt_tokens);
  if (t_log.completion_tokens >= 0) line += fmt::format(" completion {}", t_log.completion_tokens);
  if (!t_log.note.empty()) line += " " + t_log.note;
  if (t_log.start)
    line += fmt::format(" {:.1f} ms",
                        std::chrono::duration<double, std::milli>(Clock::now() - *t_log.start).count());
  t_log = {};
  std::lock_guard lock(log_mutex_);
  fmt::print(stderr, "{}\n", line);
}

void Server::install() {
  // Every generation request holds a connection thread while it waits or runs: with fewer
  // threads than slots + queue, clients beyond the threads would wait unseen in the listener
  // instead of getting their 503. A few more for /health and quick refusals.
  const EngineOptions& e = engine_.options();
  const int threads = options_.http_threads > 0
                          ? options_.http_threads
                          : static_cast<int>(e.max_sequences + e.max_queued + 4);
  http_.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http_.set_payload_max_length(static_cast<size_t>(options_.max_body_bytes));
  // An idle keep-alive connection or a client that trickles its request holds a thread: let go
  // of them quickly.
  http_.set_keep_alive_timeout(2);
  http_.set_read_timeout(10, 0);

  auto wrap = [this](auto handler) {
    return [this, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        handler(req, res);
      } catch (const ApiException& e) {
        reply_error(res, e.error());
      } catch (const std::exception& e) {
        reply_error(res, api_error(500, fmt::format("Internal error: {}", e.what())));
      }
    };
  };
  http_.Get("/health", wrap([this](const auto& req, auto& res) { health(req, res); }));
  http_.Get("/v1/models", wrap([this](const auto& req, auto& res) { models(req, res); }));
  http_.Get(R"(/v1/models/([^/]+))", wrap([this](const auto& req, auto& res) { models(req, res); }));
  http_.Post("/v1/completions",
             wrap([this](const auto& req, auto& res) { generate(req, res, false); }));
  http_.Post("/v1/chat/completions",
             wrap([this](const auto& req, auto& res) { generate(req, res, true); }));
  // Everything else, registered last so it only sees what the routes above did not take.
  // (Not a pre-routing handler: a POST's body must be read before answering, or the next
  // request on the connection would start inside it.)
  const auto other = wrap([this](const auto& req, auto& res) { unrouted(req, res); });
  http_.Get(".*", other);
  http_.Post(".*", other);
  http_.Put(".*", other);
  http_.Patch(".*", other);
  http_.Delete(".*", other);
  http_.Options(".*", other);

  http_.set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
    t_log = {};
    t_log.start = Clock::now();
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // httplib's own refusals (413 body too large, 400 unparsable request, ...) have no body yet.
  http_.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string message = fmt::format("HTTP error {}.", res.status);
    if (res.status == 400) message = "The request could not be parsed as HTTP.";
    if (res.status == 413)
      message = fmt::format("The request body exceeds {} bytes.", options_.max_body_bytes);
    if (res.status == 414) message = "The request URI is too long.";
    reply_error(res, api_error(res.status, message));
    return httplib::Server::HandlerResponse::Handled;
  }));
  http_.set_logger([this](const httplib::Request& req, const httplib::Response& res) { log(req, res); });
}

int Server::run(const std::function<bool()>& stop_requested) {
  int port = options_.port;
  if (port == 0) {
    port = http_.bind_to_any_port(options_.host);
  } else if (!http_.bind_to_port(options_.host, port)) {
    port = -1;
  }
  MOE_CHECK(port > 0, "cannot listen on {}:{} (address in use, or not an address of this machine)",
            options_.host, options_.port);
  std::atomic<bool> listener_failed{false};
  std::thread listener([&] {
    if (!http_.listen_after_bind()) listener_failed = true;
  });
  // stop() does nothing until the listener runs: a signal right at startup must not end the
  // loop before there is something to stop.
  while (!http_.is_running() && !listener_failed) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // However the engine loop ends (a failing forward included), waiting connection threads give
  // up and the listener is stopped and joined before anything it uses goes away.
  struct Stopper {
    Server& s;
    std::thread& listener;
    ~Stopper() {
      s.engine_down_ = true;
      s.http_.stop();
      listener.join();
    }
  } stopper{*this, listener};

  fmt::print("moe serve: {} listening on http://{}:{} (pid {}, {} slots, context {})\n", model_.name,
             options_.host, port, getpid(), engine_.options().max_sequences, engine_.options().context);
  std::fflush(stdout);

  for (;;) {
    if (!draining_ && stop_requested()) {
      draining_ = true;
      fmt::print(stderr, "moe serve: shutting down once the {} requests in flight finish\n",
                 in_flight_.load());
    }
    if (draining_ && in_flight_ == 0 && engine_.idle()) break;
    MOE_CHECK(!listener_failed, "the HTTP listener on {}:{} stopped unexpectedly", options_.host, port);
    if (!engine_.step()) engine_.wait_for_work(std::chrono::milliseconds(50));
  }
  return 0;
}

}  // namespace

int run_server(GenerationEngine& engine, const InferenceModel& model, const ServeOptions& options,
               const std::function<bool()>& stop_requested) {
  int status = 0;
  {
    Server server(engine, model, options);
    status = server.run(stop_requested);
  }
  // The listener is down: release the expert-parallel ranks.
  engine.shutdown();
  fmt::print(stderr, "moe serve: stopped\n");
  return status;
}

}  // namespace moe
