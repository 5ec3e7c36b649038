// RespFrontEnd: sparsekvd's second protocol, RESP (the Redis protocol), beside the native one
// (api/PROTOCOL.md), in front of the same DaemonStore. Any Redis client (redis-cli,
// redis-benchmark, redis-py, hiredis) and any Redis-backed connector stores and reads values
// through it; docs/ and api/RESP.md list the commands and what each answers.
//
// Keys and values: resp_keys.h. A connection starts in the "default" namespace when that has no
// token, else it must AUTH (username = namespace, password = its token) before anything but
// AUTH, HELLO and QUIT.
//
// Limits are the server's (ServerOptions): the same daemon-wide budget of buffered bytes, the
// per-connection bytes in flight, the connection limit (native and RESP connections together),
// the idle, frame and write deadlines, a namespace's max_connections (a connection past it is
// refused at connect, or its AUTH into that namespace is), and the pin budget for replies sent
// from host memory in place. A request larger than max_frame_bytes, a malformed one, a client that does not read
// its replies, or one that sends a request too slowly gets an error (where it can still be
// sent) and is closed; other connections are served meanwhile and nothing stored changes.
//
// Commands that host memory answers at once (GET, MGET, and SET/MSET with a host tier first) run
// on the network thread; the others on the server's workers. A connection's requests are
// answered in order. SET NX/XX/GET, DEL and UNLINK are atomic with respect to each other and to
// plain SETs of the same key through RESP (a lock per key stripe), not to native PUTs.
//
// Thread safety: Start, BeginDrain, Drained, CloseAll and RenderMetrics may be called from any
// thread. The front end must be destroyed after the io_context's threads have stopped.
#pragma once

#include <cstdint>
#include <utility>
#include <boost/asio.hpp>
#include <functional>
#include <memory>
#include <string>

#include "server/daemon_store.h"
#include "server/metrics.h"
#include "server/server.h"
#include "server/transport.h"

namespace sparsekv::server {

// What the server lends the RESP front end. Every member is set; the pointers outlive it.
struct RespHost {
  boost::asio::io_context* io = nullptr;
  DaemonStore* store = nullptr;
  const ServerOptions* options = nullptr;
  BufferBudget* budget = nullptr;
  Metrics* metrics = nullptr;
  // Runs `work` on a worker thread, in turn with the other connections' work.
  std::function<void(uint64_t connection, std::function<void()> work)> submit;
  // Takes one of the server's max_connections (false at the limit) and gives it back.
  std::function<bool()> take_slot;
  std::function<void()> give_slot;
  // Takes one of namespace `ns`'s connections (its max_connections, native and RESP together;
  // false at the quota) and gives it back.
  std::function<bool(uint32_t ns)> take_namespace;
  std::function<void(uint32_t ns)> give_namespace;
  // The pin budget for replies sent from the store's memory in place (server.cc).
  std::function<bool(uint64_t)> pins_below_cap;
  std::function<DaemonStore::Keep(uint64_t)> charge_pins;
  // Store calls that answer later on a tier's thread: the server waits for them at shutdown.
  std::function<void()> begin_async, end_async;
  // Called, with no lock held, when the last connection has closed while draining.
  std::function<void()> on_drained;
  std::function<uint64_t()> next_id;
};

class RespFrontEnd {
 public:
  // Binds `tcp_listen` (HOST:PORT, "" for none) and `unix_path` ("" for none).
  static Result<std::unique_ptr<RespFrontEnd>> Bind(RespHost host, const std::string& tcp_listen,
                                                    const std::string& unix_path);
  ~RespFrontEnd();

  void Start();
  // Stops accepting; every connection closes once the request it is serving is answered.
  void BeginDrain();
  bool Drained();
  // At the drain deadline: forgets every connection (the io_context's stop ends them).
  void CloseAll();
  // "127.0.0.1:PORT", or "" without a TCP listener.
  std::string tcp_address() const;
  // sparsekv_resp_* series: commands by name, errors, connections, protocol errors.
  void RenderMetrics(std::string& out) const;

  class Impl;

 private:
  explicit RespFrontEnd(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsekv::server
