// Training: configuration parsing and errors, the learning-rate schedule, a short run
// that learns, bitwise-exact resume, non-finite step handling, crash-safe checkpoints, and the
// `moe train` / `moe sample` command lines.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "model/model.h"
#include "train/adamw.h"
#include "train/checkpoint_state.h"
#include "train/lr_schedule.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace moe;
using namespace moe::testing;
namespace fs = std::filesystem;

namespace {

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

// Small, repetitive English: a few templates over a few words, so a tiny model can learn a lot
// of it in a few hundred steps.
std::string tiny_corpus() {
  const char* subjects[] = {"the cat", "the dog", "a bird", "my friend"};
  const char* verbs[] = {"sat on", "looked at", "ran to", "slept by"};
  const char* objects[] = {"the mat.", "the house.", "the old tree.", "the red door."};
  Rng rng(5);
  std::string text;
  for (int i = 0; i < 400; ++i) {
    text += subjects[rng.next_u64() % 4];
    text += ' ';
    text += verbs[rng.next_u64() % 4];
    text += ' ';
    text += objects[rng.next_u64() % 4];
    text += (i % 8 == 7) ? "\n" : " ";
  }
  return text;
}

std::string tiny_toml(const fs::path& dir, int64_t steps) {
  return fmt::format(R"(
[model]
preset = "debug"
[data]
path = "{}"
seq_len = 32
batch_size = 4
val_fraction = 0.05
[optimizer]
lr = 3e-3
[schedule]
steps = {}
warmup_steps = 5
min_lr = 3e-4
[checkpoint]
keep_last = 3
[logging]
progress = "none"
[run]
seed = 11
out_dir = "{}"
)",
                     (dir / "corpus.txt").string(), steps, (dir / "run").string());
}

TrainConfig tiny_config(const fs::path& dir, int64_t steps,
                        const std::vector<ConfigOverride>& overrides = {}) {
  if (!fs::exists(dir / "corpus.txt")) write_file(dir / "corpus.txt", tiny_corpus());
  return parse_train_config(tiny_toml(dir, steps), "test", overrides);
}

struct Command {
  int status;
  std::string output;  // stdout and stderr
};

Command run_moe(const std::string& args) {
  const std::string cmd = std::string(MOE_BINARY_DIR) + "/moe --threads 2 " + args + " 2>&1";
  const moe::testing::CommandResult r = moe::testing::run_command(cmd);
  return {r.status, r.output};
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

// ---------------------------------------------------------------- configuration

TEST(TrainConfig, FileOverridesAndRoundTrip) {
  const TrainConfig c = parse_train_config(
      "[optimizer]\nlr = 1\n[data]\npath = [\"a\", \"b\"]\n[model]\npreset = \"debug\"\n"
      "num_hidden_layers = 2\n",
      "test", {{"optimizer.weight_decay", "0.25"}, {"model.n_routed_experts", "4"},
               {"schedule.decay", "constant"}});
  EXPECT_EQ(c.optimizer.lr, 1.0);  // an integer is a fine number
  EXPECT_EQ(c.optimizer.weight_decay, 0.25);
  EXPECT_EQ(c.data.path, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.schedule.decay, "constant");
  EXPECT_EQ(c.model.overrides["num_hidden_layers"], 2);
  EXPECT_EQ(c.model.overrides["n_routed_experts"], 4);
  EXPECT_EQ(c.data.seq_len, TrainConfig{}.data.seq_len);

  const std::string text = train_config_to_toml(c);
  const TrainConfig back = parse_train_config(text, "round trip");
  EXPECT_EQ(train_config_to_toml(back), text);
  EXPECT_EQ(back.optimizer.weight_decay, 0.25);
  EXPECT_EQ(back.model.overrides, c.model.overrides);

  // Strings with newlines, one of them leading (TOML trims a newline that opens a multi-line
  // string: fuzz_train_config found the written file reading back without it).
  const TrainConfig nl = parse_train_config(
      "[data]\njsonl_field = \"\\nfield\\n\"\n[model]\npreset = \"debug\"\nnote = \"\\n_a\\\\*\"\n",
      "newlines");
  EXPECT_EQ(nl.data.jsonl_field, "\nfield\n");
  const TrainConfig nl_back = parse_train_config(train_config_to_toml(nl), "round trip");
  EXPECT_EQ(nl_back.data.jsonl_field, "\nfield\n");
  EXPECT_EQ(nl_back.model.overrides, nl.model.overrides);
  EXPECT_EQ(nl_back.model.overrides["note"], "\n_a\\*");

  const ModelConfig m = resolve_train_model(c, 264, 256);
  EXPECT_EQ(m.num_hidden_layers, 2);
  EXPECT_EQ(m.n_routed_experts, 4);
  EXPECT_EQ(m.vocab_size, 264);
  EXPECT_EQ(m.eos_token_id, 256);
}

TEST(TrainConfig, ErrorsNameTheKeyAndWhatWasExpected) {
  auto err = [](const std::string& toml, std::vector<ConfigOverride> o = {}) {
    return error_of([&] { parse_train_config(toml, "cfg.toml", o); });
  };
  std::string e = err("[optimizer]\nlrr = 1e-3\n");
  EXPECT_NE(e.find("unknown key 'optimizer.lrr'"), std::string::npos) << e;
  EXPECT_NE(e.find("lr, beta1"), std::string::npos) << e;  // lists the valid keys
  e = err("[optimiser]\nlr = 1e-3\n");
  EXPECT_NE(e.find("unknown section [optimiser]"), std::string::npos) << e;
  e = err("[optimizer]\nlr = \"fast\"\n");
  EXPECT_NE(e.find("optimizer.lr: expected a number > 0, got \"fast\""), std::string::npos) << e;
  e = err("[data]\nseq_len = 0\n");
  EXPECT_NE(e.find("data.seq_len: expected an integer >= 1, got 0"), std::string::npos) << e;
  e = err("[data]\nval_fraction = 0.7\n");
  EXPECT_NE(e.find("data.val_fraction: expected a number in [0, 0.5)"), std::string::npos) << e;
  e = err("[logging]\nprogress = \"fancy\"\n");
  EXPECT_NE(e.find("logging.progress: expected one of"), std::string::npos) << e;
  e = err("[data]\nshuffle = 1\n");
  EXPECT_NE(e.find("data.shuffle: expected true or false"), std::string::npos) << e;
  e = err("seed = 3\n");
  EXPECT_NE(e.find("'seed' must be a section"), std::string::npos) << e;
  e = err("[run\n");
  EXPECT_NE(e.find("cfg.toml:1"), std::string::npos) << e;
  e = err("[schedule]\nmin_lr = 0.5\n", {{"optimizer.lr", "0.1"}});
  EXPECT_NE(e.find("schedule.min_lr: expected a number <= optimizer.lr (0.1), got 0.5"), std::string::npos) << e;

  e = err("", {{"optimizer.lr", "-1"}});
  EXPECT_NE(e.find("command line: optimizer.lr: expected a number > 0, got -1"), std::string::npos) << e;
  e = err("", {{"optimizer.lrr", "1"}});
  EXPECT_NE(e.find("unknown key 'optimizer.lrr'"), std::string::npos) << e;
  e = err("", {{"run.seed", "1.5"}});
  EXPECT_NE(e.find("run.seed: expected an integer >= 0"), std::string::npos) << e;
  e = error_of([] { parse_override_args({"--optimizer.lr"}); });
  EXPECT_NE(e.find("optimizer.lr: missing value"), std::string::npos) << e;
  e = error_of([] { parse_override_args({"stray"}); });
  EXPECT_NE(e.find("'stray'"), std::string::npos) << e;
  EXPECT_EQ(parse_override_args({"--a.b=3", "--c.d", "x"}).size(), 2u);
}

TEST(TrainConfig, ModelOverridesAreCheckedAgainstTheModelConfig) {
  auto model_err = [](std::vector<ConfigOverride> o) {
    return error_of([&] { resolve_train_model(parse_train_config("", "t", o), 264, 256); });
  };
  std::string e = model_err({{"model.num_layers", "3"}});
  EXPECT_NE(e.find("model.num_layers: unknown model config field"), std::string::npos) << e;
  e = model_err({{"model.num_hidden_layers", "many"}});
  EXPECT_NE(e.find("'num_hidden_layers' must be an integer"), std::string::npos) << e;
  e = model_err({{"model.vocab_size", "300"}});
  EXPECT_NE(e.find("model.vocab_size: set by the tokenizer"), std::string::npos) << e;
  e = model_err({{"data.seq_len", "4096"}});
  EXPECT_NE(e.find("data.seq_len: expected an integer <= model.max_position_embeddings"), std::string::npos) << e;
  e = model_err({{"model.preset", "no-such-model"}});
  EXPECT_NE(e.find("no-such-model"), std::string::npos) << e;
}

// ---------------------------------------------------------------- schedule

TEST(LrSchedule, WarmupThenCosineToMin) {
  const LrSchedule s{1.0, 0.1, 10, 110, true};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(10 + 99 / 2), 0.55, 0.01);
  EXPECT_DOUBLE_EQ(s.at(109), 0.1);
  for (int64_t i = 11; i < 110; ++i) EXPECT_LE(s.at(i), s.at(i - 1));
  const LrSchedule flat{1.0, 0.1, 0, 50, false};
  EXPECT_DOUBLE_EQ(flat.at(49), 1.0);
}

// ---------------------------------------------------------------- training

TEST(Train, LossFallsWellBelowTheUnigramEntropy) {
  const fs::path dir = scratch_dir("test_train_tmp");
  TrainRequest req;
  req.config = tiny_config(dir, 150, {{"logging.val_every", "50"}});
  const TrainResult r = train(req);
  ASSERT_EQ(r.steps_done, 150);
  EXPECT_EQ(r.skipped, 0);
  EXPECT_GT(r.unigram_entropy, 2.5);
  EXPECT_LT(r.final_train_loss, 0.6 * r.unigram_entropy)
      << "train " << r.final_train_loss << " vs unigram " << r.unigram_entropy;
  EXPECT_LT(r.final_val_loss, 0.6 * r.unigram_entropy)
      << "val " << r.final_val_loss << " vs unigram " << r.unigram_entropy;

  // One metrics line per step, validation where due, expert load for both MoE layers.
  std::ifstream in(dir / "run" / "metrics.jsonl");
  std::string line;
  int lines = 0, vals = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    ++lines;
    vals += j.contains("val_loss");
    EXPECT_EQ(j["expert_load"].size(), 2u);
    EXPECT_GT(j["memory"]["current"]["weights"].get<int64_t>(), 0);
  }
  EXPECT_EQ(lines, 150);
  EXPECT_EQ(vals, 3);
  // The final checkpoint is a Hugging Face model directory.
  const fs::path ckpt = dir / "run" / "checkpoints" / "step_150";
  EXPECT_EQ(read_hf_config(ckpt).vocab_size, 264);
  EXPECT_TRUE(fs::exists(ckpt / "model.safetensors"));
  EXPECT_EQ(read_trainer_state(ckpt).step, 150);
}

// The V2/V3 debug model, and DeepSeek-V4's (mHC, CSA/HCA, hash routing, MTP; its frozen hash
// tables and indexers travel in the checkpoint without optimizer state).
class TrainResume : public ::testing::TestWithParam<const char*> {};

TEST_P(TrainResume, ResumeReproducesAnUninterruptedRunBitwise) {
  const fs::path dir = scratch_dir(std::string("test_train_tmp_") + GetParam());
  const std::vector<ConfigOverride> o = {{"checkpoint.every", "6"}, {"optimizer.grad_accum", "2"},
                                         {"optimizer.z_loss", "1e-4"}, {"model.preset", GetParam()}};
  TrainRequest full;
  full.config = tiny_config(dir, 14, o);
  full.config.run.out_dir = (dir / "full").string();
  const TrainResult a = train(full);

  TrainRequest first;
  first.config = tiny_config(dir, 14, o);
  first.config.run.out_dir = (dir / "split").string();
  first.hooks.stop_after = [](int64_t step) { return step == 6; };
  const TrainResult b = train(first);
  ASSERT_TRUE(b.stopped_early);

  TrainRequest rest;
  rest.config = first.config;
  rest.resume_from = latest_checkpoint(dir / "split" / "checkpoints");
  ASSERT_TRUE(rest.resume_from.has_value());
  EXPECT_EQ(rest.resume_from->filename(), "step_6");
  const TrainResult c = train(rest);
  EXPECT_EQ(c.first_step, 6);

  std::vector<double> joined = b.losses;
  joined.insert(joined.end(), c.losses.begin(), c.losses.end());
  EXPECT_TRUE(same_bits(joined, a.losses));
  EXPECT_EQ(c.final_val_loss, a.final_val_loss);
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_file(dir / "full/checkpoints/step_14" / f),
              read_file(dir / "split/checkpoints/step_14" / f)) << f;
  // The resumed run's metrics read as one run: 14 lines, steps 1..14.
  std::ifstream in(dir / "split" / "metrics.jsonl");
  std::string line;
  int64_t expect_step = 1;
  while (std::getline(in, line)) EXPECT_EQ(nlohmann::json::parse(line)["step"], expect_step++);
  EXPECT_EQ(expect_step, 15);
}

INSTANTIATE_TEST_SUITE_P(Presets, TrainResume, ::testing::Values("debug", "debug-v4"),
                         [](const auto& info) {
                           return std::string(info.param) == "debug" ? "V3" : "V4";
                         });

TEST(Train, CtrlCStopsAfterTheStepWithACheckpointAndResumesBitwise) {
  const fs::path dir = scratch_dir("test_train_tmp");
  TrainRequest full;
  full.config = tiny_config(dir, 8);
  full.config.run.out_dir = (dir / "full").string();
  const TrainResult a = train(full);
  EXPECT_FALSE(a.interrupted);

  for (int sig : {SIGINT, SIGTERM}) {
    const fs::path out = dir / (sig == SIGINT ? "int" : "term");
    TrainRequest first;
    first.config = tiny_config(dir, 8);
    first.config.run.out_dir = out.string();
    // The signal lands during step 4 (0-based 3): that step still finishes and is saved.
    first.hooks.before_step = [sig](int64_t step, CausalLM&) {
      if (step == 3) raise(sig);
    };
    const TrainResult b = train(first);
    EXPECT_TRUE(b.interrupted);
    EXPECT_EQ(b.steps_done, 4);
    EXPECT_EQ(b.last_checkpoint.filename(), "step_4");
    // The handlers are gone with the run: the process is back to the default actions.
    struct sigaction now = {};
    sigaction(sig, nullptr, &now);
    EXPECT_EQ(now.sa_handler, SIG_DFL);

    TrainRequest rest;
    rest.config = first.config;
    rest.resume_from = latest_checkpoint(out / "checkpoints");
    const TrainResult c = train(rest);
    std::vector<double> joined = b.losses;
    joined.insert(joined.end(), c.losses.begin(), c.losses.end());
    EXPECT_TRUE(same_bits(joined, a.losses)) << "signal " << sig;
  }
}

TEST(Train, NonFiniteStepsAreSkippedThenStopTheRun) {
  const fs::path dir = scratch_dir("test_train_tmp");
  TrainRequest req;
  req.config = tiny_config(dir, 20, {{"checkpoint.every", "2"}, {"optimizer.max_nonfinite_steps", "2"}});
  float saved = 0;
  req.hooks.before_step = [&](int64_t step, CausalLM& model) {
    // The final norm: every token's logits go through it.
    float* w = nullptr;
    for (Param* p : model.params())
      if (p->name == "model.norm.weight") w = p->w();
    if (step == 2) saved = w[0], w[0] = std::numeric_limits<float>::quiet_NaN();  // one bad step
    if (step == 3) w[0] = saved;
    if (step >= 5) w[0] = std::numeric_limits<float>::infinity();  // from here on, every step
  };
  const std::string e = error_of([&] { train(req); });
  EXPECT_NE(e.find("3 consecutive steps"), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer.max_nonfinite_steps = 2"), std::string::npos) << e;
  EXPECT_NE(e.find("step_4"), std::string::npos) << e;

  // The checkpoint due after the failed step 6 was postponed, so the last one is the good
  // state of step 4 and it resumes.
  const fs::path last = *latest_checkpoint(dir / "run" / "checkpoints");
  EXPECT_EQ(last.filename(), "step_4");
  DeepSeekModel model(read_hf_config(last));
  load_weights(last, model.params());
  for (const Param* p : model.params())
    for (int64_t i = 0; i < p->value.numel(); ++i) ASSERT_TRUE(std::isfinite(p->w()[i])) << p->name;
  TrainRequest again;
  again.config = tiny_config(dir, 8);
  again.resume_from = last;
  EXPECT_EQ(train(again).steps_done, 8);
}

TEST(Checkpoint, KilledWriteLeavesThePreviousCheckpointLoadable) {
  const fs::path dir = scratch_dir("test_train_tmp");
  TrainRequest req;
  req.config = tiny_config(dir, 4, {{"checkpoint.every", "2"}});
  train(req);
  const fs::path ckpts = dir / "run" / "checkpoints";
  const fs::path step4 = ckpts / "step_4";
  const std::string weights_before = read_file(step4 / "model.safetensors");

  // Rebuild the training state in this process, then let a child write checkpoint 6 and die
  // by SIGKILL halfway: after the weights, before the optimizer state and trainer.json.
  const ModelConfig mc = read_hf_config(step4);
  DeepSeekModel model(mc);
  load_weights(step4, model.params());
  AdamW opt(model.trainable_params(), {});
  load_optimizer_state(step4, opt);
  TrainerState st = read_trainer_state(step4);
  st.step = 6;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(30);  // never outlive the test
    save_checkpoint(ckpts, mc, model.params(), opt, st, /*keep_last=*/1, [](const std::string& f) {
      if (f == "model.safetensors") raise(SIGKILL);
    });
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

  // The half-written checkpoint is invisible; the previous one is intact and complete.
  EXPECT_EQ(*latest_checkpoint(ckpts), step4);
  bool leftover = false;
  for (const auto& e : fs::directory_iterator(ckpts))
    leftover |= e.path().filename().string().rfind(".tmp-step_6", 0) == 0;
  EXPECT_TRUE(leftover);
  EXPECT_EQ(read_file(step4 / "model.safetensors"), weights_before);
  DeepSeekModel reloaded(read_hf_config(step4));
  load_weights(step4, reloaded.params());
  AdamW opt2(reloaded.trainable_params(), {});
  load_optimizer_state(step4, opt2);
  EXPECT_EQ(opt2.steps(), 4);

  // Resuming works and the next save clears the debris.
  TrainRequest resume;
  resume.config = tiny_config(dir, 6, {{"checkpoint.every", "2"}});
  resume.resume_from = step4;
  EXPECT_EQ(train(resume).steps_done, 6);
  for (const auto& e : fs::directory_iterator(ckpts))
    EXPECT_EQ(e.path().filename().string().rfind(".tmp", 0), std::string::npos) << e.path();
  EXPECT_TRUE(fs::exists(ckpts / "step_6" / kTrainerStateFile));

  // Saving step 6 again (here from the step-4 weights) swaps the new copy in whole: step_6 holds
  // it, and no second copy is left behind.
  const std::string trained6 = read_file(ckpts / "step_6" / "model.safetensors");
  save_checkpoint(ckpts, mc, model.params(), opt, st, /*keep_last=*/1, {});
  EXPECT_EQ(read_file(ckpts / "step_6" / "model.safetensors"), weights_before);
  EXPECT_NE(trained6, weights_before);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(ckpts)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"step_6"});
}

TEST(Train, ModelWeightsStartTheRunFromASavedModel) {
  const fs::path dir = scratch_dir("test_train_tmp");
  const std::vector<ConfigOverride> o = {{"data.shuffle", "false"}};
  // run.seed picks the initial weights (and the shuffle, off here): a seed-99 run...
  TrainRequest seeded;
  seeded.config = tiny_config(dir, 3, o);
  seeded.config.run.seed = 99;
  seeded.config.run.out_dir = (dir / "seeded").string();
  const TrainResult a = train(seeded);
  // ...is repeated bit for bit by a seed-7 run that starts from seed-99 weights on disk.
  const ModelConfig mc = resolve_train_model(seeded.config, 264, 256);
  DeepSeekModel init(mc);
  init.init_weights(99);
  save_model(dir / "init", mc, init.params());
  TrainRequest loaded;
  loaded.config = tiny_config(dir, 3, o);
  loaded.config.run.out_dir = (dir / "loaded").string();
  loaded.config.model.weights = (dir / "init").string();
  const TrainResult b = train(loaded);
  EXPECT_TRUE(same_bits(a.losses, b.losses));

  // A resume takes the weights from its checkpoint: the start directory may be gone.
  fs::rename(dir / "init", dir / "init-moved");
  TrainRequest more;
  more.config = loaded.config;
  more.config.schedule.steps = 4;
  more.resume_from = latest_checkpoint(dir / "loaded" / "checkpoints");
  EXPECT_EQ(train(more).steps_done, 4);

  loaded.config.model.weights = (dir / "nowhere").string();
  loaded.config.run.out_dir = (dir / "loaded2").string();
  const std::string e = error_of([&] { train(loaded); });
  EXPECT_NE(e.find("model.weights: "), std::string::npos) << e;
  EXPECT_NE(e.find("not a model directory"), std::string::npos) << e;
}

TEST(Train, ExpertParallelSizeMustDivideTheRanks) {
  const fs::path dir = scratch_dir("test_train_tmp");
  TrainRequest req;
  req.config = tiny_config(dir, 2, {{"parallel.ep", "2"}});
  const std::string e = error_of([&] { train(req); });
  EXPECT_NE(e.find("parallel.ep = 2: the expert-parallel size must divide the number of ranks (1)"),
            std::string::npos) << e;
  EXPECT_NE(error_of([&] { tiny_config(dir, 2, {{"parallel.ep", "0"}}); }).find("parallel.ep"),
            std::string::npos);
}

TEST(Train, FreshRunRefusesAnOutDirWithCheckpoints) {
  const fs::path dir = scratch_dir("test_train_tmp");
  TrainRequest req;
  req.config = tiny_config(dir, 2);
  train(req);
  const std::string e = error_of([&] { train(req); });
  EXPECT_NE(e.find("--resume"), std::string::npos) << e;
}

// ---------------------------------------------------------------- command lines

TEST(TrainCli, BadConfigsExitNonZeroNamingTheKey) {
  const fs::path dir = scratch_dir("test_train_tmp");
  write_file(dir / "corpus.txt", tiny_corpus());
  write_file(dir / "bad.toml", "[optimizer]\nlrr = 1e-3\n");
  Command c = run_moe("train --config " + (dir / "bad.toml").string());
  EXPECT_NE(c.status, 0);
  EXPECT_NE(c.output.find("optimizer.lrr"), std::string::npos) << c.output;

  write_file(dir / "ok.toml", tiny_toml(dir, 2));
  c = run_moe("train --config " + (dir / "ok.toml").string() + " --optimizer.lr -3");
  EXPECT_NE(c.status, 0);
  EXPECT_NE(c.output.find("optimizer.lr: expected a number > 0"), std::string::npos) << c.output;
  c = run_moe("train --config " + (dir / "ok.toml").string() + " --model.num_layers 2");
  EXPECT_NE(c.status, 0);
  EXPECT_NE(c.output.find("model.num_layers"), std::string::npos) << c.output;

  write_file(dir / "tiny.txt", "too short");
  c = run_moe("train --config " + (dir / "ok.toml").string() + " --data.path " +
              (dir / "tiny.txt").string());
  EXPECT_NE(c.status, 0);
  EXPECT_NE(c.output.find("tiny.txt"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("fewer than one sequence"), std::string::npos) << c.output;
}

TEST(TrainCli, TrainResumeAndSample) {
  const fs::path dir = scratch_dir("test_train_tmp");
  write_file(dir / "corpus.txt", tiny_corpus());
  write_file(dir / "ok.toml", tiny_toml(dir, 4));
  const std::string cfg = "train --config " + (dir / "ok.toml").string();
  Command c = run_moe(cfg + " --schedule.steps 3 --logging.progress lines");
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("step 3/3"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("unigram baseline"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("MFU is against the "), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("GFLOP/s fp32 FMA peak"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("| MFU "), std::string::npos) << c.output;
  for (const char* name : {"loss.svg", "expert_load.svg", "summary.md"})
    EXPECT_TRUE(fs::exists(dir / "run" / "report" / name)) << name;
  EXPECT_NE(read_file(dir / "run" / "metrics.jsonl").find("\"mfu\":"), std::string::npos);
  EXPECT_NE(read_file(dir / "run" / "metrics.jsonl").find("\"fma_peak_gflops\":"), std::string::npos);
  EXPECT_NE(read_file(dir / "run" / "report" / "summary.md").find("GFLOP/s fp32 FMA peak"),
            std::string::npos);
  c = run_moe(cfg + " --resume");
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("resumed from"), std::string::npos) << c.output;
  const fs::path ckpt = dir / "run" / "checkpoints" / "step_4";
  ASSERT_TRUE(fs::exists(ckpt / kTrainerStateFile));
  // Without --config, a resume runs under the configuration saved in the checkpoint.
  c = run_moe("train --resume " + (dir / "run").string() + " --schedule.steps 5");
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / "step_5"));

  const std::string sample = "sample --model " + ckpt.string() +
                             " --prompt 'the cat' --max-tokens 12 --temperature 0.8 --seed 3 --quiet";
  const Command s1 = run_moe(sample), s2 = run_moe(sample);
  ASSERT_EQ(s1.status, 0) << s1.output;
  EXPECT_EQ(s1.output.rfind("the cat", 0), 0u) << s1.output;
  EXPECT_EQ(s1.output, s2.output);
}

TEST(TrainCli, BpeTokenizerTrainsAndTravelsWithTheCheckpoint) {
  const fs::path dir = scratch_dir("test_train_tmp");
  write_file(dir / "corpus.txt", tiny_corpus());
  write_file(dir / "ok.toml", tiny_toml(dir, 3));
  const fs::path tok = dir / "tokenizer.json";
  Command c = run_moe("tokenizer train --data " + (dir / "corpus.txt").string() +
                      " --vocab-size 300 --out " + tok.string());
  ASSERT_EQ(c.status, 0) << c.output;
  ASSERT_TRUE(fs::exists(tok));
  c = run_moe("train --config " + (dir / "ok.toml").string() + " --data.tokenizer " + tok.string());
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("bpe tokenizer, 300 ids"), std::string::npos) << c.output;
  const fs::path ckpt = dir / "run" / "checkpoints" / "step_3";
  EXPECT_EQ(read_hf_config(ckpt).vocab_size, padded_vocab_size(300));
  EXPECT_EQ(read_file(ckpt / kTokenizerFile), read_file(tok));
  c = run_moe("sample --model " + ckpt.string() + " --prompt 'the cat' --max-tokens 5 --seed 1");
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_EQ(c.output.rfind("the cat", 0), 0u) << c.output;

  // Resuming under another tokenizer is refused, naming the key.
  c = run_moe("train --config " + (dir / "ok.toml").string() + " --resume --schedule.steps 4");
  EXPECT_NE(c.status, 0);
  EXPECT_NE(c.output.find("data.tokenizer"), std::string::npos) << c.output;
  c = run_moe("train --config " + (dir / "ok.toml").string() + " --data.tokenizer nosuch.json "
              "--run.out_dir " + (dir / "run2").string());
  EXPECT_NE(c.status, 0);
  EXPECT_NE(c.output.find("data.tokenizer"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("nosuch.json"), std::string::npos) << c.output;
}
