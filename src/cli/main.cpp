#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <omp.h>

#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"

int main(int argc, char** argv) {
  CLI::App app{"moe: pretrain, fine-tune and run DeepSeek-style Mixture-of-Experts models"};
  app.require_subcommand(1);
  int threads = omp_get_num_procs();
  app.add_option("--threads", threads, "worker threads (results are identical for any count)")
      ->check(CLI::PositiveNumber);
  app.parse_complete_callback([&] { moe::set_num_threads(threads); });
  moe::cli::add_info_command(app);
  moe::cli::add_logits_command(app);
  moe::cli::add_train_command(app);
  moe::cli::add_sample_command(app);
  moe::cli::add_report_command(app);
  moe::cli::add_tokenizer_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const moe::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
