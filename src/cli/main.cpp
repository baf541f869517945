#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"moe: DeepSeek-style Mixture-of-Experts engine"};
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const moe::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
