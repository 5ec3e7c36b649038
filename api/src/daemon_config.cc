#include "src/daemon_config.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace sparsekv {
namespace {

using nlohmann::json;

constexpr const char* kDefaultConfig = R"({
  "model": "deepseek-v3.2-exp",
  "kv_format": "fp8",
  "block_tokens": 128,
  "l1_bytes": 1073741824,
  "listen": "127.0.0.1:7420",
  "unix_socket": "sparsekvd.sock",
  "data_dir": "./var",
  "log_level": "info"
})";

template <typename T>
Status Read(const json& j, const char* key, T& out, const char* expected) {
  auto it = j.find(key);
  if (it == j.end()) return Status::OK();
  bool ok = false;
  if constexpr (std::is_same_v<T, std::string>) {
    ok = it->is_string();
  } else {
    ok = it->is_number_unsigned() || (it->is_number_integer() && it->template get<int64_t>() >= 0);
    if (ok && it->template get<uint64_t>() > std::numeric_limits<T>::max()) ok = false;
  }
  if (!ok) return Status::InvalidArgument(fmt::format("config key '{}' is {}; expected {}", key, it->dump(), expected));
  out = it->template get<T>();
  return Status::OK();
}

}  // namespace

const char* EmbeddedDefaultConfigJson() { return kDefaultConfig; }

Result<DaemonConfig> ParseDaemonConfig(const std::string& json_text) {
  json j = json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::InvalidArgument("config: not a JSON object");
  static const char* kKeys[] = {"model", "kv_format", "block_tokens", "l1_bytes", "listen", "unix_socket",
                                "data_dir", "log_level"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : kKeys) known = known || it.key() == k;
    if (!known) return Status::InvalidArgument(fmt::format("config: unknown key '{}'", it.key()));
  }
  DaemonConfig c;
  SPARSEKV_RETURN_IF_ERROR(Read(j, "model", c.model, "a preset name or spec path"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "kv_format", c.kv_format, "bf16, c8 or fp8"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "block_tokens", c.block_tokens, "a positive integer"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "l1_bytes", c.l1_bytes, "a byte count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "listen", c.listen, "HOST:PORT"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "unix_socket", c.unix_socket, "a path"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "data_dir", c.data_dir, "a directory"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "log_level", c.log_level, "trace, debug, info, warn or error"));
  return c;
}

Result<DaemonConfig> LoadDaemonConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(fmt::format("cannot open config file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = ParseDaemonConfig(ss.str());
  if (!c.ok()) return c.status().WithContext(path);
  return c;
}

std::string DaemonConfigToJson(const DaemonConfig& c) {
  json j{{"model", c.model},         {"kv_format", c.kv_format},     {"block_tokens", c.block_tokens},
         {"l1_bytes", c.l1_bytes},   {"listen", c.listen},           {"unix_socket", c.unix_socket},
         {"data_dir", c.data_dir},   {"log_level", c.log_level}};
  return j.dump();
}

}  // namespace sparsekv
