#include <algorithm>

#include "cli/registry.h"

namespace sparsekv::cli {

SPARSEKV_CLI_COMMAND(bench) {
  CLI::App* cmd = app.add_subcommand("bench", "Benchmarks, each against a baseline measured in the same run");
  cmd->require_subcommand(1);
  std::sort(BenchCommands().begin(), BenchCommands().end(),
            [](const CommandEntry& a, const CommandEntry& b) { return a.name < b.name; });
  for (const CommandEntry& c : BenchCommands()) c.add(*cmd, exit_code);
}

}  // namespace sparsekv::cli
