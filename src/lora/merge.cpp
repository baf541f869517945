#include "lora/merge.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <set>
#include <string_view>

#include "core/error.h"
#include "core/parallel.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "kernels/mxfp4.h"
#include "lora/peft_adapter.h"
#include "model/causal_lm.h"
#include "model/v4/v4_lora.h"
#include "moe/moe_layer.h"
#include "parallel/ep_training.h"

namespace moe {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kPeftPrefix = "base_model.model.";
constexpr std::string_view kLoraASuffix = ".lora_A.weight";

bool is_routed_expert_module(std::string_view module) {
  return module.find("mlp.experts.") != std::string_view::npos;
}

// "model.layers.L...." -> L (-1 when the name does not start that way).
int64_t layer_of(std::string_view name) {
  constexpr std::string_view head = "model.layers.";
  if (!name.starts_with(head)) return -1;
  name.remove_prefix(head.size());
  int64_t layer = -1;
  std::from_chars(name.data(), name.data() + name.size(), layer);
  return layer;
}

std::string scale_name_of(const std::string& weight_name) {
  return weight_name.substr(0, weight_name.size() - std::string_view(".weight").size()) + ".scale";
}

// Per-thread row scratch, sized once per matrix.
struct RowScratch {
  std::vector<std::vector<double>> delta;
  std::vector<std::vector<float>> row, back;
  std::vector<std::vector<uint8_t>> scales;
  RowScratch(int64_t in, bool packed) {
    const size_t n = static_cast<size_t>(num_threads());
    delta.assign(n, std::vector<double>(static_cast<size_t>(in)));
    if (packed) {
      row.assign(n, std::vector<float>(static_cast<size_t>(in)));
      back.assign(n, std::vector<float>(static_cast<size_t>(in)));
      scales.assign(n, std::vector<uint8_t>(static_cast<size_t>(in / mxfp4::kBlock)));
    }
  }
};

// delta[i] = s·Σ_k B[o, k]·A[k, i] for one output row o, in double.
void delta_row(const float* a, const float* b_row, int64_t r, int64_t in, double s,
               double* delta) {
  std::fill(delta, delta + in, 0.0);
  for (int64_t k = 0; k < r; ++k) {
    const double bk = b_row[k];
    const float* ak = a + k * in;
    for (int64_t i = 0; i < in; ++i) delta[i] += bk * static_cast<double>(ak[i]);
  }
  for (int64_t i = 0; i < in; ++i) delta[i] *= s;
}

// One block of 32 values encoded under a given E8M0 scale byte (as quantize_row does under the
// scale it picks itself): 16 packed bytes. Returns the block's squared error in double.
double encode_block(const float* v, uint8_t scale, uint8_t* out) {
  const int e = static_cast<int>(scale) - 127;
  const float step = mxfp4::e8m0_value(scale);
  double err2 = 0;
  for (int64_t i = 0; i < mxfp4::kBlock; i += 2) {
    const uint8_t lo = mxfp4::e2m1_encode(std::ldexp(v[i], -e));
    const uint8_t hi = mxfp4::e2m1_encode(std::ldexp(v[i + 1], -e));
    out[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
    const double dl = double(v[i]) - double(mxfp4::e2m1_value(lo) * step);
    const double dh = double(v[i + 1]) - double(mxfp4::e2m1_value(hi) * step);
    err2 += dl * dl + dh * dh;
  }
  return err2;
}

// Re-quantizes a merged row W0 + ΔW whose base W0 was packed under `old_scales`. Per block of
// 32, the better (smaller squared error; the fresh one on a tie) of two encodings:
//   fresh: quantize_row's own, the scale from the merged block's amax (what `moe quantize` of
//          the fp32 merge would write), and
//   kept:  the base's scale, where W0 itself is on the grid, so the nearest grid point is never
//          further than ΔW: |error| <= |ΔW| element by element.
// The fresh scale alone can be much worse for a small ΔW: when the block's amax crosses a power
// of two, the scale doubles and every element of the block is rounded again, coarser, so the
// re-quantization error exceeds the whole delta (measured: 2x ‖ΔW‖ at ‖ΔW‖/‖W‖ = 1.4%). With the
// choice, ‖Q(W0 + ΔW) − (W0 + ΔW)‖ <= ‖ΔW‖ per block: the merged model is never further from the
// unmerged one (in its expert weights) than the base without the adapter.
void requantize_row(const float* row, int64_t n, const uint8_t* old_scales, uint8_t* packed,
                    uint8_t* scales) {
  mxfp4::quantize_row(row, n, packed, scales);
  uint8_t kept[mxfp4::kBlock / 2], fresh[mxfp4::kBlock / 2];
  for (int64_t b = 0; b < n / mxfp4::kBlock; ++b) {
    const float* v = row + b * mxfp4::kBlock;
    uint8_t* out = packed + b * (mxfp4::kBlock / 2);
    if (old_scales[b] == scales[b] || old_scales[b] == 0xFF || scales[b] == 0xFF) continue;
    const double fresh_err = encode_block(v, scales[b], fresh);
    const double kept_err = encode_block(v, old_scales[b], kept);
    if (kept_err < fresh_err) {
      std::copy(kept, kept + mxfp4::kBlock / 2, out);
      scales[b] = old_scales[b];
    }
  }
}

struct LayerSums {
  double err2 = 0, ref2 = 0, delta2 = 0, max_abs = 0;
  int64_t matrices = 0, weights = 0;
};

// W [out, in] fp32 += s·B·A.
void merge_f32(Param& w, const Param& a, const Param& b, double s) {
  const int64_t out = w.value.dim(0), in = w.value.dim(1), r = a.value.dim(0);
  RowScratch scratch(in, false);
  parallel_for(0, out, [&](int64_t o) {
    double* delta = scratch.delta[static_cast<size_t>(thread_index())].data();
    delta_row(a.w(), b.w() + o * r, r, in, s, delta);
    float* row = w.w() + o * in;
    for (int64_t i = 0; i < in; ++i)
      row[i] = static_cast<float>(static_cast<double>(row[i]) + delta[i]);
  });
}

// The packed pair (data [out, in/2], scales [out, in/32]) of W: each row decoded, the delta
// added, quantized back into the same bytes, and the re-quantization error summed.
void merge_mxfp4(Param& data, Param& scales, const Param& a, const Param& b, double s,
                 LayerSums& sums) {
  const int64_t out = data.value.dim(0), in = data.value.dim(1) * 2, r = a.value.dim(0);
  const int64_t packed_row = in / 2, scale_row = in / mxfp4::kBlock;
  RowScratch scratch(in, true);
  struct RowSums { double err2 = 0, ref2 = 0, delta2 = 0, max_abs = 0; };
  std::vector<RowSums> rows(static_cast<size_t>(out));
  parallel_for(0, out, [&](int64_t o) {
    const size_t t = static_cast<size_t>(thread_index());
    double* delta = scratch.delta[t].data();
    float* row = scratch.row[t].data();
    float* back = scratch.back[t].data();
    uint8_t* old_scales = scratch.scales[t].data();
    uint8_t* p = data.value.u8() + o * packed_row;
    uint8_t* sc = scales.value.u8() + o * scale_row;
    delta_row(a.w(), b.w() + o * r, r, in, s, delta);
    mxfp4::dequantize_row(p, sc, in, row);
    for (int64_t i = 0; i < in; ++i)
      row[i] = static_cast<float>(static_cast<double>(row[i]) + delta[i]);
    std::copy(sc, sc + scale_row, old_scales);
    requantize_row(row, in, old_scales, p, sc);
    mxfp4::dequantize_row(p, sc, in, back);
    RowSums& rs = rows[static_cast<size_t>(o)];
    for (int64_t i = 0; i < in; ++i) {
      const double v = row[i], d = v - static_cast<double>(back[i]);
      rs.err2 += d * d;
      rs.ref2 += v * v;
      rs.delta2 += delta[i] * delta[i];
      rs.max_abs = std::max(rs.max_abs, std::abs(d));
    }
  });
  for (const RowSums& rs : rows) {
    sums.err2 += rs.err2;
    sums.ref2 += rs.ref2;
    sums.delta2 += rs.delta2;
    sums.max_abs = std::max(sums.max_abs, rs.max_abs);
  }
  ++sums.matrices;
  sums.weights += out * in;
}

// The adapters the model still reaches publicly (MoE layers: grouped expert adapters, shared
// experts) must have the scale `settings` gives: a wrong `settings` would merge a wrong delta.
void check_scales(CausalLM& model, const LoraSettings& settings) {
  const LoraShape expert = settings.shape_for(true), other = settings.shape_for(false);
  auto same = [](const LoraShape& a, const LoraShape& b) {
    return a.rank == b.rank && a.scale == b.scale;
  };
  for (MoELayer* m : model.moe_layers()) {
    MoELayer::ExpertLora& l = m->expert_lora();
    for (const GroupedLoraAdapter* g : {l.gate.get(), l.up.get(), l.down.get()})
      MOE_CHECK(g == nullptr || same(g->shape(), expert),
                "merge_lora_into_base: the routed experts' adapters have rank {} and scale {}, "
                "the settings say rank {} and scale {}", g->shape().rank, g->shape().scale,
                expert.rank, expert.scale);
    if (SwiGLU* shared = m->shared_experts())
      for (const Linear* lin : {&shared->gate, &shared->up, &shared->down})
        MOE_CHECK(!lin->lora || same(lin->lora->shape(), other),
                  "merge_lora_into_base: {}'s adapter has rank {} and scale {}, the settings say "
                  "rank {} and scale {}", lin->lora->module(), lin->lora->shape().rank,
                  lin->lora->shape().scale, other.rank, other.scale);
  }
}

}  // namespace

MergeReport merge_lora_into_base(CausalLM& model, const LoraSettings& settings) {
  MOE_CHECK(model.has_lora(), "merge_lora_into_base: the model has no LoRA adapters to merge");
  check_scales(model, settings);
  std::map<std::string_view, Param*> base, lora;
  for (Param* p : model.params()) base[p->name] = p;
  for (Param* p : model.lora_params()) lora[p->name] = p;

  // Every pair is found and checked before any weight changes: a failed merge leaves the model
  // as it was.
  struct Job {
    Param* w;
    Param* scales;  // MXFP4 only
    const Param* a;
    const Param* b;
    double s;
    int64_t layer;
  };
  std::vector<Job> jobs;
  std::set<const Param*> adapted;
  for (Param* a : model.lora_params()) {
    const std::string_view an = a->name;
    if (!an.ends_with(kLoraASuffix)) continue;
    MOE_CHECK(an.starts_with(kPeftPrefix), "merge_lora_into_base: adapter tensor '{}' is not "
              "named base_model.model.<module>.lora_A.weight", a->name);
    const std::string module(an.substr(kPeftPrefix.size(),
                                       an.size() - kPeftPrefix.size() - kLoraASuffix.size()));
    const auto bit = lora.find(lora_key(module, 'B'));
    MOE_CHECK(bit != lora.end(), "merge_lora_into_base: adapter of {} has lora_A but no lora_B",
              module);
    const Param& b = *bit->second;
    // DeepSeek-V4 keeps its released key names; adapters carry Hugging Face's module names.
    const std::string weight_name =
        model.config().is_v4() ? v4_weight_of_hf_module(module) : module + ".weight";
    const auto wit = base.find(weight_name);
    MOE_CHECK(wit != base.end(), "merge_lora_into_base: adapter of {} adapts no base weight "
              "(no parameter '{}')", module, weight_name.empty() ? module : weight_name);
    Param& w = *wit->second;
    const LoraShape shape = settings.shape_for(is_routed_expert_module(module));
    const int64_t r = a->value.dim(0), in = a->value.dim(1), out = b.value.dim(0);
    const int64_t w_in = w.packed() ? w.value.dim(1) * 2 : w.value.dim(1);
    MOE_CHECK(r == shape.rank && b.value.dim(1) == r && w.value.dim(0) == out && w_in == in,
              "merge_lora_into_base: {}: lora_A {} and lora_B {} (rank {} expected) do not fit "
              "the weight [{}, {}]", module, shape_str(a->value.shape()),
              shape_str(b.value.shape()), shape.rank, w.value.dim(0), w_in);
    MOE_CHECK(adapted.insert(&w).second, "merge_lora_into_base: {} has two adapters", module);
    Param* scales = nullptr;
    if (w.format != ParamFormat::F32) {
      MOE_CHECK(w.format == ParamFormat::Mxfp4Data, "merge_lora_into_base: '{}' is not a weight",
                w.name);
      const auto sit = base.find(scale_name_of(w.name));
      MOE_CHECK(sit != base.end() && sit->second->format == ParamFormat::Mxfp4Scales,
                "internal: MXFP4 weight '{}' has no scales", w.name);
      scales = sit->second;
    }
    // The float s the forward uses, widened.
    jobs.push_back({&w, scales, a, &b, static_cast<double>(shape.scale), layer_of(module)});
  }
  MOE_CHECK(2 * jobs.size() == model.lora_params().size(),
            "merge_lora_into_base: {} adapter tensors, but {} lora_A/lora_B pairs were found",
            model.lora_params().size(), jobs.size());

  MergeReport report;
  std::map<int64_t, LayerSums> per_layer;
  for (const Job& j : jobs) {
    if (j.scales == nullptr)
      merge_f32(*j.w, *j.a, *j.b, j.s);
    else
      merge_mxfp4(*j.w, *j.scales, *j.a, *j.b, j.s, per_layer[j.layer]);
  }
  report.matrices = static_cast<int64_t>(jobs.size());
  for (const auto& [layer, s] : per_layer) {
    MergeLayerStats st;
    st.layer = layer;
    st.matrices = s.matrices;
    st.weights = s.weights;
    st.rel_rms_error = s.ref2 > 0 ? std::sqrt(s.err2 / s.ref2) : 0.0;
    st.max_abs_error = s.max_abs;
    st.rel_delta = s.ref2 > 0 ? std::sqrt(s.delta2 / s.ref2) : 0.0;
    report.requantized.push_back(st);
  }
  model.drop_lora();
  return report;
}

AttachedAdapter attach_peft_adapter(const fs::path& adapter_dir, const fs::path& base_dir,
                                    CausalLM& model) {
  std::error_code ec;
  MOE_CHECK(fs::is_directory(adapter_dir, ec), "{}: no such adapter directory (a PEFT adapter "
            "directory holds {} and {})", adapter_dir.string(), kAdapterConfigFile,
            kAdapterWeightsFile);
  AttachedAdapter out;
  out.settings = read_peft_adapter_config(adapter_dir);
  model.add_lora(out.settings, 0, (adapter_dir / kAdapterConfigFile).string());
  // Every tensor of the file must have been used.
  const std::set<std::string> used = load_peft_adapter_weights(
      adapter_dir, model.lora_params(), model.config().n_routed_experts);
  const fs::path file = adapter_dir / kAdapterWeightsFile;
  const SafetensorsReader reader(file);
  for (const SafetensorsEntry& e : reader.entries())
    MOE_CHECK(used.contains(e.name),
              "{}: tensor '{}' adapts no module of the base model {} (the adapter was made for "
              "another model, e.g. one with more layers, or its {} targets other modules)",
              file.string(), e.name, base_dir.string(), kAdapterConfigFile);
  if (fs::is_regular_file(adapter_dir / kBaseModelFile, ec)) {
    try {
      check_base_model(adapter_dir, base_dir, base_model_fingerprint(base_dir));
    } catch (const Error& e) {
      out.base_mismatch = e.what();
    }
  }
  return out;
}

ModelConfig config_for_adapter(const ModelConfig& base, const fs::path& adapter_dir,
                               std::string* note) {
  ModelConfig cfg = base;
  std::error_code ec;
  if (!fs::is_regular_file(adapter_dir / kHfConfigFile, ec)) return cfg;
  const ModelConfig trained = read_hf_config(adapter_dir / kHfConfigFile);
  if (trained.expert_format == base.expert_format || base.n_routed_experts == 0) return cfg;
  const std::string file = (adapter_dir / kHfConfigFile).string();
  if (trained.mxfp4_experts()) {
    cfg.expert_format = "mxfp4";
    cfg.validate(file);
    if (note)
      *note = fmt::format("the adapter was trained with MXFP4 routed experts ({} has "
                          "quantization_config): the base's fp32 experts are quantized on load, "
                          "as during the fine-tune", file);
  } else if (note) {
    *note = fmt::format("warning: the adapter was trained with {} routed experts ({}), but the "
                        "base's are MXFP4: the result is not the fine-tuned model", trained.expert_format,
                        file);
  }
  return cfg;
}

void round_experts_through_mxfp4(const ParamList& params) {
  for (Param* p : params) {
    if (p->format != ParamFormat::F32 || !is_routed_expert_param(p->name)) continue;
    MOE_CHECK(p->value.ndim() == 2 && p->value.dim(1) % mxfp4::kBlock == 0,
              "round_experts_through_mxfp4: '{}' is {}; MXFP4 needs [out, in] with in divisible "
              "by 32", p->name, shape_str(p->value.shape()));
    const int64_t rows = p->value.dim(0), cols = p->value.dim(1);
    parallel_for(0, rows, [&](int64_t r) {
      std::vector<uint8_t> packed(static_cast<size_t>(cols / 2)),
          scales(static_cast<size_t>(cols / mxfp4::kBlock));
      float* row = p->w() + r * cols;
      mxfp4::quantize_row(row, cols, packed.data(), scales.data());
      mxfp4::dequantize_row(packed.data(), scales.data(), cols, row);
    });
  }
}

void load_weights_decoding_experts(const fs::path& model_dir, const ParamList& params) {
  const SafetensorsSet weights(model_dir);
  struct Packed {
    Param* param;
    const SafetensorsReader* data;
    const SafetensorsReader* scales;
  };
  std::vector<Packed> packed;
  ParamList rest;
  for (Param* p : params) {
    const SafetensorsReader* reader =
        p->format == ParamFormat::F32 && is_routed_expert_param(p->name) ? weights.find(p->name)
                                                                           : nullptr;
    const SafetensorsEntry* e = reader ? &reader->entry(p->name) : nullptr;
    if (e == nullptr || (e->dtype != "I8" && e->dtype != "U8")) {
      rest.push_back(p);
      continue;
    }
    const std::string file = reader->path().string();
    MOE_CHECK(p->value.ndim() == 2 && p->value.dim(1) % mxfp4::kBlock == 0,
              "internal: expert weight '{}' is not [out, in] with in divisible by 32", p->name);
    const int64_t rows = p->value.dim(0), cols = p->value.dim(1);
    MOE_CHECK(e->shape == (Shape{rows, cols / 2}),
              "{}: packed tensor '{}' has shape {}, the model expects {} ([out, in/2] bytes)",
              file, p->name, shape_str(e->shape), shape_str({rows, cols / 2}));
    const std::string scale = scale_name_of(p->name);
    const SafetensorsReader* sreader = weights.find(scale);
    MOE_CHECK(sreader != nullptr, "{}: MXFP4 weight '{}' has no scale tensor '{}' in {}", file,
              p->name, scale, model_dir.string());
    const SafetensorsEntry& se = sreader->entry(scale);
    MOE_CHECK((se.dtype == "F8_E8M0" || se.dtype == "U8") &&
                  se.shape == (Shape{rows, cols / mxfp4::kBlock}),
              "{}: scale tensor '{}' is {} {}, expected F8_E8M0 {}", sreader->path().string(),
              scale, se.dtype, shape_str(se.shape), shape_str({rows, cols / mxfp4::kBlock}));
    packed.push_back({p, reader, sreader});
  }
  load_weights(weights, rest);  // checks the rest before touching any value
  for (const Packed& k : packed) {
    const int64_t rows = k.param->value.dim(0), cols = k.param->value.dim(1);
    const SafetensorsEntry& e = k.data->entry(k.param->name);
    const SafetensorsEntry& se = k.scales->entry(scale_name_of(k.param->name));
    std::vector<uint8_t> bytes(static_cast<size_t>(cols / 2)), scales(static_cast<size_t>(cols / mxfp4::kBlock));
    for (int64_t r = 0; r < rows; ++r) {
      k.data->read_bytes(e, r * (cols / 2), cols / 2, bytes.data());
      k.scales->read_bytes(se, r * (cols / mxfp4::kBlock), cols / mxfp4::kBlock, scales.data());
      mxfp4::dequantize_row(bytes.data(), scales.data(), cols, k.param->w() + r * cols);
    }
  }
}

}  // namespace moe
