// sparsekvd: the cache daemon. Loads its configuration (embedded default or --config, then
// command-line overrides), logs the effective options, locks the data directory (one daemon per
// data dir), opens the offload tiers under it and serves api/PROTOCOL.md on TCP and a Unix
// socket until SIGINT/SIGTERM, which drain in-flight requests and flush the tiers before exit 0.
// SIGHUP reopens the log file.
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <algorithm>
#include <climits>
#include <thread>

#include "server/server.h"
#include "server/kv_event_tracker.h"
#include "server/tiered_store.h"
#include "sparsekv/block_geometry.h"
#include "sparsekv/bundle.h"
#include "sparsekv/model_spec.h"
#include "src/daemon_config.h"

namespace {

using namespace sparsekv;

void OpenLog(const std::string& path) {
  if (path.empty()) return;
  try {
    spdlog::drop("sparsekvd");
    auto logger = spdlog::basic_logger_mt("sparsekvd", path);
    logger->flush_on(spdlog::level::info);
    spdlog::set_default_logger(logger);
  } catch (const spdlog::spdlog_ex& e) {
    spdlog::error("cannot open log file '{}': {}", path, e.what());
  }
}

// One daemon per data dir: two would open the same tiers (with the SSD tier off, both would
// start and fight over the socket; with it on, the second would die of RocksDB's own lock). An
// flock on <data_dir>/sparsekvd.lock, held until the process exits (the kernel drops it then,
// even after kill -9), with the owner's pid written in it so the refusal can name it. Returns
// the descriptor that holds the lock.
Result<int> LockDataDir(const std::string& data_dir) {
  const std::string path = (std::filesystem::path(data_dir) / "sparsekvd.lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(fmt::format("cannot open the lock file {}: {}", path, std::strerror(errno)));
  int rc;
  do {
    rc = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) {
      ::close(fd);
      return Status::IOError(fmt::format("cannot lock {}: {}", path, std::strerror(err)));
    }
    // The owner writes its pid just after it takes the lock: give it a moment.
    std::string pid;
    for (int i = 0; i < 20 && pid.empty(); ++i) {
      char buf[32] = {};
      const ssize_t k = ::pread(fd, buf, sizeof(buf) - 1, 0);
      if (k > 0) pid.assign(buf, static_cast<size_t>(k));
      while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
      if (pid.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::close(fd);
    return Status::AlreadyExists(fmt::format(
        "data dir {} is in use by another sparsekvd (pid {}), which holds {}; one daemon per data dir: stop it "
        "or choose another data_dir",
        data_dir, pid.empty() ? "unknown" : pid, path));
  }
  const std::string pid = fmt::format("{}\n", ::getpid());
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    spdlog::warn("cannot write this daemon's pid into {}: {}", path, std::strerror(errno));
  }
  return fd;
}

Result<ModelSpec> LoadModel(const DaemonConfig& c) {
  if (std::filesystem::exists(c.model)) return LoadModelSpecFile(c.model);
  SPARSEKV_ASSIGN_OR_RETURN(KvPrecision p, ParseKvPrecision(c.kv_format));
  return ModelPreset(c.model, p);
}

int Run(DaemonConfig config) {
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  std::error_code ec;
  std::filesystem::create_directories(config.data_dir, ec);
  if (ec) {
    spdlog::error("cannot create data dir '{}': {}", config.data_dir, ec.message());
    return 2;
  }
  OpenLog(config.log_file);
  // Before the tiers are opened: a second daemon must not touch them. The descriptor stays
  // open (the lock held) until the process exits.
  auto data_dir_lock = LockDataDir(config.data_dir);
  if (!data_dir_lock.ok()) {
    spdlog::error("{}", data_dir_lock.status().ToString());
    return 2;
  }
  // Before the tiers are opened: their blocks carry namespace ids, which are positions.
  if (Status st = CheckNamespaceOrder(config.data_dir, config.namespaces); !st.ok()) {
    spdlog::error("config: {}", st.ToString());
    return 2;
  }
  auto spec = LoadModel(config);
  if (!spec.ok()) {
    spdlog::error("model: {}", spec.status().ToString());
    return 2;
  }
  auto geometry = ComputeBlockGeometry(*spec, config.block_tokens);
  if (!geometry.ok()) {
    spdlog::error("model: {}", geometry.status().ToString());
    return 2;
  }
  server::TieredStoreOptions store_options;
  if (!config.offload_json.empty()) {
    auto offload = ParseOffloadOptionsJson(config.offload_json);
    if (!offload.ok()) {
      spdlog::error("config: {}", offload.status().ToString());
      return 2;
    }
    store_options.offload = *offload;
  }
  ResolveOffloadPaths(store_options.offload, config.data_dir);
  store_options.pin_budget_bytes = config.pin_budget_bytes;
  store_options.max_hinted_blocks_per_session = config.max_hinted_blocks_per_session;
  store_options.max_hint_ttl_ms = config.max_hint_ttl_ms;
  // One namespace: the host arena is a memfd that shared-memory clients map read-only, so a GET
  // is lent in place rather than copied (server.h, lend_from_arena).
  if (config.namespaces.size() == 1) store_options.offload.host.backing = ArenaBacking::kMemfd;
  // The remote tier files a namespace's blocks under its name, so that daemons sharing a
  // cluster share them whatever their namespace ids (ids are positions in `namespaces`, kept
  // stable by CheckNamespaceOrder above).
  store_options.offload.remote.namespace_labels.clear();
  for (const DaemonNamespace& n : config.namespaces) store_options.offload.remote.namespace_labels.push_back(n.name);

  server::ServerOptions so;
  so.tcp_listen = config.listen;
  if (!config.unix_socket.empty()) {
    std::filesystem::path p(config.unix_socket);
    so.unix_path = p.is_absolute() ? p.string() : (std::filesystem::path(config.data_dir) / p).string();
  }
  so.metrics_listen = config.metrics_listen;
  // The engines' request logs (LOG_* operations), one per namespace, fdatasync'd.
  so.request_log_dir = (std::filesystem::path(config.data_dir) / "requests").string();
  so.resp_listen = config.resp_listen;
  if (!config.resp_unix_socket.empty()) {
    std::filesystem::path p(config.resp_unix_socket);
    so.resp_unix_path = p.is_absolute() ? p.string() : (std::filesystem::path(config.data_dir) / p).string();
  }
  so.io_threads = static_cast<int>(config.io_threads);
  so.worker_threads = static_cast<int>(config.worker_threads);
  so.busy_poll_us = config.busy_poll_us;
  so.max_connections = config.max_connections;
  so.max_frame_bytes = config.max_frame_bytes;
  so.max_inflight_bytes = config.max_inflight_bytes;
  so.idle_timeout_ms = config.idle_timeout_ms;
  so.staging_bytes = config.staging_bytes;
  so.max_buffered_bytes = config.max_buffered_bytes;
  so.max_handshakes = config.max_handshakes;
  so.handshake_timeout_ms = config.handshake_timeout_ms;
  so.frame_timeout_ms = config.frame_timeout_ms;
  so.write_timeout_ms = config.write_timeout_ms;
  so.max_shared_staging_bytes = config.max_shared_staging_bytes;
  so.write_leases = config.write_leases;
  so.write_lease_timeout_ms = config.write_lease_timeout_ms;
  so.local_reads = config.local_reads;
  so.put_in_place_bytes = config.put_in_place_bytes;
  so.block_tokens = config.block_tokens;
  so.namespaces.clear();
  for (const DaemonNamespace& n : config.namespaces) so.namespaces.push_back({n.name, n.token, n.max_connections, n.max_leased_bytes});
  so.handle_signals = true;
  so.on_sighup = [path = config.log_file] { OpenLog(path); };

  spdlog::info("sparsekvd 0.1.0 effective options: {}", DaemonConfigToJson(config));
  spdlog::info("offload: {}", OffloadOptionsToJson(store_options.offload));
  spdlog::info("model {}: {} bytes per {}-token block", spec->name, geometry->BytesPerBlock(), config.block_tokens);

  auto store = server::TieredStore::Open(store_options);
  if (!store.ok()) {
    spdlog::error("opening the tiers: {}", store.status().ToString());
    return 2;
  }
  std::unique_ptr<server::TierEventTracker> kv_events;
  if (!config.kv_events.endpoint.empty()) {
    server::TierEventTrackerOptions to;
    to.publisher.endpoint = config.kv_events.endpoint;
    to.publisher.replay_endpoint = config.kv_events.replay_endpoint;
    to.publisher.topic =
        config.kv_events.topic.empty() ? DefaultKvEventTopic(spec->name) : config.kv_events.topic;
    auto hash = ParseKvEventHashEncoding(config.kv_events.hash);
    if (!hash.ok()) {
      spdlog::error("{}", hash.status().ToString());
      return 2;
    }
    to.publisher.hash = *hash;
    to.publisher.buffer_batches = config.kv_events.buffer_batches;
    to.tick_ms = config.kv_events.tick_ms;
    to.publisher.send_hwm = static_cast<int>(std::min<uint32_t>(config.kv_events.send_hwm, INT32_MAX));
    to.publisher.max_queued_events = config.kv_events.max_queued_events;
    auto tracker = server::TierEventTracker::Start(to, **store);
    if (!tracker.ok()) {
      spdlog::error("{}", tracker.status().ToString());
      return 2;
    }
    kv_events = std::move(tracker).value();
    spdlog::info("KV events (vLLM wire) on {}{}, topic '{}', hashes as {}", to.publisher.endpoint,
                 to.publisher.replay_endpoint.empty() ? "" : ", replay on " + to.publisher.replay_endpoint,
                 to.publisher.topic, config.kv_events.hash);
  }
  if (kv_events) so.render_metrics = [t = kv_events.get()](std::string& out) { t->RenderMetrics(out); };
  auto srv = server::Server::Start(so, store->get());
  if (!srv.ok()) {
    spdlog::error("{}", srv.status().ToString());
    return 2;
  }
  spdlog::info("listening on {}{}{}", (*srv)->tcp_address().empty() ? "(no TCP)" : (*srv)->tcp_address(),
               so.unix_path.empty() ? "" : " and unix:" + so.unix_path,
               (*srv)->metrics_port() ? fmt::format(", metrics on port {}", (*srv)->metrics_port()) : "");
  if (!(*srv)->resp_address().empty() || !so.resp_unix_path.empty()) {
    spdlog::info("serving RESP on {}{}", (*srv)->resp_address().empty() ? "(no TCP)" : (*srv)->resp_address(),
                 so.resp_unix_path.empty() ? "" : " and unix:" + so.resp_unix_path);
  }
  Status st = (*srv)->Wait();
  srv->reset();
  kv_events.reset();
  store->reset();
  if (!st.ok()) {
    spdlog::error("shutdown: {}", st.ToString());
    return 1;
  }
  spdlog::info("sparsekvd stopped cleanly");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stderr (or the log file); stdout stays free for --print-default-config.
  spdlog::set_default_logger(spdlog::stderr_color_mt("sparsekvd"));
  CLI::App app{"sparsekvd: the sparsekv cache daemon"};
  std::string config_path, listen, unix_path, data_dir, resp_listen, resp_unix;
  std::string kv_endpoint, kv_replay, kv_topic, kv_hash;
  uint32_t kv_buffer = 0;
  app.add_option("--config", config_path, "JSON config file (default: the embedded configuration)")
      ->check(CLI::ExistingFile);
  app.add_option("--listen", listen, "TCP address HOST:PORT (\"\" disables)");
  app.add_option("--unix", unix_path, "Unix socket path (\"\" disables)");
  app.add_option("--data-dir", data_dir, "Data directory");
  app.add_option("--resp-listen", resp_listen, "RESP (Redis protocol) TCP address HOST:PORT (\"\" disables)");
  app.add_option("--resp-unix", resp_unix, "RESP (Redis protocol) Unix socket path (\"\" disables)");
  app.add_option("--kv-events-endpoint", kv_endpoint, "KV events (vLLM wire): ZMQ PUB address to bind (\"\" disables)");
  app.add_option("--kv-events-replay-endpoint", kv_replay, "KV events: ZMQ ROUTER address for replay (\"\" for none)");
  app.add_option("--kv-events-topic", kv_topic, "KV events: topic (default kv@<pod>@<model>)");
  app.add_option("--kv-events-hash", kv_hash, "KV events: block hashes as uint64 or bytes")
      ->check(CLI::IsMember({"uint64", "bytes"}));
  app.add_option("--kv-events-buffer-batches", kv_buffer, "KV events: recent batches kept for replay");
  bool print_config = false;
  app.add_flag("--print-default-config", print_config, "Print the embedded configuration and exit");
  // For tests only, hidden from --help: records of this bundle format version are written and
  // read, as a release of another format would (SetBundleFormatVersionForTesting), so that a
  // test runs two daemons of different formats over one tier (docs/guides/upgrades.md).
  uint16_t testing_bundle_format = 0;
  app.add_option("--testing-bundle-format", testing_bundle_format)->group("")->check(CLI::Range(1, 65535));
  CLI11_PARSE(app, argc, argv);
  if (testing_bundle_format != 0) {
    SetBundleFormatVersionForTesting(testing_bundle_format);
    spdlog::warn("testing: bundle format version {} (this release's is {})", testing_bundle_format,
                 kBundleFormatVersion);
  }
  if (print_config) {
    std::puts(EmbeddedDefaultConfigJson());
    return 0;
  }
  auto config = config_path.empty() ? ParseDaemonConfig(EmbeddedDefaultConfigJson()) : LoadDaemonConfigFile(config_path);
  if (!config.ok()) {
    spdlog::error("{}", config.status().ToString());
    return 2;
  }
  if (app.count("--listen")) config->listen = listen;
  if (app.count("--unix")) config->unix_socket = unix_path;
  if (app.count("--data-dir")) config->data_dir = data_dir;
  if (app.count("--resp-listen")) config->resp_listen = resp_listen;
  if (app.count("--resp-unix")) config->resp_unix_socket = resp_unix;
  if (app.count("--kv-events-endpoint")) config->kv_events.endpoint = kv_endpoint;
  if (app.count("--kv-events-replay-endpoint")) config->kv_events.replay_endpoint = kv_replay;
  if (app.count("--kv-events-topic")) config->kv_events.topic = kv_topic;
  if (app.count("--kv-events-hash")) config->kv_events.hash = kv_hash;
  if (app.count("--kv-events-buffer-batches")) config->kv_events.buffer_batches = kv_buffer;
  return Run(std::move(*config));
}
