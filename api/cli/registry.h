// Subcommands register themselves from their own files, so adding one touches no shared file.
//   SPARSEKV_CLI_COMMAND(plan) { /* CLI::App& app, int& exit_code */ }
//   SPARSEKV_BENCH_COMMAND(alloc) { /* CLI::App& bench, int& exit_code */ }
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace sparsekv::cli {

using AddCommandFn = void (*)(CLI::App& parent, int& exit_code);

struct CommandEntry {
  std::string name;
  AddCommandFn add;
};

// Top-level subcommands, and subcommands of `sparsekv bench`.
std::vector<CommandEntry>& TopLevelCommands();
std::vector<CommandEntry>& BenchCommands();

struct CommandRegistration {
  CommandRegistration(std::vector<CommandEntry>& list, const char* name, AddCommandFn add) {
    list.push_back({name, add});
  }
};

}  // namespace sparsekv::cli

#define SPARSEKV_CLI_COMMAND(name)                                                              \
  static void AddCommand_##name(CLI::App& app, int& exit_code);                                 \
  static ::sparsekv::cli::CommandRegistration registration_##name(                             \
      ::sparsekv::cli::TopLevelCommands(), #name, &AddCommand_##name);                          \
  static void AddCommand_##name(CLI::App& app, int& exit_code)

#define SPARSEKV_BENCH_COMMAND(name)                                                            \
  static void AddBench_##name(CLI::App& bench, int& exit_code);                                 \
  static ::sparsekv::cli::CommandRegistration bench_registration_##name(                       \
      ::sparsekv::cli::BenchCommands(), #name, &AddBench_##name);                               \
  static void AddBench_##name(CLI::App& bench, int& exit_code)
