// RedisCluster: the routing of the Redis Cluster specification on top of hiredis 0.14 (which
// has no cluster support): CRC16 key slots, the slot map from CLUSTER SLOTS, MOVED and ASK
// redirects, a pool of connections per node, and failure handling with a deadline.
//
// Execute runs a batch of single-key commands: they are grouped by the node serving each
// key's slot, written to every node at once (one pipeline per node, over one connection), and
// the replies are read from all nodes in one poll loop. A node that makes no progress for
// `timeout_ms` (connect included; plus 1 ms per 64 KiB of requests it holds unanswered, since
// a node replies to a pipeline once it has run it), or closes its connection, fails: its
// commands get
// Unavailable, the connection is closed, and the node is marked down. A down node's commands
// fail at once, without waiting, until a background thread reaches it again (PING, with
// exponential backoff) or a slot map refresh moves its slots elsewhere (a replica promoted by
// the cluster). One incident is logged when a node goes down and one when it comes back.
//
// The slot map is refreshed in the background: at start, after a MOVED, when a node fails,
// and every `refresh_interval_ms` while a node is down. A MOVED reply also updates its slot at
// once and the command is sent again to the node named (an ASK is followed once, with ASKING);
// TRYAGAIN and CLUSTERDOWN fail the command as Unavailable.
//
// Thread safety: every method is thread-safe; Execute may run on many threads at once (each
// takes its own connections from the pools).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "sparsekv/bundle.h"
#include "sparsekv/status.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv::offload {

inline constexpr uint32_t kRedisSlots = 16384;

// The slot of a key: CRC16 (XMODEM) of the key, or of its hash tag (the bytes between the first
// '{' and the next '}' when that is not empty), modulo 16384.
uint16_t RedisKeySlot(std::string_view key);
// CRC16-XMODEM, as the specification's key hashing uses it.
uint16_t RedisCrc16(std::string_view bytes);

struct RedisClusterOptions {
  // Some nodes of the cluster, "host:port"; the rest are learned from them.
  std::vector<std::string> seeds;
  // AUTH on every connection ("" sends none).
  std::string password;
  // A node that makes no progress for this long fails the commands it holds (connecting
  // included). Default: 50 ms.
  uint32_t timeout_ms = 50;
  // Idle connections kept per node (more are opened while more threads need one at once).
  // Default: 8.
  uint32_t max_idle_connections = 8;
  // Reconnection: the first retry of a down node after this long, doubling up to the maximum.
  // Defaults: 20 ms and 2 s.
  uint32_t backoff_min_ms = 20;
  uint32_t backoff_max_ms = 2000;
  // While a node is down, the slot map is read again this often. Default: 100 ms.
  uint32_t refresh_interval_ms = 100;
  // Redirects followed per command. Default: 3.
  uint32_t max_redirects = 3;
};

// A reply, or why none came (status: Unavailable). hiredis's protocol reader builds it through
// our own object functions: a bulk string of 4 KiB or more lands in a RecordBuffer (4 KiB-
// aligned, its padding zeroed), so a tier can adopt a value read from the cluster as a bundle's
// record without another copy (TakeBuffer).
class RedisReply {
 public:
  enum class Type : uint8_t { kNone, kString, kNil, kInteger, kStatus, kError, kArray };
  struct Node;

  RedisReply() = default;
  explicit RedisReply(Status failed) : status_(std::move(failed)) {}
  // Takes over a reply the reader built (see the reader functions in redis_cluster.cc).
  explicit RedisReply(Node* n);
  RedisReply(RedisReply&&) noexcept = default;
  RedisReply& operator=(RedisReply&&) noexcept = default;

  Type type() const;
  const Status& status() const { return status_; }
  bool ok() const { return status_.ok() && node_ != nullptr; }
  std::string_view str() const;  // string, status and error replies
  int64_t integer() const;
  size_t size() const;  // array elements
  // Element i of an array reply (a view valid while this reply lives).
  const Node* element(size_t i) const;
  static Type TypeOf(const Node* n);
  static std::string_view StrOf(const Node* n);
  static int64_t IntegerOf(const Node* n);
  static size_t SizeOf(const Node* n);
  static const Node* ElementOf(const Node* n, size_t i);
  // A string reply's bytes as a RecordBuffer of at least str().size() bytes, moved out (an
  // empty buffer if the string was small, or was taken already).
  RecordBuffer TakeBuffer();

 private:
  struct Free {
    void operator()(Node* n) const;
  };
  Status status_;
  std::unique_ptr<Node, Free> node_;
};

// One command: its arguments (the caller keeps their bytes alive during Execute) and which one
// is the key that routes it.
struct RedisCommand {
  std::vector<std::string_view> args;
  size_t key_index = 1;
};

struct RedisClusterStats {
  uint64_t nodes = 0;             // primaries in the slot map
  uint64_t nodes_down = 0;        // nodes marked down now
  uint64_t slots_uncovered = 0;   // slots with no node, or with a node that is down
  uint64_t incidents = 0;         // times a node went down
  uint64_t failed_commands = 0;   // commands failed by a node failure (answered Unavailable)
  uint64_t timeouts = 0;          // node failures that were a timeout
  uint64_t redirects = 0;         // MOVED and ASK replies followed
  uint64_t refreshes = 0;         // slot maps read
  uint64_t connections_opened = 0;  // connections opened to nodes (the idle ones kept are reused)
};

class RedisCluster {
 public:
  // Starts the background thread, which reads the slot map from the seeds. An unreachable
  // cluster is not an error: commands fail as Unavailable until it is reached. Errors: no
  // seed, a seed that is not host:port.
  static Result<std::unique_ptr<RedisCluster>> Open(const RedisClusterOptions& options);
  ~RedisCluster();
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  // One reply per command, in order (see the file comment).
  std::vector<RedisReply> Execute(std::span<const RedisCommand> commands);

  // Waits until every slot is served by a node that is up (true), or the time is over (false).
  bool WaitCovered(std::chrono::milliseconds within);
  // Asks the background thread to read the slot map now.
  void RequestRefresh();

  RedisClusterStats Stats() const;

  struct Node;
  struct Connection;

 private:
  explicit RedisCluster(RedisClusterOptions options);
  struct Routed;
  // Index of the node at `address` ("host:port"), added when new.
  size_t NodeIndex(const std::string& address) SPARSEKV_REQUIRES(mu_);
  std::unique_ptr<Connection> TakeConnection(size_t node, std::chrono::steady_clock::time_point deadline,
                                             Status* why);
  void ReturnConnection(size_t node, std::unique_ptr<Connection> c);
  void NodeFailed(size_t node, const Status& why, bool timeout);
  void NodeReached(size_t node);
  std::string NodeAddress(size_t node) const;
  // One round: sends `routed` (commands with their nodes) and fills their replies.
  void RunRound(std::span<const RedisCommand> commands, std::vector<Routed>& routed, std::vector<RedisReply>& out);
  bool RefreshSlots();
  void Maintain();

  const RedisClusterOptions options_;
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Node>> nodes_ SPARSEKV_GUARDED_BY(mu_);
  std::array<int32_t, kRedisSlots> slots_ SPARSEKV_GUARDED_BY(mu_);  // node index, -1: none
  RedisClusterStats stats_ SPARSEKV_GUARDED_BY(mu_);
  bool refresh_asked_ SPARSEKV_GUARDED_BY(mu_) = true;
  bool stop_ SPARSEKV_GUARDED_BY(mu_) = false;
  std::condition_variable_any wake_;
  std::condition_variable_any covered_;
  std::thread maintainer_;
};

}  // namespace sparsekv::offload
