// sparsekvd. Until the server lands (the daemon issue), it loads and logs its effective
// configuration, plans the L1 pools of its model and exits.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <filesystem>

#include "sparsekv/memory_planner.h"
#include "sparsekv/model_spec.h"
#include "src/daemon_config.h"

int main(int argc, char** argv) {
  using namespace sparsekv;
  CLI::App app{"sparsekvd: the sparsekv cache daemon"};
  std::string config_path, listen, unix_path, data_dir;
  app.add_option("--config", config_path, "JSON config file (default: the embedded configuration)")
      ->check(CLI::ExistingFile);
  app.add_option("--listen", listen, "TCP address HOST:PORT");
  app.add_option("--unix", unix_path, "Unix socket path");
  app.add_option("--data-dir", data_dir, "Data directory");
  CLI11_PARSE(app, argc, argv);

  auto config = config_path.empty() ? ParseDaemonConfig(EmbeddedDefaultConfigJson())
                                    : LoadDaemonConfigFile(config_path);
  if (!config.ok()) {
    spdlog::error("{}", config.status().ToString());
    return 2;
  }
  if (!listen.empty()) config->listen = listen;
  if (!unix_path.empty()) config->unix_socket = unix_path;
  if (!data_dir.empty()) config->data_dir = data_dir;
  spdlog::set_level(spdlog::level::from_str(config->log_level));
  spdlog::info("sparsekvd 0.1.0 effective options: {}", DaemonConfigToJson(*config));

  std::error_code ec;
  std::filesystem::create_directories(config->data_dir, ec);
  if (ec) {
    spdlog::error("cannot create data dir '{}': {}", config->data_dir, ec.message());
    return 2;
  }
  auto precision = ParseKvPrecision(config->kv_format);
  Result<ModelSpec> spec = precision.ok() ? ModelPreset(config->model, *precision) : Result<ModelSpec>(precision.status());
  if (!spec.ok() && std::filesystem::exists(config->model)) spec = LoadModelSpecFile(config->model);
  if (!spec.ok()) {
    spdlog::error("{}", spec.status().ToString());
    return 2;
  }
  auto plan = PlanForBudget(*spec, config->block_tokens, config->l1_bytes);
  if (!plan.ok()) {
    spdlog::error("{}", plan.status().ToString());
    return 2;
  }
  std::fputs(MemoryPlanToTable(*plan).c_str(), stdout);
  spdlog::warn("the network server is not built yet (daemon issue); exiting after the plan");
  return 0;
}
