#include "lora/peft_adapter.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/limits.h"
#include "core/rng.h"
#include "data/documents.h"
#include "io/hf_config.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "parallel/communicator.h"
#include "parallel/ep_training.h"

namespace moe {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const SafetensorsMetadata kPeftMetadata{{"format", "pt"}};

std::vector<std::pair<std::string, Tensor>> tensors_of(const ParamList& ps, bool experts) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Param* p : ps)
    if (is_routed_expert_param(p->name) == experts) out.emplace_back(p->name, p->value);
  return out;
}

fs::path part_file(const fs::path& dir, int part) {
  return dir / fmt::format(".adapter-part-{:05d}.safetensors", part);
}

constexpr std::string_view kExperts = "mlp.experts.";
constexpr std::array<std::string_view, 3> kExpertProjections = {"gate_proj", "up_proj", "down_proj"};

// A per-expert adapter tensor's name, taken apart:
// <layer>experts.<expert>.<projection>.lora_<which>.weight with <layer> ending in "mlp.".
struct ExpertKey {
  std::string layer;
  int64_t expert = 0;
  int part = 0;  // 0 gate, 1 up, 2 down
  char which = 'A';
};

std::optional<ExpertKey> parse_expert_key(std::string_view name) {
  const size_t at = name.find(kExperts);
  if (at == std::string_view::npos) return std::nullopt;
  ExpertKey k;
  k.layer = std::string(name.substr(0, at + std::string_view("mlp.").size()));
  std::string_view rest = name.substr(at + kExperts.size());
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), k.expert);
  if (ec != std::errc() || end == rest.data() || *end != '.') return std::nullopt;
  rest.remove_prefix(static_cast<size_t>(end - rest.data()) + 1);
  for (int part = 0; part < 3; ++part) {
    const std::string_view proj = kExpertProjections[static_cast<size_t>(part)];
    for (const char which : {'A', 'B'})
      if (rest == fmt::format("{}.lora_{}.weight", proj, which)) {
        k.part = part;
        k.which = which;
        return k;
      }
  }
  return std::nullopt;
}

// PEFT's key of a fused routed-expert adapter matrix: gate_up is the inner ParamWrapper
// (base_layer.) when down_proj is adapted too.
std::string fused_key(const std::string& layer, bool inner, char which) {
  return fmt::format("{}experts.{}lora_{}.weight", layer, inner ? "base_layer." : "", which);
}

// One fused adapter over `blocks` of per-expert adapters stacked along the output (gate_up: the
// gate then the up adapters; down: one), each of rank r: per expert e the rank-(blocks·r)
// adapter A_e = [A_0,e; A_1,e; …], B_e = blockdiag(B_0,e, B_1,e, …), laid out as PEFT's
// ParamWrapper keeps it (A row e·R + k, B column k·E + e).
struct FusedLayout {
  int64_t experts = 0, rank = 0, in = 0;  // rank: of each block
  std::vector<int64_t> block_out;
  int64_t blocks() const { return static_cast<int64_t>(block_out.size()); }
  int64_t fused_rank() const { return blocks() * rank; }
  int64_t out() const {
    int64_t n = 0;
    for (int64_t o : block_out) n += o;
    return n;
  }
  int64_t out_offset(int64_t block) const {
    int64_t n = 0;
    for (int64_t j = 0; j < block; ++j) n += block_out[static_cast<size_t>(j)];
    return n;
  }
  // Index of A_block,e[k, i] in the fused A, and of B_block,e[o, k] in the fused B.
  int64_t a_index(int64_t block, int64_t e, int64_t k, int64_t i) const {
    return (e * fused_rank() + block * rank + k) * in + i;
  }
  int64_t b_index(int64_t block, int64_t e, int64_t o, int64_t k) const {
    return (out_offset(block) + o) * (fused_rank() * experts) + (block * rank + k) * experts + e;
  }
};

}  // namespace

std::vector<std::pair<std::string, Tensor>> fuse_expert_adapters(
    std::vector<std::pair<std::string, Tensor>> tensors) {
  // Per layer and projection, expert e's A and B.
  struct Layer {
    std::array<std::vector<Tensor>, 3> a, b;
  };
  std::vector<std::string> order;
  std::map<std::string, Layer> layers;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, t] : tensors) {
    const std::optional<ExpertKey> k = parse_expert_key(name);
    if (!k) {
      out.emplace_back(std::move(name), std::move(t));
      continue;
    }
    if (!layers.contains(k->layer)) order.push_back(k->layer);
    std::vector<Tensor>& v = (k->which == 'A' ? layers[k->layer].a : layers[k->layer].b)
                                 [static_cast<size_t>(k->part)];
    if (static_cast<int64_t>(v.size()) <= k->expert) v.resize(static_cast<size_t>(k->expert + 1));
    v[static_cast<size_t>(k->expert)] = std::move(t);
  }
  for (const std::string& name : order) {
    const Layer& l = layers.at(name);
    auto has = [&](int part) { return !l.a[static_cast<size_t>(part)].empty(); };
    MOE_CHECK(has(0) == has(1), "internal: {}experts: gate and up adapters must come together",
              name);
    for (const std::vector<int>& parts : {std::vector<int>{0, 1}, std::vector<int>{2}}) {
      if (!has(parts.front())) continue;
      const std::vector<Tensor>& a0 = l.a[static_cast<size_t>(parts.front())];
      FusedLayout f;
      f.experts = static_cast<int64_t>(a0.size());
      for (int part : parts) {
        const auto& a = l.a[static_cast<size_t>(part)];
        const auto& b = l.b[static_cast<size_t>(part)];
        MOE_CHECK(static_cast<int64_t>(a.size()) == f.experts &&
                      static_cast<int64_t>(b.size()) == f.experts,
                  "internal: {}experts.*.{}: the fused layout needs every expert's adapter",
                  name, kExpertProjections[static_cast<size_t>(part)]);
        for (int64_t e = 0; e < f.experts; ++e)
          MOE_CHECK(a[static_cast<size_t>(e)].defined() && b[static_cast<size_t>(e)].defined(),
                    "internal: {}experts.{}.{}: adapter missing for the fused layout", name, e,
                    kExpertProjections[static_cast<size_t>(part)]);
        f.block_out.push_back(b.front().dim(0));
      }
      f.rank = a0.front().dim(0);
      f.in = a0.front().dim(1);
      Tensor fa = Tensor::empty({f.fused_rank() * f.experts, f.in}, DType::F32, MemCategory::Scratch);
      Tensor fb = Tensor::zeros({f.out(), f.fused_rank() * f.experts}, DType::F32, MemCategory::Scratch);
      for (int64_t j = 0; j < f.blocks(); ++j) {
        const size_t part = static_cast<size_t>(parts[static_cast<size_t>(j)]);
        for (int64_t e = 0; e < f.experts; ++e) {
          const Tensor& a = l.a[part][static_cast<size_t>(e)];
          const Tensor& b = l.b[part][static_cast<size_t>(e)];
          MOE_CHECK(a.shape() == (Shape{f.rank, f.in}) &&
                        b.shape() == (Shape{f.block_out[static_cast<size_t>(j)], f.rank}),
                    "internal: {}experts.{}.{}: adapter shapes differ between experts", name, e,
                    kExpertProjections[part]);
          for (int64_t k = 0; k < f.rank; ++k)
            std::copy_n(a.f32() + k * f.in, f.in, fa.f32() + f.a_index(j, e, k, 0));
          for (int64_t o = 0; o < f.block_out[static_cast<size_t>(j)]; ++o)
            for (int64_t k = 0; k < f.rank; ++k)
              fb.f32()[f.b_index(j, e, o, k)] = b.f32()[o * f.rank + k];
        }
      }
      const bool inner = parts.front() == 0 && has(2);
      out.emplace_back(fused_key(name, inner, 'A'), std::move(fa));
      out.emplace_back(fused_key(name, inner, 'B'), std::move(fb));
    }
  }
  return out;
}

json peft_adapter_config(const LoraSettings& s, const std::string& base_model,
                         const CausalLM& model) {
  json j = peft_adapter_config(s, base_model);
  if (!model.config().is_v4()) return j;
  // Full paths: PEFT then adapts exactly these modules (its suffix rules and "all-linear"
  // reach modules moe leaves alone, model/v4/v4_lora.h).
  json modules = json::array(), parameters = json::array();
  std::set<std::string> seen;
  bool gate_up = false, down = false;
  constexpr std::string_view prefix = "base_model.model.", suffix = ".lora_A.weight";
  for (const Param* p : model.lora_params()) {
    const std::string_view name = p->name;
    if (!name.ends_with(suffix)) continue;
    if (const std::optional<ExpertKey> k = parse_expert_key(name)) {
      const std::string layer = k->layer.substr(prefix.size());
      const std::string fused = layer + (k->part == 2 ? "experts.down_proj" : "experts.gate_up_proj");
      (k->part == 2 ? down : gate_up) = true;
      if (seen.insert(fused).second) parameters.push_back(fused);
      continue;
    }
    const std::string module(name.substr(prefix.size(), name.size() - prefix.size() - suffix.size()));
    if (seen.insert(module).second) modules.push_back(module);
  }
  j["target_modules"] = modules;
  j["target_parameters"] = parameters.empty() ? json(nullptr) : parameters;
  json rank_pattern = json::object(), alpha_pattern = json::object();
  const double expert_alpha = s.alpha_for(true);
  if (gate_up) {
    // Separate rank-r gate and up adapters = one block-diagonal rank-2r adapter of equal scaling.
    rank_pattern[kFusedGateUpPattern] = 2 * s.rank_for(true);
    alpha_pattern[kFusedGateUpPattern] = (s.rslora ? std::sqrt(2.0) : 2.0) * expert_alpha;
  }
  if (down) {
    rank_pattern[kFusedDownPattern] = s.rank_for(true);
    alpha_pattern[kFusedDownPattern] = expert_alpha;
  }
  j["rank_pattern"] = rank_pattern;
  j["alpha_pattern"] = alpha_pattern;
  // The fused layout's orientation is PEFT 0.19.1's (SPEC §8.1); older PEFT reads it transposed.
  j["peft_version"] = "0.19.1";
  return j;
}

void save_peft_adapter(const fs::path& dir, const CausalLM& model, const LoraSettings& s,
                       const std::string& base_model, const AdapterWriters& w) {
  Communicator* world = w.world && w.world->size() > 1 ? w.world : nullptr;
  const bool main = world == nullptr || world->rank() == 0;
  const ParamList& ps = model.lora_params();
  // DeepSeek-V4's routed experts are written fused, which needs every expert of a layer at once.
  const auto layout = [&](std::vector<std::pair<std::string, Tensor>> all) {
    return model.config().is_v4() ? fuse_expert_adapters(std::move(all)) : all;
  };
  if (main) fs::create_directories(dir);
  if (world) world->barrier();
  if (world == nullptr || w.ep_size == 1) {
    if (main) {
      auto all = tensors_of(ps, false);
      for (auto& t : tensors_of(ps, true)) all.push_back(std::move(t));
      write_safetensors(dir / kAdapterWeightsFile, layout(std::move(all)), kPeftMetadata);
    }
  } else {
    if (main) write_safetensors(part_file(dir, 0), tensors_of(ps, false));
    if (w.writes_experts) write_safetensors(part_file(dir, w.ep_rank + 1), tensors_of(ps, true));
    world->barrier();
    if (main) {
      std::vector<std::pair<std::string, Tensor>> all;
      for (int part = 0; part <= w.ep_size; ++part) {
        const SafetensorsReader r(part_file(dir, part));
        for (const SafetensorsEntry& e : r.entries())
          all.emplace_back(e.name, r.read(e.name, DType::F32, MemCategory::Scratch));
      }
      write_safetensors(dir / kAdapterWeightsFile, layout(std::move(all)), kPeftMetadata);
      for (int part = 0; part <= w.ep_size; ++part) fs::remove(part_file(dir, part));
    }
  }
  if (main) {
    write_file_atomic(dir / kAdapterConfigFile,
                      peft_adapter_config(s, base_model, model).dump(2) + "\n");
    fsync_directory(dir);
  }
  if (world) world->barrier();
}

namespace {

// The routed-expert adapters of `ps` that the file holds only in the fused layout, filled from
// it layer by layer; adds the fused tensors' names to `used`.
void load_fused_expert_adapters(const SafetensorsReader& r, const std::vector<Param*>& pending,
                                const ParamList& ps, int64_t routed_experts,
                                std::set<std::string>& used) {
  const std::string file = r.path().string();
  // Which projections each layer's adapters have: they decide the keys (inner / outer wrapper).
  std::map<std::string, std::array<bool, 3>> adapted;
  for (const Param* p : ps)
    if (const std::optional<ExpertKey> k = parse_expert_key(p->name))
      adapted[k->layer][static_cast<size_t>(k->part)] = true;
  // Per layer and fused parameter (0 gate_up, 1 down), the pending params.
  std::map<std::pair<std::string, int>, std::vector<std::pair<Param*, ExpertKey>>> groups;
  for (Param* p : pending) {
    const ExpertKey k = *parse_expert_key(p->name);
    groups[{k.layer, k.part == 2 ? 1 : 0}].emplace_back(p, k);
  }
  for (const auto& [group, members] : groups) {
    const auto& [layer, fused] = group;
    const std::array<bool, 3>& has = adapted.at(layer);
    const bool inner = fused == 0 && has[2];
    const char* what = fused == 0 ? "gate_up_proj" : "down_proj";
    const std::vector<int> parts = fused == 0 ? std::vector<int>{0, 1} : std::vector<int>{2};
    for (int part : parts)
      MOE_CHECK(has[static_cast<size_t>(part)],
                "{}: the fused mlp.experts.gate_up_proj adapter of {} needs both the gate_proj "
                "and the up_proj adapters", file, layer);
    FusedLayout f;
    const Param& first = *members.front().first;
    const ExpertKey& fk = members.front().second;
    f.rank = fk.which == 'A' ? first.value.dim(0) : first.value.dim(1);
    for (int part : parts) {
      // Each block's output width: the B of any pending param of that projection.
      int64_t out = -1;
      for (const auto& [p, k] : members)
        if (k.part == part && k.which == 'B') out = p->value.dim(0);
      for (const auto& [p, k] : members)
        if (k.part == part && k.which == 'A') f.in = p->value.dim(1);
      MOE_CHECK(out > 0, "internal: {}experts.*.{} has no lora_B", layer,
                kExpertProjections[static_cast<size_t>(part)]);
      f.block_out.push_back(out);
    }
    const std::string key_a = fused_key(layer, inner, 'A'), key_b = fused_key(layer, inner, 'B');
    for (const std::string& key : {key_a, key_b})
      MOE_CHECK(r.contains(key),
                "{}: no tensor '{}' (nor '{}'): the routed experts' {} adapter of {} is missing "
                "(the adapter's config targets it)", file, key, members.front().first->name,
                what, layer);
    const SafetensorsEntry& ea = r.entry(key_a);
    const SafetensorsEntry& eb = r.entry(key_b);
    const int64_t R = f.fused_rank();
    const bool rows_fit = ea.shape.size() == 2 && ea.shape[0] % R == 0 && ea.shape[0] > 0;
    f.experts = rows_fit ? ea.shape[0] / R : 0;
    const bool ok = rows_fit && ea.shape[1] == f.in &&
                    (routed_experts == 0 || f.experts == routed_experts) &&
                    eb.shape == (Shape{f.out(), R * f.experts}) &&
                    (ea.dtype == "F32" || ea.dtype == "BF16") &&
                    (eb.dtype == "F32" || eb.dtype == "BF16");
    const int64_t E = routed_experts > 0 ? routed_experts : std::max<int64_t>(f.experts, 1);
    MOE_CHECK(ok,
              "{}: '{}' is {} {} and '{}' {} {}; the fused {} adapter of {} experts at rank {} "
              "(PEFT >= 0.19.1: lora_A [rank·E, in], lora_B [out, rank·E]) must be F32 or BF16 "
              "{} and {}", file, key_a, ea.dtype, shape_str(ea.shape), key_b, eb.dtype,
              shape_str(eb.shape), what, E, R, shape_str({R * E, f.in}),
              shape_str({f.out(), R * E}));
    const Tensor a = r.read(key_a, DType::F32, MemCategory::Scratch);
    const Tensor b = r.read(key_b, DType::F32, MemCategory::Scratch);
    // The separate gate and up adapters exist only when B couples no gate row with an up rank
    // and no up row with a gate rank.
    for (int64_t j = 0; j < f.blocks(); ++j)
      for (int64_t o = 0; o < f.block_out[static_cast<size_t>(j)]; ++o)
        for (int64_t other = 0; other < f.blocks(); ++other) {
          if (other == j) continue;
          for (int64_t e = 0; e < f.experts; ++e)
            for (int64_t k = 0; k < f.rank; ++k) {
              // B_j,e's row o read in the columns of block `other`'s ranks.
              const int64_t at = (f.out_offset(j) + o) * (R * f.experts) +
                                 (other * f.rank + k) * f.experts + e;
              const float v = b.f32()[at];
              MOE_CHECK(v == 0.0f,
                        "{}: '{}' is not block-diagonal: row {} (the {} rows) has {} in column {} "
                        "(expert {}, rank {} of the {} block); moe adapts the routed experts' "
                        "gate and up with separate rank-{} adapters, i.e. blockdiag(B_gate, B_up) "
                        "(SPEC §8.6), and cannot load an adapter that shares ranks between them",
                        file, key_b, f.out_offset(j) + o, j == 0 ? "gate" : "up", v,
                        (other * f.rank + k) * f.experts + e, e, other * f.rank + k,
                        other == 0 ? "gate" : "up", f.rank);
            }
        }
    for (const auto& [p, k] : members) {
      MOE_CHECK(k.expert < f.experts, "{}: '{}' holds {} experts; {} needs expert {}", file,
                key_a, f.experts, p->name, k.expert);
      const int64_t j = fused == 0 ? k.part : 0;
      const int64_t out = f.block_out[static_cast<size_t>(j)];
      const Shape want = k.which == 'A' ? Shape{f.rank, f.in} : Shape{out, f.rank};
      MOE_CHECK(p->value.shape() == want, "internal: {} is {}, the fused layout gives {}", p->name,
                shape_str(p->value.shape()), shape_str(want));
      float* dst = p->w();
      if (k.which == 'A') {
        for (int64_t row = 0; row < f.rank; ++row)
          std::copy_n(a.f32() + f.a_index(j, k.expert, row, 0), f.in, dst + row * f.in);
      } else {
        for (int64_t o = 0; o < out; ++o)
          for (int64_t row = 0; row < f.rank; ++row)
            dst[o * f.rank + row] = b.f32()[f.b_index(j, k.expert, o, row)];
      }
    }
    used.insert(key_a);
    used.insert(key_b);
  }
}

}  // namespace

std::set<std::string> load_peft_adapter_weights(const fs::path& dir, const ParamList& ps,
                                                int64_t routed_experts) {
  const fs::path file = dir / kAdapterWeightsFile;
  MOE_CHECK(fs::is_regular_file(file), "{}: no {} (a PEFT adapter directory holds it next to {})",
            dir.string(), kAdapterWeightsFile, kAdapterConfigFile);
  const SafetensorsReader r(file);
  // Tensors of other kinds (lora_B biases, token embeddings, DoRA magnitudes) would change the
  // model; loading without them would be silently wrong.
  for (const SafetensorsEntry& e : r.entries())
    MOE_CHECK(e.name.ends_with(".lora_A.weight") || e.name.ends_with(".lora_B.weight"),
              "{}: tensor '{}' is not a LoRA matrix (…lora_A.weight / …lora_B.weight); moe "
              "supports plain LoRA adapters only", file.string(), e.name);
  std::set<std::string> used;
  std::vector<Param*> fused;
  for (Param* p : ps) {
    if (!r.contains(p->name) && parse_expert_key(p->name)) {
      fused.push_back(p);
      continue;
    }
    MOE_CHECK(r.contains(p->name), "{}: no tensor '{}' (the adapter's config targets that module)",
              file.string(), p->name);
    const SafetensorsEntry& e = r.entry(p->name);
    MOE_CHECK(e.shape == p->value.shape() && (e.dtype == "F32" || e.dtype == "BF16"),
              "{}: '{}' is {} {}, expected F32 or BF16 {}", file.string(), p->name, e.dtype,
              shape_str(e.shape), shape_str(p->value.shape()));
    r.read_into(p->name, p->value);
    used.insert(p->name);
  }
  if (!fused.empty()) load_fused_expert_adapters(r, fused, ps, routed_experts, used);
  return used;
}

void apply_peft_adapter(const fs::path& dir, CausalLM& model) {
  const LoraSettings s = read_peft_adapter_config(dir);
  model.add_lora(s, 0, (dir / kAdapterConfigFile).string());
  load_peft_adapter_weights(dir, model.lora_params(), model.config().n_routed_experts);
}

uint64_t base_model_fingerprint(const fs::path& dir) {
  const fs::path config = dir / kHfConfigFile;
  MOE_CHECK(fs::is_regular_file(config), "{}: not a model directory (no {})", dir.string(),
            kHfConfigFile);
  uint64_t h = fnv1a(read_whole_file(config).c_str());
  const SafetensorsSet weights(dir);
  for (const std::string& name : weights.names()) {
    const SafetensorsReader& r = weights.reader_for(name);
    const SafetensorsEntry& e = r.entry(name);
    h = fnv1a((name + ":" + e.dtype + ":" + shape_str(e.shape) + ";").c_str(), h);
    // Sampled bytes (start, middle, end) tell two trainings of one architecture apart without
    // reading a 671B model twice.
    const int64_t n = e.nbytes(), w = std::min<int64_t>(n, 256);
    std::vector<unsigned char> bytes(static_cast<size_t>(w));
    for (const int64_t at : {int64_t{0}, (n - w) / 2, n - w}) {
      if (w == 0) break;
      r.read_bytes(e, at, w, bytes.data());
      for (unsigned char b : bytes) h = (h ^ b) * 0x100000001b3ull;
    }
  }
  return h;
}

std::string base_model_reference(const fs::path& dir, uint64_t fingerprint) {
  const json j = {{"path", fs::absolute(dir).lexically_normal().string()},
                  {"fingerprint", fmt::format("{:#018x}", fingerprint)}};
  return j.dump(2) + "\n";
}

void check_base_model(const fs::path& checkpoint_dir, const fs::path& model_dir,
                      uint64_t fingerprint) {
  const fs::path file = checkpoint_dir / kBaseModelFile;
  MOE_CHECK(fs::is_regular_file(file), "{}: not an adapter checkpoint (no {})",
            checkpoint_dir.string(), kBaseModelFile);
  const json saved = json::parse(read_text_file_capped(file, "the base model record"),
                                 json_depth_limit<json>(file.string()), /*allow_exceptions=*/false);
  MOE_CHECK(saved.is_object() && saved.contains("fingerprint") && saved["fingerprint"].is_string(),
            "{}: malformed (expected \"path\" and \"fingerprint\")", file.string());
  const std::string want = saved["fingerprint"].get<std::string>();
  const std::string got = fmt::format("{:#018x}", fingerprint);
  MOE_CHECK(want == got,
            "{}: the adapter was trained on the base model {} (fingerprint {}); model.weights = "
            "{} is a different model (fingerprint {}: its config.json or tensors differ)",
            checkpoint_dir.string(), saved.value("path", std::string("?")), want,
            model_dir.string(), got);
}

}  // namespace moe
