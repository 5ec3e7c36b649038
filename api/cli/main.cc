#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>

#include "cli/registry.h"
#include "progress.h"

namespace sparsekv::cli {

std::vector<CommandEntry>& TopLevelCommands() {
  static std::vector<CommandEntry> list;
  return list;
}

std::vector<CommandEntry>& BenchCommands() {
  static std::vector<CommandEntry> list;
  return list;
}

}  // namespace sparsekv::cli

int main(int argc, char** argv) {
  using namespace sparsekv::cli;
  // stdout carries results (JSON); library and in-process daemon logs go to stderr, warnings up.
  spdlog::set_default_logger(spdlog::stderr_color_mt("sparsekv"));
  spdlog::set_level(spdlog::level::warn);
  CLI::App app{"sparsekv: KV-cache manager and offload service for sparse-attention models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "sparsekv 0.1.0");
  int exit_code = 0;
  auto by_name = [](const CommandEntry& a, const CommandEntry& b) { return a.name < b.name; };
  std::sort(TopLevelCommands().begin(), TopLevelCommands().end(), by_name);
  for (const CommandEntry& c : TopLevelCommands()) c.add(app, exit_code);
  // Long commands show their progress on a terminal (bench/progress.h); the children the stress
  // commands start (hidden "-child" subcommands) share the terminal and stay quiet.
  const std::string first = argc > 1 ? argv[1] : "";
  bool progress = first == "bench" || first == "stress" || first == "replay";
  std::string command = "sparsekv " + first;
  for (int i = 2; i < argc && progress; ++i) {
    const std::string a = argv[i];
    if (a.find("-child") != std::string::npos || a == "--help" || a == "-h") progress = false;
    if (i == 2 && first != "replay" && !a.empty() && a[0] != '-') command += " " + a;
  }
  if (progress) sparsekv::bench::ProgressStart(command);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    sparsekv::bench::ProgressStop();
    return app.exit(e);
  }
  sparsekv::bench::ProgressStop();
  return exit_code;
}
