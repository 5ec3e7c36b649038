#include "cli/model_options.h"

#include <fmt/format.h>

#include <cstdio>

namespace sparsekv::cli {

void ModelOptions::AddTo(CLI::App* app) {
  app->add_option("--model", model, "Model preset: deepseek-v3.2-exp or deepseek-v4-flash")
      ->capture_default_str();
  app->add_option("--spec", spec_file, "JSON model spec file (instead of --model)")->check(CLI::ExistingFile);
  kv_format_option = app->add_option("--kv-format", kv_format,
                                     "Storage of MLA latent / compressed KV and indexer keys: bf16, c8 or fp8")
                         ->capture_default_str();
  app->add_option("--block-tokens", block_tokens, "Tokens per block (a multiple of every ratio)")
      ->capture_default_str();
}

Result<ModelSpec> ModelOptions::Load() const {
  if (!spec_file.empty()) {
    if (kv_format_option && kv_format_option->count() > 0) {
      return Status::InvalidArgument("--kv-format applies to presets; a spec file names its own formats");
    }
    return LoadModelSpecFile(spec_file);
  }
  SPARSEKV_ASSIGN_OR_RETURN(KvPrecision p, ParseKvPrecision(kv_format));
  return ModelPreset(model, p);
}

int Fail(const Status& status) {
  std::fprintf(stderr, "sparsekv: %s\n", status.ToString().c_str());
  return 1;
}

void AddRoundOptions(CLI::App* cmd, int& rounds, double& round_seconds) {
  cmd->add_option("--rounds", rounds, "Measured rounds per method")->check(CLI::Range(1, 1000))->capture_default_str();
  cmd->add_option("--round-seconds", round_seconds, "Seconds per round")
      ->check(CLI::Range(0.001, 60.0))
      ->capture_default_str();
}

void AddDurabilityOption(CLI::App* cmd, std::string& text) {
  cmd->add_option("--durability", text, "none, fdatasync or dsync")->capture_default_str();
}

bool ParseDurabilityOption(const std::string& text, Durability& out, int& exit_code) {
  auto d = ParseDurability(text);
  if (!d.ok()) {
    exit_code = Fail(d.status().WithContext("--durability"));
    return false;
  }
  out = *d;
  return true;
}

bool ParseSimdPathOption(const std::string& text, std::optional<SimdPath>& out, int& exit_code) {
  if (!text.empty()) {
    auto p = ParseSimdPath(text);
    if (!p.ok()) {
      exit_code = Fail(p.status());
      return false;
    }
    out = *p;
  } else if (auto env = SimdPathFromEnvironment(); !env.ok() && !env.status().Is(StatusCode::kNotFound)) {
    exit_code = Fail(env.status());
    return false;
  }
  return true;
}

const nlohmann::json* ReportBench(const Result<nlohmann::json>& r, bool json, int& exit_code) {
  if (!r.ok()) {
    exit_code = Fail(r.status());
    return nullptr;
  }
  if (json) {
    std::printf("%s\n", r->dump(2).c_str());
    return nullptr;
  }
  return &*r;
}

}  // namespace sparsekv::cli
