#pragma once
// What every model family must do for an optimizer update that runs beside its next forward
// (AdamW::start_step): wait for each layer's parameters before reading them, and give the same
// bits as an update run to completion first.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "model/causal_lm.h"
#include "test_util.h"
#include "train/adamw.h"

namespace moe::testing {

// Records the order in which a forward asks for parameters.
class RecordingUpdate : public PendingUpdate {
 public:
  bool running() const override { return true; }
  void wait_for(const ParamList& params) override {
    for (const Param* p : params) waited.push_back(p);
  }
  void wait_all() override {
    if (!whole_asked) waited_before_whole = waited.size();
    whole_asked = true;
  }
  std::vector<const Param*> waited;
  size_t waited_before_whole = 0;
  bool whole_asked = false;
};

// The layer of a parameter named `<layer_prefix>N.…`, or -1.
inline int layer_of(const std::string& name, const std::string& layer_prefix) {
  if (name.rfind(layer_prefix, 0) != 0) return -1;
  return std::atoi(name.c_str() + layer_prefix.size());
}

// Without adapters: the embedding first, then every layer's trainable parameters, layer by
// layer, all before the whole update is asked for (ahead of the final norm and the head).
// With adapters the whole update is waited for before anything is read.
inline void expect_forward_waits_layer_by_layer(CausalLM& model, const std::string& embedding,
                                                const std::string& layer_prefix, int64_t vocab) {
  RecordingUpdate rec;
  model.set_pending_update(&rec);
  const BatchShape shape{2, 9};
  model.forward(random_tokens(shape.tokens(), vocab, 1), random_tokens(shape.tokens(), vocab, 2),
                shape, Pass::Train);
  model.backward();
  model.set_pending_update(nullptr);
  ASSERT_TRUE(rec.whole_asked) << "the forward never waited for the whole update";
  if (model.has_lora()) {
    EXPECT_EQ(rec.waited_before_whole, 0u) << "adapters are read before the update is done";
    return;
  }
  ASSERT_FALSE(rec.waited.empty());
  EXPECT_EQ(rec.waited.front()->name, embedding);
  const std::set<const Param*> before(rec.waited.begin(),
                                      rec.waited.begin() + static_cast<std::ptrdiff_t>(rec.waited_before_whole));
  int last_layer = -1;
  for (size_t i = 0; i < rec.waited_before_whole; ++i) {
    const int l = layer_of(rec.waited[i]->name, layer_prefix);
    if (l < 0) continue;
    EXPECT_GE(l, last_layer) << rec.waited[i]->name << " waited for after layer " << last_layer;
    last_layer = l;
  }
  for (const Param* p : model.trainable_params()) {
    if (layer_of(p->name, layer_prefix) < 0 && p->name != embedding) continue;
    EXPECT_TRUE(before.count(p)) << p->name << " is read before the update is asked for it";
  }
}

// Loss, gradients and weights of `steps` steps whose update runs beside the next forward
// (start_step, gradients zeroed by the update), or to completion before it (step, zero_grads).
inline std::vector<float> train_with_update(CausalLM& model, bool beside, int steps, int64_t vocab) {
  AdamW opt(model.trainable_params(), AdamWConfig{});
  if (beside) model.set_pending_update(&opt);
  const BatchShape shape{2, 19};
  std::vector<float> bits;
  for (int step = 0; step < steps; ++step) {
    const LossResult r = model.forward(random_tokens(shape.tokens(), vocab, 40 + step),
                                       random_tokens(shape.tokens(), vocab, 50 + step), shape,
                                       Pass::Train);
    model.backward();
    bits.push_back(static_cast<float>(r.total()));
    for (Param* p : model.trainable_params()) bits.insert(bits.end(), p->g(), p->g() + p->grad.numel());
    model.update_router_biases(1e-3);
    if (beside) {
      opt.start_step(1e-3, 0.75f);
    } else {
      opt.step(1e-3, 0.75f);
      model.zero_grads();
    }
  }
  opt.finish();
  model.set_pending_update(nullptr);
  for (Param* p : model.trainable_params()) {
    bits.insert(bits.end(), p->w(), p->w() + p->value.numel());
    for (int64_t i = 0; i < p->grad.numel(); ++i)
      if (p->g()[i] != 0.0f) {
        ADD_FAILURE() << p->name << ": a gradient the update did not zero";
        break;
      }
  }
  return bits;
}

}  // namespace moe::testing
