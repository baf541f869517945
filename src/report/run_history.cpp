#include "report/run_history.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moe {

namespace {

using json = nlohmann::json;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// NaN and Inf reach the file as null (JSON has no spelling for them).
double number_or_nan(const json& rec, const char* key) {
  const auto it = rec.find(key);
  return it != rec.end() && it->is_number() ? it->get<double>() : kNaN;
}

struct LineReader {
  const std::filesystem::path& file;
  int64_t line_no;

  [[noreturn]] void bad(const std::string& what) const {
    fail("{}:{}: {}", file.string(), line_no, what);
  }
  const json& field(const json& rec, const char* key, json::value_t type) const {
    const auto it = rec.find(key);
    if (it == rec.end()) bad(fmt::format("missing field '{}'", key));
    const bool ok = type == json::value_t::number_float ? (it->is_number() || it->is_null())
                                                        : it->type() == type ||
                                                              (type == json::value_t::number_integer &&
                                                               it->is_number_unsigned());
    if (!ok) bad(fmt::format("field '{}': expected {}, got {}", key,
                             type == json::value_t::number_float ? "a number" : json(type).type_name(),
                             it->dump()));
    return *it;
  }
};

std::vector<int64_t> expert_counts(const LineReader& r, const json& layer) {
  const json& counts = r.field(layer, "counts", json::value_t::array);
  std::vector<int64_t> out;
  for (const json& c : counts) {
    if (!c.is_number_integer() || c.get<int64_t>() < 0)
      r.bad("field 'expert_load[].counts': expected non-negative integers, got " + c.dump());
    out.push_back(c.get<int64_t>());
  }
  return out;
}

}  // namespace

RunHistory read_run_history(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  MOE_CHECK(in.good(), "{}: cannot read the metrics file (is this a `moe train` run directory?)",
            file.string());
  RunHistory h;
  h.source = file;
  h.unigram_entropy = kNaN;
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(std::move(line));
  // Per-step expert counts, kept until the window is known.
  std::vector<std::vector<std::vector<int64_t>>> counts_by_step;
  for (size_t i = 0; i < lines.size(); ++i) {
    const LineReader r{file, static_cast<int64_t>(i + 1)};
    const json rec = json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    if (rec.is_discarded()) {
      if (i + 1 == lines.size() && !h.steps.empty()) break;  // torn last line
      r.bad("not valid JSON");
    }
    if (!rec.is_object()) r.bad("expected a JSON object per line, got " + std::string(rec.type_name()));
    StepMetrics s;
    s.step = r.field(rec, "step", json::value_t::number_integer).get<int64_t>();
    r.field(rec, "loss", json::value_t::number_float);
    s.loss = number_or_nan(rec, "loss");
    s.tokens = r.field(rec, "tokens", json::value_t::number_integer).get<int64_t>();
    r.field(rec, "step_s", json::value_t::number_float);
    s.step_s = number_or_nan(rec, "step_s");
    s.tokens_per_s = number_or_nan(rec, "tokens_per_s");
    s.val_loss = number_or_nan(rec, "val_loss");
    s.val_s = rec.contains("val_s") ? number_or_nan(rec, "val_s") : 0.0;
    s.mfu = number_or_nan(rec, "mfu");
    s.skipped = rec.value("skipped", false) || !std::isfinite(s.loss);
    if (!h.steps.empty() && s.step <= h.steps.back().step)
      r.bad(fmt::format("step {} after step {}: records must be in step order", s.step,
                        h.steps.back().step));
    h.steps.push_back(s);
    if (rec.contains("unigram_entropy")) h.unigram_entropy = number_or_nan(rec, "unigram_entropy");
    if (rec.contains("fma_peak_gflops")) h.fma_peak_gflops = number_or_nan(rec, "fma_peak_gflops");
    if (rec.contains("simd") && rec["simd"].is_string()) h.simd = rec["simd"].get<std::string>();
    if (rec.contains("cpu") && rec["cpu"].is_string()) h.cpu = rec["cpu"].get<std::string>();
    if (rec.contains("memory") && rec["memory"].contains("peak") && rec["memory"]["peak"].is_object())
      for (const auto& [cat, bytes] : rec["memory"]["peak"].items())
        if (bytes.is_number_integer())
          h.peak_memory[cat] = std::max(h.peak_memory[cat], bytes.get<int64_t>());

    std::vector<std::vector<int64_t>> step_counts;
    if (rec.contains("expert_load")) {
      const json& layers = r.field(rec, "expert_load", json::value_t::array);
      if (h.expert_load.empty())
        for (const json& l : layers)
          h.expert_load.push_back({r.field(l, "layer", json::value_t::number_integer).get<int64_t>(), {}, {}});
      if (layers.size() != h.expert_load.size())
        r.bad(fmt::format("field 'expert_load': {} layers, earlier records had {}", layers.size(),
                          h.expert_load.size()));
      for (const json& l : layers) {
        // Records written before per-expert counts were logged carry only max/mean.
        if (!l.contains("counts")) break;
        step_counts.push_back(expert_counts(r, l));
      }
    }
    counts_by_step.push_back(std::move(step_counts));
  }
  MOE_CHECK(!h.steps.empty(), "{}: no step records (the run has not finished a step yet)",
            file.string());

  // The window shows where balancing ended up; the whole run mixes in the first chaotic steps.
  const auto n = static_cast<int64_t>(h.steps.size());
  h.load_window = std::clamp<int64_t>(n / 10, 1, 100);
  for (int64_t i = 0; i < n; ++i) {
    const auto& step_counts = counts_by_step[static_cast<size_t>(i)];
    if (step_counts.size() != h.expert_load.size()) continue;
    for (size_t l = 0; l < step_counts.size(); ++l) {
      LayerLoad& load = h.expert_load[l];
      for (std::vector<int64_t>* acc : {&load.run_counts, &load.window_counts}) {
        if (acc == &load.window_counts && i < n - h.load_window) continue;
        if (acc->empty()) acc->assign(step_counts[l].size(), 0);
        if (acc->size() != step_counts[l].size())
          fail("{}:{}: field 'expert_load[].counts': {} experts, earlier records had {}",
               file.string(), i + 1, step_counts[l].size(), acc->size());
        for (size_t e = 0; e < acc->size(); ++e) (*acc)[e] += step_counts[l][e];
      }
    }
  }
  return h;
}

}  // namespace moe
