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
#include "sparsekv/tier.h"
#include "sparsekv/status.h"

namespace sparsekv::server {

struct NamespaceConfig {
  std::string name;   // what HELLO names
  std::string token;  // what HELLO must present ("" accepts any)
  // Authenticated connections of this namespace at once (0: only the server's limit). At the
  // quota, a new one closes the namespace's longest-idle connection, or is refused if none is
  // idle. Default: 0.
  uint32_t max_connections = 0;
  // Bytes of write leases (PUT_LEASE) its sessions may hold open at once: room reserved in the
  // host arena and not yet committed. Past it a lease is refused (ResourceExhausted) and the
  // client stores over its staging area instead. 0: a quarter of the host arena. Default: 0.
  uint64_t max_leased_bytes = 0;
};

struct ServerOptions {
  // TCP address HOST:PORT ("" disables; port 0 picks one). Default: "127.0.0.1:7420".
  std::string tcp_listen = "127.0.0.1:7420";
  // Unix socket path ("" disables). A socket there that a process accepts on refuses the start
  // (another daemon serves it); a stale one is replaced. Default: "".
  std::string unix_path;
  // RESP (the Redis protocol, resp_session.h) on TCP HOST:PORT ("" disables; port 0 picks one).
  // Default: "" (sparsekvd's configuration serves it on 127.0.0.1:6380).
  std::string resp_listen;
  // RESP on a Unix socket path ("" disables), claimed as unix_path is. Default: "".
  std::string resp_unix_path;
  // HTTP address of /metrics ("" disables). Default: "127.0.0.1:7421".
  std::string metrics_listen = "127.0.0.1:7421";
  // Threads that run the network loop. Default: one per 4 cores, at least 1.
  int io_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency() / 4));
  // Microseconds a network thread keeps polling for work before it sleeps (0: never).
  // Default: 0.
  uint32_t busy_poll_us = 0;
  // Threads that run store calls. Default: 2.
  int worker_threads = 2;
  // Authenticated connections at once, native and RESP together. At the limit, a new native one
  // that passes HELLO closes the longest-idle native connection (one with nothing in flight;
  // among those that have made no call since HELLO first, if there are any), or
  // is refused with an ERROR frame if none is idle; a new RESP one is refused as Redis refuses
  // it ("-ERR max number of clients reached"). Default: 256.
  uint32_t max_connections = 256;
  // Connections that have not finished HELLO, at once; past it the oldest is closed. Default: 64.
  uint32_t max_handshakes = 64;
  // A connection must send a valid HELLO within this long. Default: 5 s.
  uint32_t handshake_timeout_ms = 5000;
  // Largest frame payload, either way: requests above it are refused, and no reply exceeds it
  // (a GET answers what fits and defers the rest, api/PROTOCOL.md). Before HELLO only a frame of
  // at most kMaxHelloPayload bytes is accepted. Default: 64 MiB.
  uint32_t max_frame_bytes = 64u << 20;
  // Per connection: request bytes being served + reply bytes not yet sent before reading stops.
  // Default: 256 MiB.
  uint64_t max_inflight_bytes = 256ull << 20;
  // Daemon-wide: request payload bytes received and not yet served, plus reply bytes built and
  // not yet sent (host-tier pages a reply sends in place are counted by the pin budget instead).
  // Past it a connection reads only while it holds less than kConnectionAllowance, so the
  // total stays below this + kConnectionAllowance per connection; memory for a payload is
  // committed as its bytes arrive, never at the size a header claims. Default: 1 GiB.
  uint64_t max_buffered_bytes = 1ull << 30;
  // A connection with nothing in flight for this long is closed. Default: 300 s.
  uint32_t idle_timeout_ms = 300000;
  // A frame whose bytes have not all arrived this long after its header is dropped with its
  // connection, time the budget held its reading back included (else frames that never
  // complete could hold the budget for good; the oldest go first). Default: 30 s.
  uint32_t frame_timeout_ms = 30000;
  // A connection whose replies have not been taken by the peer for this long is closed (it does
  // not read). Default: 10 s.
  uint32_t write_timeout_ms = 10000;
  // Shared-memory staging areas of all sessions together; past it HELLO grants no shared
  // memory (the client uses the socket). Default: 4 GiB.
  uint64_t max_shared_staging_bytes = 4ull << 30;
  // Shared-memory GETs point the client into the host arena (mapped read-only) instead of
  // copying, when the store's arena is a memfd and there is exactly one namespace (the arena
  // then holds nothing another namespace may not read). Default: true.
  bool lend_from_arena = true;
  // Shared-memory PUTs written by the client straight into the host arena (write leases,
  // api/PROTOCOL.md), where the arena is lent (lend_from_arena). The arena's memfd is then
  // passed writable to the sessions that ask, so it is not sealed against writes: every client
  // of the one namespace can write it, and the daemon trusts no byte of it (every read checks
  // the record's checksum; a commit compares the header with its own). Default: false (the
  // arena stays read-only to clients).
  bool write_leases = false;
  // Local reads (api/PROTOCOL.md): where the arena is lent, sessions that ask get the host
  // tier's lend table (mapped read-only) and tokens with their lends, and read a value lent
  // before again straight from the arena without asking, as long as its table entry stays the
  // same (the record was not erased, replaced or evicted meanwhile). Default: true.
  bool local_reads = true;
  // A write lease not committed within this long is taken back (its room freed, nothing
  // stored). Default: 30 s.
  uint32_t write_lease_timeout_ms = 30000;
  // A PUT frame of one value, or a plain RESP SET, whose value is at least this many bytes is
  // received straight into room reserved for its record in the host tier, while it arrives:
  // the kernel's copy is its only one. The room counts against the pin budget (a quarter of the
  // host arena), not max_buffered_bytes; past that budget, or with 0 here, such a value is
  // buffered like any other. Default: 1 MiB.
  uint64_t put_in_place_bytes = 1u << 20;
  // Shared-memory staging area per Unix-socket session (half for PUT, half for GET).
  // Default: 64 MiB.
  uint64_t staging_bytes = 64ull << 20;
  // Told to clients in the HELLO reply. Default: 128.
  uint32_t block_tokens = 128;
  // Namespaces clients may open. Default: one, "default", with no token.
  std::vector<NamespaceConfig> namespaces = {{"default", ""}};
  // Directory of the request logs (LOG_* operations; request_log.h): one log per namespace in
  // a subdirectory named by the namespace's name in hex, opened at its first LOG_* request.
  // "" answers them NotSupported. Default: "".
  std::string request_log_dir;
  // When a LOG_APPEND is acknowledged. Default: kFdatasync.
  Durability request_log_durability = Durability::kFdatasync;
  // SIGINT/SIGTERM drain and stop; SIGHUP calls on_sighup. Default: false (tests).
  bool handle_signals = false;
  std::function<void()> on_sighup;
  // Appends more Prometheus text to every /metrics reply (sparsekvd's KV-event counters); it
  // must stay callable until the server is destroyed. Optional. Default: none.
  std::function<void(std::string&)> render_metrics;
};

// Before HELLO a frame may carry at most this many payload bytes (a HELLO is far smaller).
inline constexpr uint32_t kMaxHelloPayload = 4096;
// Bytes a connection may hold in buffers even when the daemon-wide budget is spent, so that
// small requests are never starved by large ones.
inline constexpr uint64_t kConnectionAllowance = 1ull << 20;

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
  // The RESP listener's "127.0.0.1:PORT" ("" without one).
  std::string resp_address() const;
  uint16_t metrics_port() const;
  Metrics& metrics();

  class Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsekv::server
