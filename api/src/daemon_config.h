// sparsekvd's configuration: a JSON file (or the embedded default) plus command-line overrides.
// The daemon logs the effective configuration at start.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv {

struct DaemonNamespace {
  std::string name;
  // HELLO must present it; "" accepts any. Default: "".
  std::string token;
  // Connections of this namespace at once (0: only max_connections). Default: 0.
  uint32_t max_connections = 0;
  // Bytes of write leases its sessions may hold uncommitted at once (NamespaceConfig's
  // max_leased_bytes; 0: a quarter of the host arena). Default: 0.
  uint64_t max_leased_bytes = 0;
};

// KV events on vLLM's wire (sparsekv/vllm_kv_events.h, server/kv_event_tracker.h); off while
// `endpoint` is "".
struct DaemonKvEvents {
  // ZMQ PUB address, bound (e.g. "tcp://127.0.0.1:5557"); "" disables. Default: "".
  std::string endpoint;
  // ZMQ ROUTER address for replay requests, bound; "" for none. Default: "".
  std::string replay_endpoint;
  // First frame of every message; "" means "kv@<pod>@<model>" ($POD_NAME or the host name).
  // Default: "".
  std::string topic;
  // Block hashes as "uint64" (low 64 bits) or "bytes" (the 16 bytes). Default: "uint64".
  std::string hash = "uint64";
  // Recent batches kept for replay. Default: 10000.
  uint32_t buffer_batches = 10000;
  // How often the tiers' changes are published, in ms. Default: 100.
  uint32_t tick_ms = 100;
  // ZMQ send high-water mark of the PUB socket, in messages (past it a slow subscriber misses
  // batches: sequence gaps that replay fills). Default: 100000.
  uint32_t send_hwm = 100000;
  // Events waiting to be published; more are dropped (a sequence gap, counted in /metrics, then
  // a resync). Default: 100000.
  uint32_t max_queued_events = 100000;
};

struct DaemonConfig {
  // Model preset or a path to a JSON spec file; sizes the host tier's slots. Default: "deepseek-v3.2-exp".
  std::string model = "deepseek-v3.2-exp";
  // bf16, c8 or fp8 (presets only). Default: "fp8".
  std::string kv_format = "fp8";
  // Tokens per block. Default: 128.
  uint32_t block_tokens = 128;
  // TCP listen address, HOST:PORT (loopback by default; "" disables). Default: "127.0.0.1:7420".
  std::string listen = "127.0.0.1:7420";
  // Unix socket path, relative to data_dir unless absolute ("" disables). Default: "sparsekvd.sock".
  std::string unix_socket = "sparsekvd.sock";
  // RESP (the Redis protocol) on TCP HOST:PORT ("" disables). Default: "" (the embedded
  // configuration serves it on "127.0.0.1:6380").
  std::string resp_listen;
  // RESP on a Unix socket path, relative to data_dir unless absolute ("" disables). Default: "".
  std::string resp_unix_socket;
  // Prometheus /metrics over HTTP ("" disables). Default: "127.0.0.1:7421".
  std::string metrics_listen = "127.0.0.1:7421";
  // Where tiers, indexes and the socket live. Default: "./var".
  std::string data_dir = "./var";
  // spdlog level name. Default: "info".
  std::string log_level = "info";
  // Log file ("" logs to stderr); SIGHUP reopens it. Default: "".
  std::string log_file;
  // Network and worker threads. Default: one network thread per 4 cores (at least 1), and 2
  // workers. On a 2-core machine a second network thread costs more in handoffs between
  // threads than it adds (README, "bench daemon").
  uint32_t io_threads = std::max(1u, std::thread::hardware_concurrency() / 4);
  uint32_t worker_threads = 2;
  // Microseconds a network thread polls for work before it sleeps (0: never). Default: 0.
  uint32_t busy_poll_us = 0;
  // Connection and per-connection limits. Defaults: 256 connections, 64 MiB frames, 256 MiB in
  // flight per connection, 300 s idle timeout, 64 MiB shared staging per Unix session.
  uint32_t max_connections = 256;
  uint32_t max_frame_bytes = 64u << 20;
  uint64_t max_inflight_bytes = 256ull << 20;
  uint32_t idle_timeout_ms = 300000;
  uint64_t staging_bytes = 64ull << 20;
  // What a client may cost the daemon (server.h has the details). Defaults: 1 GiB of buffered
  // request and reply bytes daemon-wide, 64 connections at once that have not said HELLO, 5 s to
  // say it, 30 s for a frame to arrive once its header has, 10 s for a client to start taking
  // its replies, 4 GiB of shared-memory staging areas in all.
  uint64_t max_buffered_bytes = 1ull << 30;
  uint32_t max_handshakes = 64;
  uint32_t handshake_timeout_ms = 5000;
  uint32_t frame_timeout_ms = 30000;
  uint32_t write_timeout_ms = 10000;
  uint64_t max_shared_staging_bytes = 4ull << 30;
  // Shared-memory PUTs written by clients straight into the host arena (write leases,
  // api/PROTOCOL.md; ServerOptions::write_leases), and how long a lease may stay uncommitted.
  // Default: false, 30 s.
  bool write_leases = false;
  uint32_t write_lease_timeout_ms = 30000;
  // Clients may read values lent before straight from the host arena (ServerOptions::local_reads).
  // Default: true.
  bool local_reads = true;
  // Values of at least this many bytes are received straight into host memory
  // (ServerOptions::put_in_place_bytes; 0: never).
  uint64_t put_in_place_bytes = 1u << 20;
  // Bytes of pinned blocks held in memory. Default: 256 MiB.
  uint64_t pin_budget_bytes = 256ull << 20;
  // HINTs: blocks one session may hint at once, and the longest time to live a HINT may ask
  // for. Defaults: 65536 blocks, 600000 ms.
  uint64_t max_hinted_blocks_per_session = 65536;
  uint32_t max_hint_ttl_ms = 600000;
  // Namespaces clients may open. Default: [{"name": "default", "token": ""}].
  std::vector<DaemonNamespace> namespaces = {{"default", ""}};
  // "kv_events": KV events on vLLM's wire. Default: off.
  DaemonKvEvents kv_events;
  // The "offload" section as JSON text (see offload_options.h); "" keeps the library defaults.
  std::string offload_json;
};

// The configuration compiled into the daemon (what ./run.sh starts with).
const char* EmbeddedDefaultConfigJson();

// Parses a config; unknown keys and wrong types are errors naming the key.
Result<DaemonConfig> ParseDaemonConfig(const std::string& json_text);
Result<DaemonConfig> LoadDaemonConfigFile(const std::string& path);
std::string DaemonConfigToJson(const DaemonConfig& config);

// A namespace's id is its position in `namespaces` (from 1), and the host, SSD and RocksDB tiers
// file its blocks under that id. The names in id order are kept in <data_dir>/namespaces.json
// (written on first start, extended when namespaces are added); a config must list them first,
// in that order, and may add new ones after them. Otherwise this is an error naming the first
// difference, and the daemon does not start: a reordered or removed namespace would have been
// served another's blocks. A damaged file is an error too.
inline constexpr const char* kNamespaceRegistryFile = "namespaces.json";
Status CheckNamespaceOrder(const std::string& data_dir, const std::vector<DaemonNamespace>& namespaces);

}  // namespace sparsekv
