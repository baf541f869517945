// `moe train` under expert parallelism (issue 4): the trainer over W ranks at every EP size
// that divides W against one process on the same global batches; checkpoints written by the
// ranks together (resumed bitwise at the same world size, and by one process); a validation
// split whose tail leaves some ranks without sequences (it would hang without the global-min
// rule: ctest's TIMEOUT fails it); Hugging Face weights loaded rank by rank without reading
// other ranks' experts. Run by ctest without mpirun and under mpirun at 1, 2 and 4 ranks.
//
// Tolerances: losses within 1e-6 relative of one process. Non-expert gradients are sums over
// ranks of per-rank partial sums, re-associated at rank boundaries, so the last bits differ.
//
// Collectives must line up on every rank: no ASSERT between collectives.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/memory.h"
#include "core/rng.h"
#include "parallel/communicator.h"
#include "parallel/ep_training.h"
#include "io/checkpoint.h"
#include "io/model_spec.h"
#include "model/model.h"
#include "mpi_test_main.h"
#include "test_util.h"
#include "train/checkpoint_state.h"
#include "train/evaluation.h"
#include "train/trainer.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;

namespace {

// One directory for all ranks (rank 0 clears it), per world size and launcher so runs never
// collide (ctest runs the plain binary and `mpirun -np 1` at the same time; mpirun sets
// OMPI_COMM_WORLD_SIZE).
fs::path shared_dir(const std::string& name) {
  const std::string launcher = std::getenv("OMPI_COMM_WORLD_SIZE") ? "mpirun_np" : "alone_np";
  const fs::path dir = fs::path(MOE_BINARY_DIR) / "test_dist_train_tmp" /
                       (launcher + std::to_string(g_world->size())) / name;
  if (g_world->rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  g_world->barrier();
  return dir;
}

// A private directory of this rank (for single-process reference runs).
fs::path rank_dir(const fs::path& shared) {
  const fs::path dir = shared / ("rank" + std::to_string(g_world->rank()));
  fs::create_directories(dir);
  return dir;
}

std::string corpus_text() {
  static const char* words[] = {"the", "lord", "said", "unto", "moses", "and", "aaron", "land",
                                "of", "egypt", "went", "out", "people", "israel", "day"};
  Rng rng(5);
  std::string text;
  for (int i = 0; i < 1500; ++i) {
    text += words[rng.next_u64() % 15];
    text += (i % 11 == 10) ? ".\n" : " ";
  }
  return text;
}

// The debug preset (8 routed experts, top-2, one dense layer) with the aux loss on, so its
// cross-rank scaling is exercised too.
// A fine-tune (ConfigPurpose::Finetune) takes its model from `extra`'s model.weights instead.
TrainConfig tiny_config(const fs::path& dir, int64_t steps, const fs::path& out,
                        const std::vector<ConfigOverride>& extra = {},
                        ConfigPurpose purpose = ConfigPurpose::Pretrain) {
  if (g_world->rank() == 0 && !fs::exists(dir / "corpus.txt"))
    write_text(dir / "corpus.txt", corpus_text());
  g_world->barrier();
  std::vector<ConfigOverride> o = {{"data.path", (dir / "corpus.txt").string()}};
  if (purpose == ConfigPurpose::Pretrain)
    o.insert(o.end(), {{"model.preset", "debug"}, {"model.aux_loss_alpha", "0.01"}});
  o.insert(o.end(), {
                                   {"data.seq_len", "32"},
                                   {"data.batch_size", "8"},
                                   {"data.val_fraction", "0.1"},
                                   {"optimizer.lr", "3e-3"},
                                   {"optimizer.grad_accum", "2"},
                                   {"optimizer.z_loss", "1e-4"},
                                   {"schedule.steps", std::to_string(steps)},
                                   {"schedule.warmup_steps", "2"},
                                   {"checkpoint.every", "3"},
                                   {"checkpoint.keep_last", "5"},
                                   {"logging.progress", "none"},
                                   {"logging.val_every", "3"},
                                   {"run.seed", "7"},
                                   {"run.out_dir", out.string()}});
  o.insert(o.end(), extra.begin(), extra.end());
  return parse_train_config("", "test", o, purpose);
}

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1e-30, std::abs(b[i])));
  return worst;
}

std::vector<int> ep_sizes() {
  std::vector<int> out;
  for (int e : {1, 2, 4})
    if (g_world->size() % e == 0) out.push_back(e);
  return out;
}

TEST(DistTrain, EveryEpSizeMatchesOneProcessOnTheSameBatches) {
  const fs::path dir = shared_dir("match");
  TrainRequest ref;
  ref.config = tiny_config(dir, 6, rank_dir(dir) / "ref");
  const TrainResult want = train(ref);  // this rank alone

  for (int e : ep_sizes()) {
    TrainRequest req;
    req.config = tiny_config(dir, 6, dir / ("ep" + std::to_string(e)),
                             {{"parallel.ep", std::to_string(e)}});
    req.world = g_world;
    const TrainResult got = train(req);
    const double loss_err = max_rel_diff(got.losses, want.losses);
    const double val_err = std::abs(got.final_val_loss - want.final_val_loss) / want.final_val_loss;
    std::printf("[ W %d EP %d ] worst loss rel diff %.3g, validation %.3g\n", g_world->size(), e,
                loss_err, val_err);
    EXPECT_LE(loss_err, 1e-6) << "EP " << e;
    EXPECT_LE(val_err, 1e-6) << "EP " << e;
    EXPECT_EQ(got.steps_done, 6);
    EXPECT_EQ(got.tokens_seen, want.tokens_seen);
    EXPECT_EQ(routing_bytes(), 0);

    // At EP > 1 the checkpoint is a sharded Hugging Face model: one shard of non-expert
    // tensors plus one per expert shard, and the moments split the same way.
    const fs::path ckpt = dir / ("ep" + std::to_string(e)) / "checkpoints" / "step_6";
    if (g_world->rank() == 0) {
      const int shards_on_disk = e == 1 || g_world->size() == 1 ? 0 : e + 1;
      int model_files = 0, expert_moment_files = 0;
      for (const auto& f : fs::directory_iterator(ckpt)) {
        const std::string n = f.path().filename().string();
        model_files += n.rfind("model-", 0) == 0;
        expert_moment_files += n.rfind("optimizer-experts-", 0) == 0;
      }
      EXPECT_EQ(model_files, shards_on_disk);
      EXPECT_EQ(expert_moment_files, shards_on_disk == 0 ? 0 : e);
      // One process loads it whole: every expert is somewhere in the index.
      DeepSeekModel whole(resolve_model_config(ckpt.string()));
      load_weights(ckpt, whole.params());
    }
  }
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// Trains `steps` steps in this process alone, then on every rank at each EP size the world
// allows (output in dir/ep<e>); each run's losses and validation loss must equal the single
// process's within 1e-6. Calls check(e, result) after each EP run.
void train_at_every_ep_size(const fs::path& dir, int64_t steps,
                            const std::vector<ConfigOverride>& overrides, const std::string& label,
                            const std::function<void(int, const TrainResult&)>& check,
                            ConfigPurpose purpose = ConfigPurpose::Pretrain) {
  TrainRequest ref;
  ref.config = tiny_config(dir, steps, rank_dir(dir) / "ref", overrides, purpose);
  const TrainResult want = train(ref);
  EXPECT_LT(want.losses.back(), want.losses.front()) << label;
  for (int e : ep_sizes()) {
    std::vector<ConfigOverride> o = overrides;
    o.push_back({"parallel.ep", std::to_string(e)});
    TrainRequest req;
    req.config = tiny_config(dir, steps, dir / ("ep" + std::to_string(e)), o, purpose);
    req.world = g_world;
    const TrainResult got = train(req);
    const double err = max_rel_diff(got.losses, want.losses);
    std::printf("[ W %d EP %d, %s ] worst loss rel diff %.3g\n", g_world->size(), e,
                label.c_str(), err);
    EXPECT_LE(err, 1e-6) << "EP " << e << ", " << label;
    // NaN on both sides when the data leaves no validation split (a fine-tune's one text).
    if (!(std::isnan(got.final_val_loss) && std::isnan(want.final_val_loss))) {
      EXPECT_LE(std::abs(got.final_val_loss - want.final_val_loss) / want.final_val_loss, 1e-6);
    }
    EXPECT_EQ(routing_bytes(), 0);
    check(e, got);
  }
}

TEST(DistTrain, FrozenMxfp4ExpertsGiveTheSameLossesAtEveryEpSize) {
  std::vector<double> ep1;
  train_at_every_ep_size(
      shared_dir("mxfp4"), 4, {{"model.experts", "mxfp4"}}, "MXFP4 experts",
      [&](int e, const TrainResult& got) {
        // On the same ranks, how the frozen experts are split changes no bit: the dispatch moves
        // rows exactly, the experts see the same rows in the same order, and every gradient that
        // exists (non-expert) is reduced over the same ranks in the same order.
        if (e == 1) ep1 = got.losses;
        EXPECT_TRUE(got.losses.size() == ep1.size() &&
                    std::memcmp(got.losses.data(), ep1.data(), ep1.size() * sizeof(double)) == 0)
            << "EP " << e << " vs EP 1 on " << g_world->size() << " ranks";
      });
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// DeepSeek-V4 through the same trainer (CausalLM): mHC streams, CSA/HCA layers, a hash-routed
// layer and MTP, with fp32 and with frozen MXFP4 experts. Every EP size gives one process's
// losses, and the sharded checkpoint loads whole into one process.
TEST(DistTrain, DeepSeekV4MatchesOneProcessAtEveryEpSize) {
  for (const char* experts : {"fp32", "mxfp4"}) {
    const fs::path dir = shared_dir(std::string("v4_") + experts);
    train_at_every_ep_size(
        dir, 4, {{"model.preset", "debug-v4"}, {"model.aux_loss_alpha", "0"},
                 {"model.experts", experts}},
        std::string("V4, ") + experts + " experts", [&](int e, const TrainResult&) {
          if (g_world->rank() != 0) return;
          const fs::path ckpt = dir / ("ep" + std::to_string(e)) / "checkpoints" / "step_4";
          const std::unique_ptr<CausalLM> whole =
              make_causal_lm(resolve_model_config(ckpt.string()));
          load_weights(ckpt, whole->params());
        });
  }
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// LoRA over DeepSeek-V4 with frozen MXFP4 experts (attention, shared and routed expert
// adapters, dropout): every EP size gives one process's losses, and the adapter is written once.
TEST(DistTrain, DeepSeekV4LoraOverMxfp4ExpertsMatchesOneProcessAtEveryEpSize) {
  const fs::path dir = shared_dir("v4_lora");
  const fs::path base = dir / "base";
  TrainRequest pre;  // tiny_config is collective: every rank builds it, rank 0 trains
  pre.config = tiny_config(dir, 2, base, {{"model.preset", "debug-v4"},
                                          {"model.aux_loss_alpha", "0"}});
  if (g_world->rank() == 0) train(pre);
  g_world->barrier();
  train_at_every_ep_size(
      dir, 4,
      {{"model.weights", (base / "checkpoints" / "step_2").string()},
       {"model.experts", "mxfp4"}, {"lora.r", "4"}, {"lora.expert_r", "2"},
       {"lora.dropout", "0.1"}, {"optimizer.lr", "1e-2"}},
      "V4 LoRA over MXFP4 experts",
      [&](int e, const TrainResult&) {
        if (g_world->rank() != 0) return;
        const fs::path ckpt = dir / ("ep" + std::to_string(e)) / "checkpoints" / "step_4";
        EXPECT_TRUE(fs::exists(ckpt / "adapter_model.safetensors")) << ckpt;
      },
      ConfigPurpose::Finetune);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(DistTrain, ResumeAtTheSameWorldSizeIsBitwiseAndOneProcessCanContinue) {
  const fs::path dir = shared_dir("resume");
  const int e = g_world->size();  // one copy of each expert (1 process: EP 1)
  const std::vector<ConfigOverride> ep = {{"parallel.ep", std::to_string(e)}};

  TrainRequest full;
  full.config = tiny_config(dir, 6, dir / "full", ep);
  full.world = g_world;
  const TrainResult a = train(full);

  TrainRequest first;
  first.config = tiny_config(dir, 6, dir / "split", ep);
  first.world = g_world;
  first.hooks.stop_after = [](int64_t step) { return step == 3; };
  const TrainResult b = train(first);
  EXPECT_TRUE(b.stopped_early);

  TrainRequest rest;
  rest.config = first.config;
  rest.world = g_world;
  rest.resume_from = dir / "split" / "checkpoints" / "step_3";
  const TrainResult c = train(rest);
  EXPECT_EQ(c.first_step, 3);
  std::vector<double> joined = b.losses;
  joined.insert(joined.end(), c.losses.begin(), c.losses.end());
  EXPECT_EQ(joined.size(), a.losses.size());
  EXPECT_TRUE(joined.size() == a.losses.size() &&
              std::memcmp(joined.data(), a.losses.data(), joined.size() * sizeof(double)) == 0)
      << "a resumed run must repeat the uninterrupted one bit for bit";
  EXPECT_EQ(c.final_val_loss, a.final_val_loss);
  if (g_world->rank() == 0) {
    for (const auto& f : fs::directory_iterator(dir / "full" / "checkpoints" / "step_6")) {
      const std::string n = f.path().filename().string();
      if (n == kTrainerStateFile) continue;  // names the run's out_dir
      EXPECT_EQ(read_file(f.path()), read_file(dir / "split" / "checkpoints" / "step_6" / n)) << n;
    }
  }

  // The ranks' checkpoint is an ordinary one: a single process (EP 1) continues from it, reading
  // every expert and every expert's moments from their shards, on the same global batches.
  TrainRequest alone;
  alone.config = tiny_config(dir, 6, rank_dir(dir) / "alone", {{"parallel.ep", "1"}});
  alone.resume_from = dir / "full" / "checkpoints" / "step_3";
  const TrainResult d = train(alone);
  const std::vector<double> tail(a.losses.begin() + 3, a.losses.end());
  const double err = max_rel_diff(d.losses, tail);
  std::printf("[ W %d ] one process resuming the ranks' checkpoint: loss rel diff %.3g\n",
              g_world->size(), err);
  EXPECT_LE(err, 1e-6);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

PackedSequences random_sequences(int64_t n, int64_t seq, int64_t vocab, uint64_t seed) {
  Tensor t = random_tokens(n * seq + 1, vocab, seed);
  return PackedSequences(std::vector<int32_t>(t.i32(), t.i32() + t.numel()), seq);
}

TEST(DistTrain, UnevenValidationShardsEndTogether) {
  const int w = g_world->size(), rank = g_world->rank();
  const ModelConfig cfg = resolve_model_config("debug");
  const int64_t batch = 2 * w;
  const ExpertParallelGroups groups =
      make_expert_parallel_groups(g_world, w, cfg.n_routed_experts, "ep");
  DeepSeekModel ep(cfg, make_dispatcher(groups));
  ep.init_weights(9);
  DeepSeekModel one(cfg);
  one.init_weights(9);

  // Two full global batches and one sequence more: in the third only rank 0 has a sequence;
  // the others join its forward with an ignored one, so every sequence counts, as alone.
  const PackedSequences data = random_sequences(2 * batch + 1, 16, cfg.vocab_size, 33);
  const double got = evaluate(ep, data, batch, 0, *g_world);
  const double want = evaluate(one, data, batch, 0);
  EXPECT_LE(std::abs(got - want) / want, 1e-6) << got << " vs " << want;
  EXPECT_LE(std::abs(evaluate(ep, data, batch, 1, *g_world) - evaluate(one, data, batch, 1)) /
                want, 1e-6);
  // Fewer sequences than ranks: still a number, not NaN.
  const PackedSequences tiny = random_sequences(1, 16, cfg.vocab_size, 34);
  const double got_tiny = evaluate(ep, tiny, batch, 0, *g_world);
  EXPECT_LE(std::abs(got_tiny - evaluate(one, tiny, batch, 0)) / got_tiny, 1e-6);

  // Shards of different lengths (rank r holds r + 1 global batches): without the per-batch
  // minimum, rank 1 would start a second forward (an all-to-all) that rank 0 never joins and
  // hang; ctest's TIMEOUT turns that into a failure. With it, all stop after one batch.
  const PackedSequences mine = random_sequences((rank + 1) * batch, 16, cfg.vocab_size, 40);
  const PackedSequences first_batch = random_sequences(batch, 16, cfg.vocab_size, 40);
  const double uneven = evaluate(ep, mine, batch, 0, *g_world);
  double agreed = uneven;
  g_world->all_reduce_sum(&agreed, 1);
  EXPECT_EQ(agreed, uneven * w) << "every rank reports the same validation loss";
  // Every rank's first batch is the same here (same seed, a prefix), so it is one process's.
  EXPECT_LE(std::abs(uneven - evaluate(one, first_batch, batch, 0)) / uneven, 1e-6);
  EXPECT_EQ(routing_bytes(), 0);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(DistTrain, HuggingFaceWeightsLoadRankByRankWithoutOtherExperts) {
  const fs::path dir = shared_dir("hf");
  const int w = g_world->size();
  const ModelConfig cfg = resolve_model_config("debug");
  if (g_world->rank() == 0) {
    DeepSeekModel full(cfg);
    full.init_weights(21);
    save_model(dir / "model", cfg, full.params(), DType::F32, /*max_shard_bytes=*/200000);
  }
  g_world->barrier();

  const ExpertParallelGroups groups =
      make_expert_parallel_groups(g_world, w, cfg.n_routed_experts, "ep");
  DeepSeekModel ep(cfg, make_dispatcher(groups));
  ep.init_weights(22);  // other values, so loading must change them
  MemoryTracker& mem = MemoryTracker::instance();
  const int64_t before = mem.snapshot().total_current();
  mem.reset_peaks();
  load_weights(dir / "model", ep.params());
  // Read straight into this rank's tensors: nothing else was allocated, not even briefly.
  EXPECT_EQ(mem.snapshot().total_peak(), before);
  EXPECT_EQ(mem.snapshot().total_current(), before);

  DeepSeekModel reference(cfg);
  reference.init_weights(21);
  std::map<std::string, const Param*> by_name;
  for (const Param* p : reference.params()) by_name[p->name] = p;
  int64_t experts = 0;
  bool equal = true;
  for (const Param* p : ep.params()) {
    experts += is_routed_expert_param(p->name);
    const Param* q = by_name.at(p->name);
    equal = equal && std::memcmp(p->w(), q->w(), sizeof(float) * static_cast<size_t>(
                                                     p->value.numel())) == 0;
  }
  EXPECT_TRUE(equal);
  EXPECT_EQ(experts, static_cast<int64_t>(ep.moe_layers().size()) * 3 * cfg.n_routed_experts / w);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

TEST(DistTrain, ParallelSettingsAreCheckedOnEveryRank) {
  const fs::path dir = shared_dir("bad");
  const int w = g_world->size();
  auto error_for = [&](const std::vector<ConfigOverride>& o) {
    TrainRequest req;
    req.config = tiny_config(dir, 2, dir / "run", o);
    req.world = g_world;
    return error_of([&] { train(req); });
  };
  // Every rank fails the same check before any collective, so nothing hangs.
  EXPECT_NE(error_for({{"parallel.ep", "3"}}).find("parallel.ep = 3"), std::string::npos);
  if (w > 1) {
    const std::string e = error_for({{"data.batch_size", std::to_string(w + 1)}});
    EXPECT_NE(e.find("data.batch_size"), std::string::npos) << e;
  }
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// The collective watchdog (parallel.collective_timeout) times waits inside collectives; the
// barriers around a checkpoint write are timed against parallel.checkpoint_timeout instead: rank 0
// writing for longer than the first limit while the others wait is slow storage, not a stall.
// (tests/fault_drills.sh stall: a real stall ends the job.) If the write were timed against the
// collective limit, the waiting ranks would _Exit(1) and the test binary would fail. The limit
// leaves room for uneven steps of ranks oversubscribed on few cores (under sanitizers too).
TEST(DistTrain, ASlowCheckpointWriteIsNotAStall) {
  if (g_world->size() == 1) GTEST_SKIP() << "one rank: the watchdog is not armed";
  const fs::path dir = shared_dir("slow_write");
  TrainRequest req;
  req.config = tiny_config(dir, 2, dir / "run",
                           {{"parallel.ep", std::to_string(g_world->size())},
                            {"parallel.collective_timeout", "3"},
                            {"parallel.checkpoint_timeout", "60"},
                            {"checkpoint.every", "1"},
                            {"logging.val_every", "0"}});
  req.world = g_world;
  bool slowed = false;
  // Called on rank 0 only, as it writes the first checkpoint's trainer.json.
  req.hooks.checkpoint_file = [&](const std::string& file) {
    if (file != kTrainerStateFile || slowed) return;
    slowed = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(6000));
  };
  const TrainResult r = train(req);
  EXPECT_EQ(r.steps_done, 2);
  EXPECT_EQ(slowed, g_world->rank() == 0);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

}  // namespace

int main(int argc, char** argv) { return moe::testing::run_mpi_tests(argc, argv); }
