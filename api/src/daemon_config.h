// sparsekvd's configuration: a JSON file (or the embedded default) plus command-line overrides.
#pragma once

#include <cstdint>
#include <string>

#include "sparsekv/status.h"

namespace sparsekv {

struct DaemonConfig {
  // Model preset or a path to a JSON spec file. Default: "deepseek-v3.2-exp".
  std::string model = "deepseek-v3.2-exp";
  // bf16, c8 or fp8 (presets only). Default: "fp8".
  std::string kv_format = "fp8";
  // Tokens per block. Default: 128.
  uint32_t block_tokens = 128;
  // Bytes of host memory for the L1 page pools. Default: 1 GiB.
  uint64_t l1_bytes = 1ull << 30;
  // TCP listen address, HOST:PORT (loopback by default). Default: "127.0.0.1:7420".
  std::string listen = "127.0.0.1:7420";
  // Unix socket path, relative to data_dir unless absolute. Default: "sparsekvd.sock".
  std::string unix_socket = "sparsekvd.sock";
  // Where tiers, indexes and the socket live. Default: "./var".
  std::string data_dir = "./var";
  // spdlog level name. Default: "info".
  std::string log_level = "info";
};

// The configuration compiled into the daemon (what ./run.sh starts with).
const char* EmbeddedDefaultConfigJson();

// Parses a config; unknown keys and wrong types are errors naming the key.
Result<DaemonConfig> ParseDaemonConfig(const std::string& json_text);
Result<DaemonConfig> LoadDaemonConfigFile(const std::string& path);
std::string DaemonConfigToJson(const DaemonConfig& config);

}  // namespace sparsekv
