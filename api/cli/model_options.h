// What the subcommands share: the model options (--model / --spec, --kv-format,
// --block-tokens), the benchmark options, and error and result reporting.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "sparsekv/cpu_features.h"
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

// --path: the named SIMD path, or (empty) none, after checking that SPARSEKV_SIMD, which
// would pick one, is valid: a benchmark must not quietly measure another path. False, with
// the error printed and `exit_code` set, otherwise.
bool ParseSimdPathOption(const std::string& text, std::optional<SimdPath>& out, int& exit_code);

// A benchmark's result: an error is printed and sets `exit_code`; with `json` the JSON is
// printed. Returns the JSON when the caller is to print its table, else nullptr.
const nlohmann::json* ReportBench(const Result<nlohmann::json>& r, bool json, int& exit_code);

}  // namespace sparsekv::cli
