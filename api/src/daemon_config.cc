#include "src/daemon_config.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>

#include "sparsekv/file_system.h"

namespace sparsekv {
namespace {

using nlohmann::json;

constexpr const char* kDefaultConfig = R"({
  "model": "deepseek-v3.2-exp",
  "kv_format": "fp8",
  "block_tokens": 128,
  "listen": "127.0.0.1:7420",
  "unix_socket": "sparsekvd.sock",
  "metrics_listen": "127.0.0.1:7421",
  "resp_listen": "127.0.0.1:6380",
  "data_dir": "./var",
  "log_level": "info",
  "busy_poll_us": 200,
  "namespaces": [{"name": "default", "token": ""}],
  "offload": {
    "write_policy": "write-back",
    "host": {"enabled": true, "capacity_bytes": "2GiB"},
    "ssd": {"enabled": true, "path": "ssd", "capacity_bytes": "8GiB", "queue_depth": 16,
            "durability": "fdatasync"}
  }
})";

template <typename T>
Status Read(const json& j, const char* key, T& out, const char* expected) {
  auto it = j.find(key);
  if (it == j.end()) return Status::OK();
  bool ok = false;
  if constexpr (std::is_same_v<T, std::string>) {
    ok = it->is_string();
  } else if constexpr (std::is_same_v<T, bool>) {
    ok = it->is_boolean();
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
  static const char* kKeys[] = {"model", "kv_format", "block_tokens", "listen", "unix_socket", "metrics_listen",
                                "resp_listen", "resp_unix_socket",
                                "data_dir", "log_level", "log_file", "io_threads", "worker_threads", "busy_poll_us",
                                "max_connections", "max_frame_bytes", "max_inflight_bytes", "idle_timeout_ms",
                                "staging_bytes", "pin_budget_bytes", "namespaces", "offload",
                                "max_buffered_bytes", "max_handshakes", "handshake_timeout_ms", "frame_timeout_ms",
                                "write_timeout_ms", "max_shared_staging_bytes", "write_leases", "write_lease_timeout_ms", "local_reads",
                                "put_in_place_bytes",
                                "max_hinted_blocks_per_session", "max_hint_ttl_ms", "kv_events"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : kKeys) known = known || it.key() == k;
    if (!known) return Status::InvalidArgument(fmt::format("config: unknown key '{}'", it.key()));
  }
  DaemonConfig c;
  SPARSEKV_RETURN_IF_ERROR(Read(j, "model", c.model, "a preset name or spec path"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "kv_format", c.kv_format, "bf16, c8 or fp8"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "block_tokens", c.block_tokens, "a positive integer"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "listen", c.listen, "HOST:PORT"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "unix_socket", c.unix_socket, "a path"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "metrics_listen", c.metrics_listen, "HOST:PORT"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "resp_listen", c.resp_listen, "HOST:PORT"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "resp_unix_socket", c.resp_unix_socket, "a path"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "data_dir", c.data_dir, "a directory"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "log_level", c.log_level, "trace, debug, info, warn or error"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "log_file", c.log_file, "a path"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "io_threads", c.io_threads, "a thread count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "worker_threads", c.worker_threads, "a thread count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "busy_poll_us", c.busy_poll_us, "microseconds"));
  if (c.busy_poll_us > 10000) return Status::InvalidArgument("config key 'busy_poll_us' must be at most 10000");
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_connections", c.max_connections, "a count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_frame_bytes", c.max_frame_bytes, "a byte count below 4 GiB"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_inflight_bytes", c.max_inflight_bytes, "a byte count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "idle_timeout_ms", c.idle_timeout_ms, "milliseconds"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "staging_bytes", c.staging_bytes, "a byte count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "pin_budget_bytes", c.pin_budget_bytes, "a byte count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_hinted_blocks_per_session", c.max_hinted_blocks_per_session, "a count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_hint_ttl_ms", c.max_hint_ttl_ms, "milliseconds"));
  if (c.max_hint_ttl_ms == 0) return Status::InvalidArgument("config key 'max_hint_ttl_ms' must be at least 1");
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_buffered_bytes", c.max_buffered_bytes, "a byte count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_handshakes", c.max_handshakes, "a count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "handshake_timeout_ms", c.handshake_timeout_ms, "milliseconds"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "frame_timeout_ms", c.frame_timeout_ms, "milliseconds"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "write_timeout_ms", c.write_timeout_ms, "milliseconds"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "max_shared_staging_bytes", c.max_shared_staging_bytes, "a byte count"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "write_leases", c.write_leases, "true or false"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "write_lease_timeout_ms", c.write_lease_timeout_ms, "milliseconds"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "local_reads", c.local_reads, "true or false"));
  SPARSEKV_RETURN_IF_ERROR(Read(j, "put_in_place_bytes", c.put_in_place_bytes, "a byte count"));
  if (c.max_connections == 0) return Status::InvalidArgument("config key 'max_connections' must be at least 1");
  if (c.max_handshakes == 0) return Status::InvalidArgument("config key 'max_handshakes' must be at least 1");
  for (const char* key : {"idle_timeout_ms", "handshake_timeout_ms", "frame_timeout_ms", "write_timeout_ms"}) {
    if (j.contains(key) && j[key].get<uint64_t>() < 10) {
      return Status::InvalidArgument(fmt::format("config key '{}' must be at least 10", key));
    }
  }
  if (c.max_buffered_bytes < (16ull << 20)) {
    return Status::InvalidArgument("config key 'max_buffered_bytes' must be at least 16 MiB");
  }
  if (c.io_threads == 0 || c.io_threads > 256) return Status::InvalidArgument("config key 'io_threads' must be 1..256");
  if (c.worker_threads == 0 || c.worker_threads > 256) {
    return Status::InvalidArgument("config key 'worker_threads' must be 1..256");
  }
  if (c.max_frame_bytes < 4096 || c.max_frame_bytes > (64u << 20)) {
    return Status::InvalidArgument("config key 'max_frame_bytes' must be from 4 KiB to 64 MiB");
  }
  if (auto it = j.find("namespaces"); it != j.end()) {
    if (!it->is_array() || it->empty()) {
      return Status::InvalidArgument("config key 'namespaces' must be a non-empty array of {\"name\", \"token\"}");
    }
    c.namespaces.clear();
    for (size_t i = 0; i < it->size(); ++i) {
      const json& n = (*it)[i];
      bool keys_ok = n.is_object();
      if (keys_ok) {
        for (auto k = n.begin(); k != n.end(); ++k) {
          keys_ok = keys_ok && (k.key() == "name" || k.key() == "token" || k.key() == "max_connections" ||
                                k.key() == "max_leased_bytes");
        }
      }
      if (!keys_ok || !n.contains("name") || !n["name"].is_string() || n["name"].get<std::string>().empty() ||
          (n.contains("token") && !n["token"].is_string()) ||
          (n.contains("max_connections") && !n["max_connections"].is_number_unsigned()) ||
          (n.contains("max_leased_bytes") && !n["max_leased_bytes"].is_number_unsigned())) {
        return Status::InvalidArgument(fmt::format(
            "config namespaces[{}] must be {{\"name\": non-empty string, \"token\": string, \"max_connections\": "
            "count (optional), \"max_leased_bytes\": byte count (optional)}}",
            i));
      }
      DaemonNamespace ns{n["name"].get<std::string>(), n.value("token", ""),
                         static_cast<uint32_t>(std::min<uint64_t>(n.value("max_connections", uint64_t{0}), 1u << 30)),
                         n.value("max_leased_bytes", uint64_t{0})};
      for (const DaemonNamespace& other : c.namespaces) {
        if (other.name == ns.name) {
          return Status::InvalidArgument(fmt::format("config namespaces: '{}' is listed twice", ns.name));
        }
      }
      c.namespaces.push_back(std::move(ns));
    }
  }
  if (auto it = j.find("kv_events"); it != j.end()) {
    if (!it->is_object()) return Status::InvalidArgument("config key 'kv_events' must be an object");
    for (auto k = it->begin(); k != it->end(); ++k) {
      static const char* kEventKeys[] = {"endpoint", "replay_endpoint", "topic", "hash", "buffer_batches",
                                         "tick_ms", "send_hwm", "max_queued_events"};
      bool known = false;
      for (const char* e : kEventKeys) known = known || k.key() == e;
      if (!known) return Status::InvalidArgument(fmt::format("config: unknown key 'kv_events.{}'", k.key()));
    }
    DaemonKvEvents& e = c.kv_events;
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "endpoint", e.endpoint, "a ZMQ endpoint such as tcp://127.0.0.1:5557"));
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "replay_endpoint", e.replay_endpoint, "a ZMQ endpoint"));
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "topic", e.topic, "a string"));
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "hash", e.hash, "\"uint64\" or \"bytes\""));
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "buffer_batches", e.buffer_batches, "a count"));
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "tick_ms", e.tick_ms, "milliseconds"));
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "send_hwm", e.send_hwm, "a count of messages"));
    SPARSEKV_RETURN_IF_ERROR(Read(*it, "max_queued_events", e.max_queued_events, "a count"));
  }
  if (c.kv_events.hash != "uint64" && c.kv_events.hash != "bytes") {
    return Status::InvalidArgument(
        fmt::format("config key 'kv_events.hash' is \"{}\"; expected \"uint64\" or \"bytes\"", c.kv_events.hash));
  }
  if (c.kv_events.tick_ms == 0) return Status::InvalidArgument("config key 'kv_events.tick_ms' must be at least 1");
  if (auto it = j.find("offload"); it != j.end()) {
    if (!it->is_object()) return Status::InvalidArgument("config key 'offload' must be an object");
    c.offload_json = it->dump();
  }
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
  json namespaces = json::array();
  for (const DaemonNamespace& n : c.namespaces) {
    namespaces.push_back(
        {{"name", n.name},
         {"token", n.token.empty() ? "" : "(set)"},
         {"max_connections", n.max_connections},
         {"max_leased_bytes", n.max_leased_bytes}});
  }
  json j{{"model", c.model},
         {"kv_format", c.kv_format},
         {"block_tokens", c.block_tokens},
         {"listen", c.listen},
         {"unix_socket", c.unix_socket},
         {"metrics_listen", c.metrics_listen},
         {"resp_listen", c.resp_listen},
         {"resp_unix_socket", c.resp_unix_socket},
         {"data_dir", c.data_dir},
         {"log_level", c.log_level},
         {"log_file", c.log_file},
         {"io_threads", c.io_threads},
         {"worker_threads", c.worker_threads},
         {"busy_poll_us", c.busy_poll_us},
         {"max_connections", c.max_connections},
         {"max_frame_bytes", c.max_frame_bytes},
         {"max_inflight_bytes", c.max_inflight_bytes},
         {"idle_timeout_ms", c.idle_timeout_ms},
         {"staging_bytes", c.staging_bytes},
         {"pin_budget_bytes", c.pin_budget_bytes},
         {"max_hinted_blocks_per_session", c.max_hinted_blocks_per_session},
         {"max_hint_ttl_ms", c.max_hint_ttl_ms},
         {"max_buffered_bytes", c.max_buffered_bytes},
         {"max_handshakes", c.max_handshakes},
         {"handshake_timeout_ms", c.handshake_timeout_ms},
         {"frame_timeout_ms", c.frame_timeout_ms},
         {"write_timeout_ms", c.write_timeout_ms},
         {"max_shared_staging_bytes", c.max_shared_staging_bytes},
         {"write_leases", c.write_leases},
         {"write_lease_timeout_ms", c.write_lease_timeout_ms},
         {"local_reads", c.local_reads},
         {"put_in_place_bytes", c.put_in_place_bytes},
         {"namespaces", namespaces},
         {"kv_events",
          {{"endpoint", c.kv_events.endpoint},
           {"replay_endpoint", c.kv_events.replay_endpoint},
           {"topic", c.kv_events.topic},
           {"hash", c.kv_events.hash},
           {"buffer_batches", c.kv_events.buffer_batches},
           {"tick_ms", c.kv_events.tick_ms},
           {"send_hwm", c.kv_events.send_hwm},
           {"max_queued_events", c.kv_events.max_queued_events}}}};
  if (!c.offload_json.empty()) j["offload"] = json::parse(c.offload_json, nullptr, false);
  return j.dump();
}

Status CheckNamespaceOrder(const std::string& data_dir, const std::vector<DaemonNamespace>& namespaces) {
  const std::string path = (std::filesystem::path(data_dir) / kNamespaceRegistryFile).string();
  std::vector<std::string> recorded;
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    const json j = json::parse(text.str(), nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("namespaces") || !j["namespaces"].is_array()) {
      return Status::Corruption(fmt::format(
          "{} is not a namespace list ({{\"namespaces\": [names in id order]}}); restore it, or delete it only "
          "if no tier under this data dir holds blocks you want to keep",
          path));
    }
    for (const json& n : j["namespaces"]) {
      if (!n.is_string()) return Status::Corruption(fmt::format("{}: a namespace name that is not a string", path));
      recorded.push_back(n.get<std::string>());
    }
  }
  for (size_t i = 0; i < recorded.size(); ++i) {
    if (i >= namespaces.size() || namespaces[i].name != recorded[i]) {
      std::string want;
      for (const std::string& n : recorded) want += (want.empty() ? "" : ", ") + n;
      return Status::FailedPrecondition(fmt::format(
          "namespace {} of this data dir is '{}', but the config {}: ids are positions in `namespaces` and "
          "the tiers file blocks under them, so a reordered or removed namespace would be served another's "
          "blocks. List [{}] first, in that order, and add new namespaces after them (recorded in {})",
          i + 1, recorded[i],
          i >= namespaces.size() ? fmt::format("has only {}", namespaces.size())
                                 : fmt::format("puts '{}' there", namespaces[i].name),
          want, path));
    }
  }
  if (recorded.size() == namespaces.size() && std::filesystem::exists(path, ec)) return Status::OK();
  // First start, or namespaces added after the recorded ones: write the list, atomically.
  json names = json::array();
  for (const DaemonNamespace& n : namespaces) names.push_back(n.name);
  // Synced before the rename and the directory after it, so a crash leaves the old list or the
  // new one, never a torn or lost file.
  // The project's file layer (file_system.h) writes, syncs and names the file in its errors.
  FileSystem* fs = FileSystem::Default();
  const std::string tmp = path + ".tmp";
  const std::string text = json{{"namespaces", names}}.dump(2) + "\n";
  {
    FileOpenOptions fo;
    fo.create = true;
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RandomRWFile> f, fs->OpenRandomRW(tmp, fo));
    SPARSEKV_RETURN_IF_ERROR(f->Truncate(0));  // a leftover from a crash
    SPARSEKV_RETURN_IF_ERROR(f->Write(0, std::as_bytes(std::span<const char>(text))));
    SPARSEKV_RETURN_IF_ERROR(f->Sync());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::IOError(fmt::format("renaming {} to {}: {}", tmp, path, std::strerror(errno)));
  }
  SPARSEKV_RETURN_IF_ERROR(fs->SyncDir(data_dir));
  return Status::OK();
}

}  // namespace sparsekv
