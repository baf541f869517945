// `moe plan` (train/memory_plan.h): the predicted peak of every MemoryTracker category against
// the peaks real short runs reach, for LoRA fine-tunes (MXFP4 and fp32 routed experts, dropout,
// partial targets, expert ranks) and pretraining (fp32 and MXFP4 experts, q_lora_rank, aux
// loss) of the `debug` and `small` presets and of DeepSeek-V4's `debug-v4` and `small-v4`
// (sliding-window, CSA and HCA layers, a hash layer, MTP); and the per-rank plans of
// deepseek-v3-671b and deepseek-v4-flash.
//
// Measured peaks are the tracker's right after the third optimizer step of a run (TrainHooks::
// stop_after: no validation or checkpoint in between), since the trainer's reset_peaks before
// its first step: what metrics.jsonl's "memory" records and the run summary show.
//
// Workspace (the kernels' per-thread packing buffers) is the one category that is not a pure
// function of the configuration: which thread runs which matmul is dynamic. The plan sizes it
// for the largest buffer every thread may need (skewed routing included): an upper bound the
// runs below reach to within 0-50% (at most a few hundred KiB here, under 2% of their totals).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#include "core/memory.h"
#include "core/parallel.h"
#include "io/checkpoint.h"
#include "io/model_spec.h"
#include "kernels/gemm.h"
#include "kernels/mxfp4_gemm.h"
#include "model/causal_lm.h"
#include "train/memory_plan.h"
#include "train/memory_replay.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;

namespace {

const fs::path& work_dir() {
  static const fs::path dir = [] {
    // The runs' MFU needs the FMA peak, measured (~2 s per run) whenever a loaded machine keeps
    // it from being cached; memory does not depend on it.
    setenv("MOE_FMA_PEAK", "100", /*overwrite=*/0);
    const fs::path d = fs::path(MOE_BINARY_DIR) / ("test_memory_plan_tmp" + forced_simd_suffix());
    fs::remove_all(d);
    fs::create_directories(d);
    std::ofstream pc(d / "pc.jsonl");
    for (int i = 0; i < 200; ++i)
      pc << "{\"prompt\": \"count after " << i << ":\", \"completion\": \" " << i + 1 << "\"}\n";
    std::ofstream text(d / "corpus.txt");
    for (int i = 0; i < 400; ++i) text << "the cat sat on the mat number " << i << ". ";
    return d;
  }();
  return dir;
}

// A randomly initialised base model of `preset` on disk (what `moe finetune` adapts).
fs::path base_model(const std::string& preset) {
  const fs::path dir = work_dir() / ("base-" + preset);
  if (!fs::exists(dir / "config.json")) {
    ModelConfig mc = resolve_model_config(preset);
    mc.vocab_size = std::max<int64_t>(mc.vocab_size, 264);  // the byte tokenizer's ids fit
    const std::unique_ptr<CausalLM> m = make_causal_lm(mc);
    m->init_weights(3);
    save_model(dir, mc, m->params());
  }
  return dir;
}

TrainConfig finetune_config(const std::string& preset, const std::string& experts, int64_t batch,
                            int64_t seq, const std::string& lora, const std::string& name) {
  const std::string toml = fmt::format(R"(
[model]
weights = "{}"
experts = "{}"
[data]
path = "{}"
seq_len = {}
batch_size = {}
val_fraction = 0.0
[schedule]
steps = 10
warmup_steps = 1
[logging]
progress = "none"
[run]
out_dir = "{}"
[lora]
{}
)",
                                       base_model(preset).string(), experts,
                                       (work_dir() / "pc.jsonl").string(), seq, batch,
                                       (work_dir() / name).string(), lora);
  return parse_train_config(toml, name, {}, ConfigPurpose::Finetune);
}

TrainConfig pretrain_config(const std::string& preset, const std::string& experts, int64_t batch,
                            int64_t seq, const std::string& model_extra, const std::string& name) {
  const std::string toml = fmt::format(R"(
[model]
preset = "{}"
experts = "{}"
{}
[data]
path = "{}"
seq_len = {}
batch_size = {}
val_fraction = 0.0
[schedule]
steps = 10
warmup_steps = 1
[logging]
progress = "none"
[run]
out_dir = "{}"
)",
                                       preset, experts, model_extra,
                                       (work_dir() / "corpus.txt").string(), seq, batch,
                                       (work_dir() / name).string());
  return parse_train_config(toml, name);
}

// The tracker's peaks after `steps` optimizer steps of a real run of `cfg`, as a process of its
// own would see them: the kernels' per-thread buffers live as long as their threads, so the run
// gets fresh pool workers and a fresh calling thread, and none of an earlier run's buffers.
MemSnapshot measure(const TrainConfig& cfg, int64_t steps = 3) {
  fs::remove_all(cfg.run.out_dir);
  TrainRequest req;
  req.config = cfg;
  MemSnapshot snap;
  req.hooks.stop_after = [&](int64_t done) {
    if (done < steps) return false;
    snap = MemoryTracker::instance().snapshot();
    return true;
  };
  const int threads = num_threads();
  set_num_threads(1);  // joins the workers (their buffers go with them)
  set_num_threads(threads);
  std::exception_ptr error;
  std::thread run([&] {
    try {
      train(req);
    } catch (...) {
      error = std::current_exception();
    }
  });
  run.join();
  if (error) std::rethrow_exception(error);
  return snap;
}

std::string comparison(const MemoryPlan& plan, const MemSnapshot& m) {
  std::string out = fmt::format("{:<18} {:>12} {:>12} {:>8}\n", "category", "measured", "plan",
                                "plan/m");
  for (int c = 0; c < kMemCategoryCount; ++c) {
    const int64_t a = m.peak[static_cast<size_t>(c)], p = plan.peak[static_cast<size_t>(c)];
    out += fmt::format("{:<18} {:>12} {:>12} {:>8.4f}\n", mem_category_name(static_cast<MemCategory>(c)),
                       a, p, a > 0 ? static_cast<double>(p) / static_cast<double>(a) : 0.0);
  }
  out += fmt::format("{:<18} {:>12} {:>12} {:>8.4f}\n", "total", m.total_peak(), plan.total_peak(),
                     static_cast<double>(plan.total_peak()) / static_cast<double>(m.total_peak()));
  return out;
}

// The plan's total within 5% of the measured one; the categories fixed by shapes exactly; the
// step-time ones (activations, routing, scratch) within 1% (the replay reproduces them to the
// byte today: a change in what the engine keeps for backward shows up here).
void expect_plan_matches(const TrainConfig& cfg) {
  const MemoryPlan plan = plan_training_memory(cfg, resolve_plan_model(cfg));
  const MemSnapshot m = measure(cfg);
  const std::string table = comparison(plan, m);
  std::printf("%s", table.c_str());
  const double ratio =
      static_cast<double>(plan.total_peak()) / static_cast<double>(m.total_peak());
  EXPECT_NEAR(ratio, 1.0, 0.05) << table;
  for (MemCategory c : {MemCategory::Weights, MemCategory::Grads, MemCategory::Optimizer,
                        MemCategory::AdapterWeights, MemCategory::AdapterGrads,
                        MemCategory::AdapterOptimizer})
    EXPECT_EQ(plan[c], m.peak[static_cast<size_t>(c)]) << mem_category_name(c) << "\n" << table;
  for (MemCategory c : {MemCategory::Activations, MemCategory::Routing, MemCategory::Scratch}) {
    const double measured = static_cast<double>(m.peak[static_cast<size_t>(c)]);
    EXPECT_NEAR(static_cast<double>(plan[c]), measured, 0.01 * measured)
        << mem_category_name(c) << "\n" << table;
  }
  // Workspace is planned as the bound every thread may reach (see the top of the file).
  EXPECT_GE(plan[MemCategory::Workspace], m.peak[static_cast<size_t>(MemCategory::Workspace)])
      << table;
}

}  // namespace

// ---------------------------------------------------------------- plan vs measured

TEST(MemoryPlan, DebugPretrainingFp32Experts) {
  expect_plan_matches(pretrain_config("debug", "fp32", 4, 64, "", "pre-debug-fp32"));
}

TEST(MemoryPlan, DebugPretrainingMxfp4ExpertsWithAuxLossAndQLora) {
  expect_plan_matches(pretrain_config("debug", "mxfp4", 8, 128,
                                      "q_lora_rank = 32\naux_loss_alpha = 0.01", "pre-debug-mx"));
}

TEST(MemoryPlan, DebugFinetuneDropoutExpertRankAndPartialTargets) {
  // Unadapted frozen linears, a grouped adapter on the experts' down projections only (no
  // re-gathered rows), dropout masks and row keys.
  expect_plan_matches(finetune_config(
      "debug", "mxfp4", 8, 128,
      "r = 4\ndropout = 0.1\nexpert_r = 2\ntargets = [\"q_proj\", \"kv_b_proj\", \"down_proj\"]",
      "ft-debug"));
}

TEST(MemoryPlan, SmallPretrainingFp32ExpertsWithQLoraAndAuxLoss) {
  expect_plan_matches(pretrain_config("small", "fp32", 4, 64,
                                      "q_lora_rank = 64\naux_loss_alpha = 0.01", "pre-small"));
}

TEST(MemoryPlan, SmallFinetuneMxfp4Experts) {
  // configs/finetune-small.toml's adapters (all-linear, r 8) over MXFP4 experts.
  expect_plan_matches(finetune_config("small", "mxfp4", 4, 64, "r = 8", "ft-small-mx"));
}

TEST(MemoryPlan, SmallFinetuneFp32ExpertsLargerBatchWithDropout) {
  expect_plan_matches(
      finetune_config("small", "fp32", 8, 64, "r = 16\ndropout = 0.05", "ft-small-fp32"));
}

// ---------------------------------------------------------------- DeepSeek-V4 plan vs measured
// debug-v4: layers sliding window, CSA (ratio 4, top-3 indexer), HCA (ratio 16), an MTP block
// (sliding window); layer 0 routes by hash. At 64 positions and more the indexer scores (a
// query sees more than topk entries from position 15 on), and the HCA layer has entries.

TEST(MemoryPlan, V4DebugPretrainingFp32Experts) {
  expect_plan_matches(pretrain_config("debug-v4", "fp32", 4, 64, "", "v4-pre-debug-fp32"));
}

TEST(MemoryPlan, V4DebugPretrainingMxfp4ExpertsWithAuxLoss) {
  expect_plan_matches(
      pretrain_config("debug-v4", "mxfp4", 8, 128, "aux_loss_alpha = 0.01", "v4-pre-debug-mx"));
}

TEST(MemoryPlan, V4DebugFinetuneDropoutExpertRankAndPartialTargets) {
  // Adapters on wq_a, wkv, the shared and the routed experts' down projections (no re-fetched
  // rows); wq_b, wo_b unadapted and frozen; dropout masks and row keys.
  expect_plan_matches(finetune_config(
      "debug-v4", "mxfp4", 8, 128,
      "r = 4\ndropout = 0.1\nexpert_r = 2\ntargets = [\"q_a_proj\", \"kv_proj\", \"down_proj\"]",
      "v4-ft-debug"));
}

// small-v4: window, CSA, HCA (ratio 32), CSA, then a window MTP block; top-16 indexer, so it
// scores from position 67 on.
TEST(MemoryPlan, V4SmallPretrainingFp32Experts) {
  expect_plan_matches(pretrain_config("small-v4", "fp32", 2, 128, "", "v4-pre-small"));
}

TEST(MemoryPlan, V4SmallFinetuneMxfp4Experts) {
  // configs/finetune-small.toml's adapters (all-linear, r 8) over MXFP4 experts.
  expect_plan_matches(finetune_config("small-v4", "mxfp4", 4, 128, "r = 8", "v4-ft-small-mx"));
}

TEST(MemoryPlan, V4SmallFinetuneFp32ExpertsWithDropout) {
  expect_plan_matches(
      finetune_config("small-v4", "fp32", 4, 128, "r = 16\ndropout = 0.05", "v4-ft-small-fp32"));
}

// ---------------------------------------------------------------- the plan itself

TEST(MemoryPlan, DeepSeekV3FinetunePerRank) {
  TrainConfig cfg = parse_train_config(
      "[model]\npreset = \"deepseek-v3-671b\"\nweights = \"none\"\nexperts = \"mxfp4\"\n"
      "[data]\nseq_len = 4096\nbatch_size = 8\n[lora]\nr = 8\n",
      "671b", {}, ConfigPurpose::Finetune);
  const ModelConfig mc = resolve_plan_model(cfg);
  EXPECT_EQ(mc.vocab_size, 129280);
  EXPECT_TRUE(mc.mxfp4_experts());
  const MemoryPlan one = plan_training_memory(cfg, mc, 8, 16);  // 8 ranks, EP 1
  cfg.parallel.ep = 8;
  const MemoryPlan ep8 = plan_training_memory(cfg, mc, 8, 16);
  const std::string text = format_memory_plan(ep8, "671b");
  EXPECT_NE(text.find("per rank"), std::string::npos) << text;
  EXPECT_NE(text.find("adapter_optimizer"), std::string::npos) << text;
  EXPECT_EQ(one.tokens_per_rank, 4096);
  EXPECT_EQ(ep8.local_experts, 32);
  // Routed experts, MXFP4: 58 MoE layers x 256 x 3 x 7168 x 2048 weights at 4.25 bits.
  const int64_t experts = int64_t{58} * 256 * 3 * 7168 * 2048;
  EXPECT_EQ(one[MemCategory::Weights] - ep8[MemCategory::Weights],
            (experts / 2 + experts / 32) / 8 * 7);
  // Grouped expert adapters split with the experts; adam moments are twice the adapters.
  EXPECT_LT(ep8[MemCategory::AdapterWeights], one[MemCategory::AdapterWeights] / 4);
  EXPECT_EQ(ep8[MemCategory::AdapterOptimizer], 2 * ep8[MemCategory::AdapterWeights]);
  EXPECT_EQ(one[MemCategory::Grads] + one[MemCategory::Optimizer], 0);
  // Under EP the gate/up adapters' rows are re-fetched in backward, not kept: balanced
  // routing gives every rank the same rows as at EP 1, so the activations are the same.
  EXPECT_EQ(ep8[MemCategory::Activations], one[MemCategory::Activations]);
  std::printf("%s", format_memory_plan(one, "671b, 8 ranks, EP 1").c_str());
  std::printf("%s", text.c_str());
}

TEST(MemoryPlan, DeepSeekV4FlashFinetunePerRank) {
  TrainConfig cfg = parse_train_config(
      "[model]\npreset = \"deepseek-v4-flash\"\nweights = \"none\"\nexperts = \"mxfp4\"\n"
      "[data]\nseq_len = 4096\nbatch_size = 8\n[lora]\nr = 8\n",
      "flash", {}, ConfigPurpose::Finetune);
  const ModelConfig mc = resolve_plan_model(cfg);
  ASSERT_TRUE(mc.is_v4());
  EXPECT_TRUE(mc.mxfp4_experts());
  const MemoryPlan one = plan_training_memory(cfg, mc, 8, 16);  // 8 ranks, EP 1
  cfg.parallel.ep = 8;
  const MemoryPlan ep8 = plan_training_memory(cfg, mc, 8, 16);
  const std::string text = format_memory_plan(ep8, "flash");
  for (const char* s : {"per rank", "adapter_optimizer", "CSA indexer's picks of 21 layers",
                        "MTP block", "RoPE cos/sin tables"})
    EXPECT_NE(text.find(s), std::string::npos) << s << "\n" << text;
  EXPECT_EQ(one.tokens_per_rank, 4096);
  EXPECT_EQ(ep8.local_experts, 32);
  // Routed experts, MXFP4: 43 layers + the MTP block, 256 x 3 x 4096 x 2048 weights at 4.25 bits.
  const int64_t experts = int64_t{44} * 256 * 3 * 4096 * 2048;
  EXPECT_EQ(one[MemCategory::Weights] - ep8[MemCategory::Weights],
            (experts / 2 + experts / 32) / 8 * 7);
  // Grouped expert adapters split with the experts (the MTP block has none).
  EXPECT_LT(ep8[MemCategory::AdapterWeights], one[MemCategory::AdapterWeights] / 4);
  EXPECT_EQ(ep8[MemCategory::AdapterOptimizer], 2 * ep8[MemCategory::AdapterWeights]);
  EXPECT_EQ(one[MemCategory::Grads] + one[MemCategory::Optimizer], 0);
  // Balanced routing: every rank's experts compute as many rows as at EP 1.
  EXPECT_EQ(ep8[MemCategory::Activations], one[MemCategory::Activations]);
  // Skewed routing moves the MoE activations with it.
  const MemoryPlan skewed = plan_training_memory(cfg, mc, 8, 16, 2.0);
  EXPECT_EQ(skewed.expert_rows_per_rank, 2 * ep8.expert_rows_per_rank);
  EXPECT_GT(skewed[MemCategory::Activations], ep8[MemCategory::Activations]);
  std::printf("%s", format_memory_plan(one, "deepseek-v4-flash, 8 ranks, EP 1").c_str());
  std::printf("%s", text.c_str());
}

TEST(MemoryPlan, ErrorsNameTheKey) {
  const TrainConfig cfg = pretrain_config("small", "fp32", 6, 32, "", "err");
  const ModelConfig mc = resolve_plan_model(cfg);
  EXPECT_NE(error_of([&] { plan_training_memory(cfg, mc, 4); }).find("data.batch_size = 6"),
            std::string::npos);
  TrainConfig ep = cfg;
  ep.parallel.ep = 4;
  EXPECT_NE(error_of([&] { plan_training_memory(ep, mc, 2); }).find("parallel.ep = 4"),
            std::string::npos);
  ep.parallel.ep = 3;
  ep.data.batch_size = 3;
  EXPECT_NE(error_of([&] { plan_training_memory(ep, mc, 3); }).find("16 routed experts"),
            std::string::npos);
  TrainConfig ft = finetune_config("debug", "auto", 2, 16, "targets = [\"nothing_proj\"]", "err2");
  EXPECT_NE(error_of([&] { plan_training_memory(ft, resolve_plan_model(ft)); })
                .find("nothing_proj"),
            std::string::npos);
  // V4's adapters follow DeepSeekV4Model::add_lora's rules, refusals included.
  TrainConfig v4 = finetune_config("debug-v4", "auto", 2, 16, "targets = [\"o_a_proj\"]", "err3");
  EXPECT_NE(error_of([&] { plan_training_memory(v4, resolve_plan_model(v4)); })
                .find("self_attn.o_a_proj (released attn.wo_a), which LoRA cannot adapt"),
            std::string::npos);
  v4 = finetune_config("debug-v4", "auto", 2, 16, "targets = [\"gate_proj\"]", "err4");
  EXPECT_NE(error_of([&] { plan_training_memory(v4, resolve_plan_model(v4)); })
                .find("select both (e.g. targets gate_proj and up_proj) or neither"),
            std::string::npos);
}

// `moe plan` prints the plan of DeepSeek-V4-Flash for a LoRA fine-tune at EP 8, one sequence of
// 4096 tokens per rank.
TEST(MemoryPlan, CliPrintsTheV4FlashPlan) {
  const std::string moe = std::string(MOE_BINARY_DIR) + "/moe";
  ASSERT_TRUE(fs::exists(moe)) << moe;
  const std::string cmd = moe + " --threads 8 plan --config " + MOE_SOURCE_DIR +
                          "/configs/finetune-small.toml --model deepseek-v4-flash "
                          "--model.experts mxfp4 --data.batch_size 8 --data.seq_len 4096 "
                          "--ranks 8 --ep 8 2>&1";
  const moe::testing::CommandResult run = moe::testing::run_command(cmd);
  const std::string& out = run.output;
  EXPECT_EQ(run.status, 0) << out;
  for (const char* s : {"per rank", "deepseek-v4-flash", "adapter_optimizer", "32 of 256", "total",
                        "CSA indexer"})
    EXPECT_NE(out.find(s), std::string::npos) << s << "\n" << out;
  std::printf("%s", out.c_str());
}

// `moe plan` prints the plan of the real DeepSeek-V3 for a fine-tune at EP 8.
TEST(MemoryPlan, CliPrintsThe671bPlan) {
  const std::string moe = std::string(MOE_BINARY_DIR) + "/moe";
  ASSERT_TRUE(fs::exists(moe)) << moe;
  const std::string cmd = moe + " --threads 8 plan --config " + MOE_SOURCE_DIR +
                          "/configs/finetune-small.toml --model deepseek-v3-671b "
                          "--model.experts mxfp4 --data.batch_size 8 --data.seq_len 4096 "
                          "--ranks 8 --ep 8 2>&1";
  const moe::testing::CommandResult run = moe::testing::run_command(cmd);
  const std::string& out = run.output;
  EXPECT_EQ(run.status, 0) << out;
  for (const char* s : {"per rank", "deepseek-v3-671b", "adapter_optimizer", "32 of 256", "total"})
    EXPECT_NE(out.find(s), std::string::npos) << s << "\n" << out;
}

// The plan's Workspace asks the kernels what a call requests (kernels/kernel_scratch.h); that
// report must be what the call really allocates. A fresh thread owns no scratch, so what the
// tracker's Workspace grows by during its one call is that call's request (rounded to 16 floats).
namespace {

int64_t workspace_of_one_call(const std::function<void()>& call) {
  int64_t grown = 0;
  std::thread t([&] {
    const int64_t before = MemoryTracker::instance().current(MemCategory::Workspace);
    call();
    grown = MemoryTracker::instance().current(MemCategory::Workspace) - before;
  });
  t.join();
  return grown;
}

int64_t bytes_of(ScratchFloats s) {
  const auto r16 = [](int64_t f) { return (f + 15) / 16 * 16; };
  return 4 * (r16(s.slot0) + r16(s.slot1));
}

}  // namespace

TEST(KernelScratch, ReportsAreWhatCallsAllocate) {
  const int64_t rows = 40, cols = 1024, max_m = 512;
  std::vector<uint8_t> packed(rows * cols / 2, 0x21), scales(rows * cols / 32, 127);
  const Mxfp4Matrix w{packed.data(), scales.data(), rows, cols, cols / 2, cols / 32};
  std::vector<float> in(max_m * cols, 0.5f), out(max_m * cols);
  for (int64_t m : {1, 2, 3, 4, 5, 8, 9, 16, 31, 32, 33, 64, 100, 512}) {
    EXPECT_EQ(workspace_of_one_call([&] {
                mxfp4_gemm_nt(m, in.data(), cols, w, out.data(), rows, false);
              }),
              bytes_of(mxfp4_gemm_nt_scratch_floats(m)))
        << "nt, m = " << m;
    EXPECT_EQ(workspace_of_one_call([&] {
                mxfp4_gemm_nn(m, in.data(), rows, w, out.data(), cols, false);
              }),
              bytes_of(mxfp4_gemm_nn_scratch_floats(m, rows, cols)))
        << "nn, m = " << m;
  }
  // The fp32 GEMM's serial forms: the skinny nt path, one K block, several, and K in slices
  // with a remainder.
  struct Shape {
    int64_t M, N, K;
  };
  for (const Shape s : {Shape{3, 100, 50}, Shape{64, 320, 256}, Shape{20, 64, 1000},
                        Shape{16, 64, 9000}}) {
    std::vector<float> a(s.M * s.K, 0.25f), b(s.N * s.K, 0.5f), c(s.M * s.N);
    EXPECT_EQ(workspace_of_one_call([&] {
                gemm_nt_serial(s.M, s.N, s.K, a.data(), s.K, b.data(), s.K, c.data(), s.N, false);
              }),
              bytes_of(gemm_scratch_floats(GemmLayout::NT, s.M, s.N, s.K, /*serial=*/true)))
        << "nt " << s.M << " x " << s.N << " x " << s.K;
    EXPECT_EQ(workspace_of_one_call([&] {
                gemm_nn_serial(s.M, s.N, s.K, a.data(), s.K, b.data(), s.N, c.data(), s.N, false);
              }),
              bytes_of(gemm_scratch_floats(GemmLayout::NN, s.M, s.N, s.K, /*serial=*/true)))
        << "nn " << s.M << " x " << s.N << " x " << s.K;
  }
  // A weight gradient over many tokens on two threads packs A once for both, in slot 0 after
  // packed B. Whether the calling thread also takes a task (and so its slot 1) is up to the
  // schedule; the pool's other thread already holds its slot 1 from the first call.
  const int threads = num_threads();
  set_num_threads(2);
  const int64_t M = 256, N = 320, K = 2048;
  std::vector<float> a(M * K, 0.25f), b(N * K, 0.5f), c(M * N);
  auto tn = [&] { gemm_tn(M, N, K, a.data(), M, b.data(), N, c.data(), N, true); };
  tn();
  const ScratchFloats report = gemm_scratch_floats(GemmLayout::TN, M, N, K, /*serial=*/false);
  EXPECT_GE(report.slot0, N * K + M * K) << "packed B and A";
  const int64_t grown = workspace_of_one_call(tn);
  EXPECT_GE(grown, bytes_of({report.slot0, 0}));
  EXPECT_LE(grown, bytes_of(report));
  set_num_threads(threads);
}

// An expert's calls have any row count up to the largest, and a smaller one can ask for more
// (a 3-row tile's x panel on AVX-512): the plan covers every count.
TEST(KernelScratch, PlanCoversEveryRowCountOfAnExpert) {
  const int64_t rows = 704, cols = 1024;  // W of an expert's down projection, nn
  memory_replay::Workspace plan;
  plan.mxfp4_nt(512);
  plan.mxfp4_nn(512, rows, cols);
  for (int64_t m = 1; m <= 512; ++m)
    for (const ScratchFloats s :
         {mxfp4_gemm_nt_scratch_floats(m), mxfp4_gemm_nn_scratch_floats(m, rows, cols)}) {
      memory_replay::Workspace with_call = plan;
      with_call.on_any_thread(s);
      EXPECT_EQ(with_call.bytes(2), plan.bytes(2)) << "a call of " << m << " rows needs more";
    }
}
