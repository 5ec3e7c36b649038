#include <cstdio>
#include <memory>

#include "cli/registry.h"
#include "cli/model_options.h"
#include "sparsekv/block_geometry.h"

namespace sparsekv::cli {

SPARSEKV_CLI_COMMAND(spec) {
  CLI::App* cmd = app.add_subcommand("spec", "Model specs: list presets, print or check a spec");
  cmd->require_subcommand(1);

  cmd->add_subcommand("presets", "List the built-in model presets")->callback([] {
    for (const std::string& n : ModelPresetNames()) std::printf("%s\n", n.c_str());
  });

  auto show = std::make_shared<ModelOptions>();
  CLI::App* show_cmd = cmd->add_subcommand("show", "Print a preset or spec file as a JSON spec");
  show->AddTo(show_cmd);
  show_cmd->callback([show, &exit_code] {
    auto spec = show->Load();
    if (!spec.ok()) {
      exit_code = Fail(spec.status());
      return;
    }
    std::printf("%s\n", ModelSpecToJson(*spec).c_str());
  });

  auto check = std::make_shared<ModelOptions>();
  CLI::App* check_cmd = cmd->add_subcommand("check", "Validate a spec and its block geometry");
  check->AddTo(check_cmd);
  check_cmd->callback([check, &exit_code] {
    auto spec = check->Load();
    if (!spec.ok()) {
      exit_code = Fail(spec.status());
      return;
    }
    auto geo = ComputeBlockGeometry(*spec, check->block_tokens);
    if (!geo.ok()) {
      exit_code = Fail(geo.status());
      return;
    }
    std::printf("%s: %zu layers, %zu page pools, %llu bytes per %u-token block\n", spec->name.c_str(),
                spec->layers.size(), geo->pools.size(),
                static_cast<unsigned long long>(geo->BytesPerBlock()), geo->block_tokens);
  });
}

}  // namespace sparsekv::cli
