// Options every model-aware subcommand shares: --model / --spec, --kv-format, --block-tokens.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "sparsekv/model_spec.h"
#include "sparsekv/tier.h"

namespace sparsekv::cli {

struct ModelOptions {
  std::string model = "deepseek-v3.2-exp";
  std::string spec_file;
  std::string kv_format = "bf16";
  uint32_t block_tokens = 128;
  CLI::Option* kv_format_option = nullptr;

  void AddTo(CLI::App* app);
  // The preset at the asked precision, or the spec file (whose formats are its own).
  Result<ModelSpec> Load() const;
};

// Prints "sparsekv: <message>" to stderr and returns the exit code for a failed command.
int Fail(const Status& status);

// --rounds and --round-seconds, as every interleaved benchmark takes them.
void AddRoundOptions(CLI::App* cmd, int& rounds, double& round_seconds);

// --durability (none, fdatasync or dsync) into `text`; ParseDurabilityOption turns it into the
// tier setting, or prints the error and sets `exit_code` (false).
void AddDurabilityOption(CLI::App* cmd, std::string& text);
bool ParseDurabilityOption(const std::string& text, Durability& out, int& exit_code);

}  // namespace sparsekv::cli
