// Server: sparsekvd's network front end over Boost.Asio (TCP and a Unix socket), speaking
// api/PROTOCOL.md in front of a DaemonStore, with a Prometheus /metrics endpoint.
//
// Network threads parse frames, move bytes and answer GETs that host memory holds (without
// blocking); every other store call runs on a worker pool, so a slow tier never stalls another
// connection's reads. Each connection has a budget of bytes in flight
// (requests being served plus replies not yet sent): past it the server stops reading from that
// connection until it drains, and a client that never reads its replies is disconnected. A
// malformed frame gets an ERROR frame and its connection is closed; nothing stored changes.
//
// Isolation: every memfd a client can reach (its staging area, the host arena) is sealed against
// shrinking and growing (F_SEAL_SEAL too) before it is mapped or passed, so no client action can
// make the daemon fault; the server never takes a descriptor from a client (ancillary data a
// client sends is dropped unread). The Unix socket path is claimed only when nothing accepts on
// it, and removed at shutdown only while it is still this server's socket.
//
// Ownership: the server borrows the store, which must outlive it. Thread safety: Start, Wait
// and Shutdown may be called from any thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "server/daemon_store.h"
#include "server/metrics.h"
#include "sparsekv/status.h"

namespace sparsekv::server {

struct NamespaceConfig {
  std::string name;   // what HELLO names
  std::string token;  // what HELLO must present ("" accepts any)
};

struct ServerOptions {
  // TCP address HOST:PORT ("" disables; port 0 picks one). Default: "127.0.0.1:7420".
  std::string tcp_listen = "127.0.0.1:7420";
  // Unix socket path ("" disables). A socket there that a process accepts on refuses the start
  // (another daemon serves it); a stale one is replaced. Default: "".
  std::string unix_path;
  // HTTP address of /metrics ("" disables). Default: "127.0.0.1:7421".
  std::string metrics_listen = "127.0.0.1:7421";
  // Threads that run the network loop. Default: one per 4 cores, at least 1.
  int io_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency() / 4));
  // Microseconds a network thread keeps polling for work before it sleeps (0: never).
  // Default: 0.
  uint32_t busy_poll_us = 0;
  // Threads that run store calls. Default: 2.
  int worker_threads = 2;
  // Connections open at once; more are refused with an ERROR frame. Default: 256.
  uint32_t max_connections = 256;
  // Largest frame payload accepted. Default: 64 MiB.
  uint32_t max_frame_bytes = 64u << 20;
  // Per connection: request bytes being served + reply bytes not yet sent before reading stops.
  // Default: 256 MiB.
  uint64_t max_inflight_bytes = 256ull << 20;
  // A connection with nothing in flight for this long is closed. Default: 300 s.
  uint32_t idle_timeout_ms = 300000;
  // Shared-memory GETs point the client into the host arena (mapped read-only) instead of
  // copying, when the store's arena is a memfd and there is exactly one namespace (the arena
  // then holds nothing another namespace may not read). Default: true.
  bool lend_from_arena = true;
  // Shared-memory staging area per Unix-socket session (half for PUT, half for GET).
  // Default: 64 MiB.
  uint64_t staging_bytes = 64ull << 20;
  // Told to clients in the HELLO reply. Default: 128.
  uint32_t block_tokens = 128;
  // Namespaces clients may open. Default: one, "default", with no token.
  std::vector<NamespaceConfig> namespaces = {{"default", ""}};
  // SIGINT/SIGTERM drain and stop; SIGHUP calls on_sighup. Default: false (tests).
  bool handle_signals = false;
  std::function<void()> on_sighup;
};

class Server {
 public:
  // Binds every listener and starts the threads. Errors name the address that failed.
  static Result<std::unique_ptr<Server>> Start(ServerOptions options, DaemonStore* store);
  ~Server();  // Shutdown() and Wait()

  // Stops accepting, lets requests in flight finish and their replies go out (at most 10 s),
  // flushes the store, and stops. Idempotent.
  void Shutdown();
  // Blocks until the server has stopped (after Shutdown or a signal). Returns the store's
  // flush status.
  Status Wait();

  // Bound addresses: "127.0.0.1:PORT" and the metrics port (0 when disabled).
  std::string tcp_address() const;
  uint16_t metrics_port() const;
  Metrics& metrics();

  class Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsekv::server
