#include "model/v4/v4_lora.h"

#include <array>
#include <charconv>
#include <optional>

#include "core/error.h"
#include "model/v4/v4_model.h"

namespace moe {

namespace {

struct NamePair {
  std::string_view released, hf;
};

// Under layers.L. (released) and model.layers.L. (Hugging Face).
constexpr std::array<NamePair, 7> kDenseModules = {{
    {"attn.wq_a", "self_attn.q_a_proj"},
    {"attn.wq_b", "self_attn.q_b_proj"},
    {"attn.wkv", "self_attn.kv_proj"},
    {"attn.wo_b", "self_attn.o_b_proj"},
    {"ffn.shared_experts.w1", "mlp.shared_experts.gate_proj"},
    {"ffn.shared_experts.w3", "mlp.shared_experts.up_proj"},
    {"ffn.shared_experts.w2", "mlp.shared_experts.down_proj"},
}};
// Under ffn.experts.E. / mlp.experts.E.; part 0 gate, 1 up, 2 down.
constexpr std::array<NamePair, 3> kExpertProjections = {{
    {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}}};

constexpr const char* kV4ModuleHint =
    "Hugging Face deepseek_v4 modules under model.layers.L. are self_attn.q_a_proj, q_b_proj, "
    "kv_proj, o_b_proj, mlp.shared_experts.{gate,up,down}_proj and the routed experts "
    "mlp.experts.N.{gate,up,down}_proj, or as target_parameters mlp.experts.gate_up_proj and "
    "mlp.experts.down_proj; self_attn.o_a_proj, the compressor's and indexer's projections and "
    "the MTP layer are not adapted";

// Splits "<head><L>.<tail>" into L and tail; nullopt when `name` does not have that form.
std::optional<std::pair<std::string_view, std::string_view>> split_layer(std::string_view name,
                                                                         std::string_view head) {
  if (!name.starts_with(head)) return std::nullopt;
  name.remove_prefix(head.size());
  const size_t dot = name.find('.');
  if (dot == 0 || dot == std::string_view::npos) return std::nullopt;
  int64_t layer = 0;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + dot, layer);
  if (ec != std::errc() || end != name.data() + dot) return std::nullopt;
  return std::pair{name.substr(0, dot), name.substr(dot + 1)};
}

// Maps `tail` (below the layer) from one naming to the other; `to_hf` picks the direction.
std::string map_tail(std::string_view tail, bool to_hf) {
  for (const NamePair& p : kDenseModules)
    if (tail == (to_hf ? p.released : p.hf)) return std::string(to_hf ? p.hf : p.released);
  const std::string_view from_experts = to_hf ? "ffn.experts." : "mlp.experts.";
  const auto expert = split_layer(tail, from_experts);
  if (!expert) return {};
  for (const NamePair& p : kExpertProjections)
    if (expert->second == (to_hf ? p.released : p.hf))
      return std::string(to_hf ? "mlp.experts." : "ffn.experts.") + std::string(expert->first) +
             "." + std::string(to_hf ? p.hf : p.released);
  return {};
}

// The Hugging Face module names of layer `layer` that exist in deepseek_v4 but are never adapted
// (see v4_lora.h), for telling a user why a target matched nothing.
std::vector<std::string> unadapted_modules(const ModelConfig& cfg, int64_t layer) {
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  const int64_t ratio = cfg.compress_ratio(layer);
  std::vector<std::string> out = {prefix + "self_attn.o_a_proj"};
  if (ratio > 0)
    for (const char* m : {"kv_proj", "gate_proj"}) out.push_back(prefix + "self_attn.compressor." + m);
  if (ratio == 4)
    for (const char* m : {"kv_proj", "gate_proj", "q_b_proj", "scorer.weights_proj"})
      out.push_back(prefix + "self_attn.compressor.indexer." + m);
  return out;
}

// The adapter of a linear that select_v4_lora chose.
void adapt_linear(Linear& linear, bool selected, const LoraSettings& s, const LoraRuntime* rt,
                  uint64_t seed, ParamList& out) {
  if (!selected) return;
  const std::string module = v4_hf_module_of(linear.module_name());
  MOE_CHECK(!module.empty(), "internal: {} has no Hugging Face deepseek_v4 module name",
            linear.weight.name);
  linear.lora = std::make_unique<LoraAdapter>();
  linear.lora->init(module, linear.in, linear.out, s.shape_for(false), rt);
  linear.lora->init_weights(seed);
  linear.lora->collect(out);
}

// The routed experts' grouped adapters (one per selected projection) of one layer.
void adapt_experts(MoELayer& m, const std::string& mlp_prefix, const std::array<bool, 3>& selected,
                   const LoraSettings& s, const LoraRuntime* rt, uint64_t seed, ParamList& out) {
  ExpertWeights& x = m.experts();
  MoELayer::ExpertLora& lora = m.expert_lora();
  for (int part = 0; part < 3; ++part) {
    if (!selected[static_cast<size_t>(part)]) continue;
    const bool down = part == 2;
    auto a = std::make_unique<GroupedLoraAdapter>();
    a->init(mlp_prefix, std::string(kExpertProjections[static_cast<size_t>(part)].hf),
            x.experts(), down ? x.hidden() : x.dim(), down ? x.dim() : x.hidden(),
            s.shape_for(true), rt);
    a->init_weights(seed);
    a->collect(out);
    (part == 0 ? lora.gate : part == 1 ? lora.up : lora.down) = std::move(a);
  }
}

}  // namespace

V4LayerLora select_v4_lora(const ModelConfig& cfg, int64_t layer, LoraTargetMatcher& match,
                           const std::string& section) {
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  const std::string o_a = prefix + "self_attn.o_a_proj";
  MOE_CHECK(!match.names(o_a),
            "{}: the targets name {} (released attn.wo_a), which LoRA cannot adapt: it is a "
            "grouped linear ({} groups, each [{}, {}]) applied to its own slice of the heads, "
            "so a PEFT lora.Linear beside it would not even produce the base output's shape "
            "(SPEC §8.5); leave it out (e.g. targets q_a_proj, q_b_proj, kv_proj, o_b_proj)",
            section, o_a, cfg.o_groups, cfg.o_lora_rank,
            cfg.num_attention_heads * cfg.head_dim / cfg.o_groups);
  V4LayerLora sel;
  sel.wq_a = match.matches(prefix + "self_attn.q_a_proj");
  sel.wq_b = match.matches(prefix + "self_attn.q_b_proj");
  sel.wkv = match.matches(prefix + "self_attn.kv_proj");
  sel.wo_b = match.matches(prefix + "self_attn.o_b_proj");
  if (cfg.n_shared_experts > 0)
    for (int part = 0; part < 3; ++part)
      sel.shared[static_cast<size_t>(part)] = match.matches(
          prefix + "mlp.shared_experts." +
          std::string(kExpertProjections[static_cast<size_t>(part)].hf));
  // Routed experts: per projection all experts or none (one grouped adapter), by their
  // per-expert module names or the fused parameters; gate and up only together.
  const std::string mlp_prefix = prefix + "mlp.";
  const int64_t num_experts = cfg.n_routed_experts;
  std::array<bool, 3>& selected = sel.experts;
  for (int part = 0; part < 3; ++part) {
    const std::string proj(kExpertProjections[static_cast<size_t>(part)].hf);
    int64_t hits = 0;
    for (int64_t e = 0; e < num_experts; ++e)
      hits += match.matches(mlp_prefix + "experts." + std::to_string(e) + "." + proj);
    MOE_CHECK(hits == 0 || hits == num_experts,
              "{}: the targets select {} of the {} routed experts' {} in {}experts.*; routed "
              "experts are adapted all together (one grouped adapter per layer): select all or "
              "none", section, hits, num_experts, proj, mlp_prefix);
    selected[static_cast<size_t>(part)] = hits > 0;
  }
  if (match.matches_parameter(mlp_prefix + "experts.gate_up_proj")) selected[0] = selected[1] = true;
  if (match.matches_parameter(mlp_prefix + "experts.down_proj")) selected[2] = true;
  MOE_CHECK(selected[0] == selected[1],
            "{}: the targets select the routed experts' {} but not {} in {}experts.*; Hugging "
            "Face's deepseek_v4 holds both in one fused parameter (mlp.experts.gate_up_proj) that "
            "PEFT adapts as a whole: select both (e.g. targets gate_proj and up_proj) or neither",
            section, selected[0] ? "gate_proj" : "up_proj", selected[0] ? "up_proj" : "gate_proj",
            mlp_prefix);
  return sel;
}

void check_v4_lora_targets_used(const ModelConfig& cfg, const LoraTargetMatcher& match,
                                const std::string& section) {
  const std::optional<LoraTargetMatcher::Unused> unused = match.first_unused();
  if (!unused) return;
  if (unused->field != "target_parameters") {
    LoraSettings probe;
    probe.targets.clear();
    if (unused->field == "targets") probe.targets = {unused->entry};
    else probe.target_regex = unused->entry;
    LoraTargetMatcher one(probe);
    for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
      for (const std::string& module : unadapted_modules(cfg, l))
        if (one.names(module))
          fail("{}.{}: \"{}\" reaches only modules moe does not adapt, such as {}: "
               "self_attn.o_a_proj is a grouped linear that a PEFT lora.Linear cannot adapt "
               "(SPEC §8.5); the compressor's projections are no linear layers in moe (they feed "
               "its pooling directly); the indexer gets no gradient (its picks are integers)",
               section, unused->field, unused->entry, module);
  }
  match.check_all_used(section, kV4ModuleHint);
}

std::string v4_weight_of_hf_module(std::string_view module) {
  const auto split = split_layer(module, "model.layers.");
  if (!split) return {};
  const std::string tail = map_tail(split->second, /*to_hf=*/false);
  if (tail.empty()) return {};
  return "layers." + std::string(split->first) + "." + tail + ".weight";
}

std::string v4_hf_module_of(std::string_view released_module) {
  const auto split = split_layer(released_module, "layers.");
  if (!split) return {};
  const std::string tail = map_tail(split->second, /*to_hf=*/true);
  if (tail.empty()) return {};
  return "model.layers." + std::string(split->first) + "." + tail;
}

const ParamList& DeepSeekV4Model::add_lora(const LoraSettings& s, uint64_t seed,
                                           const std::string& section) {
  MOE_CHECK(lora_params_.empty(), "{}: the model already has LoRA adapters", section);
  s.validate(section);
  LoraTargetMatcher match(s);
  const LoraRuntime* rt = lora_runtime_.get();
  ParamList& out = lora_params_;
  try {
    for (size_t l = 0; l < blocks_.size(); ++l) {
      V4Block& b = *blocks_[l];
      const V4LayerLora sel = select_v4_lora(cfg_, static_cast<int64_t>(l), match, section);
      adapt_linear(b.attn.wq_a, sel.wq_a, s, rt, seed, out);
      adapt_linear(b.attn.wq_b, sel.wq_b, s, rt, seed, out);
      adapt_linear(b.attn.wkv, sel.wkv, s, rt, seed, out);
      adapt_linear(b.attn.wo_b, sel.wo_b, s, rt, seed, out);
      if (SwiGLU* shared = b.ffn.shared_experts()) {
        adapt_linear(shared->gate, sel.shared[0], s, rt, seed, out);
        adapt_linear(shared->up, sel.shared[1], s, rt, seed, out);
        adapt_linear(shared->down, sel.shared[2], s, rt, seed, out);
      }
      adapt_experts(b.ffn, "model.layers." + std::to_string(l) + ".mlp.", sel.experts, s, rt,
                    seed, out);
    }
    check_v4_lora_targets_used(cfg_, match, section);
  } catch (...) {
    drop_lora();  // a refused target leaves the model as it was
    throw;
  }
  return lora_params_;
}

void DeepSeekV4Model::drop_lora() {
  std::vector<V4Block*> blocks;
  for (auto& b : blocks_) blocks.push_back(b.get());
  if (mtp_) blocks.push_back(mtp_->block.get());
  for (V4Block* b : blocks) {
    for (Linear* lin : {&b->attn.wq_a, &b->attn.wq_b, &b->attn.wkv, &b->attn.wo_b})
      lin->lora.reset();
    if (SwiGLU* shared = b->ffn.shared_experts())
      for (Linear* lin : {&shared->gate, &shared->up, &shared->down}) lin->lora.reset();
    MoELayer::ExpertLora& l = b->ffn.expert_lora();
    l.gate.reset(), l.up.reset(), l.down.reset();
  }
  lora_params_.clear();
}

}  // namespace moe
