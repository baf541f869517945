#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/simd.h"
#include "parallel/communicator.h"

namespace {

// All cores, shared between the ranks mpirun starts on this machine.
int default_threads() {
  int local_ranks = 1;
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local_ranks = std::max(1, std::atoi(v));
  return std::max(1, moe::available_cpus() / local_ranks);
}

}  // namespace

int main(int argc, char** argv) {
  // A file growing past `ulimit -f` raises SIGXFSZ, whose default action kills the process
  // with no word of which file; ignored, the write fails with EFBIG instead, and the writer
  // reports it like any other I/O error (naming the file, the previous checkpoint untouched).
  std::signal(SIGXFSZ, SIG_IGN);
  // Before any thread exists (MPI_THREAD_FUNNELED); only under mpirun, so one process needs no MPI.
  std::optional<moe::MpiRuntime> mpi;
  if (moe::MpiRuntime::launched_by_mpirun()) mpi.emplace(&argc, &argv);
  CLI::App app{"moe: pretrain, fine-tune and run DeepSeek-style Mixture-of-Experts models"};
  app.require_subcommand(1);
  int threads = default_threads();
  app.add_option("--threads", threads, "worker threads (results are identical for any count)")
      ->check(CLI::PositiveNumber);
  std::string simd_target;
  app.add_option("--simd", simd_target,
                 "SIMD target of the kernels: auto, avx512, avx2 or scalar (default: auto, or the "
                 "MOE_SIMD environment variable); results are identical on every target");
  app.parse_complete_callback([&] {
    moe::set_num_threads(threads);
    moe::simd::apply_option(simd_target, "--simd");
  });
  moe::cli::add_info_command(app);
  moe::cli::add_logits_command(app);
  moe::cli::add_train_command(app);
  moe::cli::add_finetune_command(app);
  moe::cli::add_plan_command(app);
  moe::cli::add_inspect_command(app);
  moe::cli::add_convert_command(app);
  moe::cli::add_report_command(app);
  moe::cli::add_tokenizer_command(app);
  moe::cli::add_quantize_command(app);
  moe::cli::add_merge_command(app);
  moe::cli::add_generate_command(app);
  moe::cli::add_serve_command(app);
  try {
    if (mpi) {
      // An error on one rank must end all of them (the others may wait in a collective), with
      // the cause printed: run_or_abort does both.
      return moe::run_or_abort([&] {
        try {
          app.parse(argc, argv);
        } catch (const CLI::ParseError& e) {
          return app.exit(e);
        }
        return 0;
      });
    }
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
