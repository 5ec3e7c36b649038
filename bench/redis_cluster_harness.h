// RedisClusterHarness: a real Redis Cluster on loopback, for the remote tier's tests and for
// `sparsekv stress cluster` / `sparsekv bench remote`.
//
// Start launches `primaries × (1 + replicas)` redis-server processes from Debian's
// redis-server (each with its own directory under a temporary one), joins them with
// `redis-cli --cluster create ... --cluster-replicas N`, and waits until every node reports
// the cluster ok and every replica is in sync. Nodes run with maxmemory-policy allkeys-lru, no
// persistence, and cluster-require-full-coverage no (a failed primary's slots fail; the rest go
// on). Kill sends SIGKILL to one node. The harness stops (SIGKILL, then reaps) only the
// processes it started, at destruction, and removes its directory unless `keep`; if this
// process dies first, its servers get SIGKILL from the kernel (PR_SET_PDEATHSIG).
//
// Thread safety: one thread at a time; the thread that calls Start must outlive the harness
// (the servers are tied to it).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct RedisClusterHarnessOptions {
  // Primaries, and replicas of each. Defaults: 3 and 1.
  int primaries = 3;
  int replicas = 1;
  // cluster-node-timeout: how long a silent node takes to be failed over. Default: 1000 ms.
  uint32_t node_timeout_ms = 1000;
  // maxmemory of each node (allkeys-lru evicts beyond it). Default: 512 MiB.
  uint64_t maxmemory_bytes = 512ull << 20;
  // The temporary directory is made under this ("" : the system's). Default: "".
  std::string dir;
  // Leave the directory (node logs, nodes.conf) behind. Default: false.
  bool keep = false;
  // The nodes' ports, primaries first (empty: free ports are picked; the cluster bus uses port
  // + 10000). Default: none.
  std::vector<uint16_t> ports;
  // The binaries. Defaults: found on PATH.
  std::string redis_server = "redis-server";
  std::string redis_cli = "redis-cli";
  // How long Start may take. Default: 60 s.
  std::chrono::milliseconds start_timeout{60000};
};

class RedisClusterHarness {
 public:
  struct Node {
    uint16_t port = 0;
    pid_t pid = -1;
    bool alive = false;
    bool primary = false;  // as of the last Refresh (Start and WaitHealthy refresh)
    std::string id;        // the cluster's node id
    std::string address() const { return "127.0.0.1:" + std::to_string(port); }
  };

  // `n` ports free now, each with its cluster bus port (10000 above) free too, drawn from
  // 20000-22767 so that the bus ports stay below Linux's ephemeral range (32768-60999), where
  // any outgoing connection could take one before the node binds it.
  static std::vector<uint16_t> FreePorts(size_t n);

  // Errors: the binaries missing, a node that does not start, a cluster that does not form
  // (each names what failed; the log of the node is kept in the message's directory).
  static Result<std::unique_ptr<RedisClusterHarness>> Start(const RedisClusterHarnessOptions& options);
  ~RedisClusterHarness();
  RedisClusterHarness(const RedisClusterHarness&) = delete;
  RedisClusterHarness& operator=(const RedisClusterHarness&) = delete;

  const std::vector<Node>& nodes() const { return nodes_; }
  // Every node's "127.0.0.1:port" (seeds for a client).
  std::vector<std::string> Seeds() const;
  const std::string& dir() const { return dir_; }

  // SIGKILLs node i (and reaps it).
  Status Kill(size_t i);
  // SIGSTOP / SIGCONT node i: a node that stalls without closing its connections.
  Status Pause(size_t i);
  Status Resume(size_t i);
  // Waits until every live node reports cluster_state:ok and all 16384 slots ok, and refreshes
  // the roles. Errors: not within `within`.
  Status WaitHealthy(std::chrono::milliseconds within);
  // Waits until each live replica has every write its primary has (replication offsets equal).
  Status WaitReplicated(std::chrono::milliseconds within);
  // The node serving `slot` now (a primary), or an error.
  Result<size_t> NodeOfSlot(uint32_t slot);
  // The primary serving each of the 16384 slots now (-1: none), from CLUSTER NODES.
  Result<std::vector<int>> SlotOwners();
  // Moves `slot` from its primary to primary `to` with its keys (CLUSTER SETSLOT IMPORTING /
  // MIGRATING, MIGRATE, SETSLOT NODE), as redis-cli --cluster reshard does. With
  // `leave_migrating`, stops after MIGRATE: the source then answers ASK for the moved keys.
  Status MoveSlot(uint32_t slot, size_t to, bool leave_migrating = false);
  // Sends one command to node i and returns its reply as text ("(nil)", ":1", "+OK", "-ERR
  // ...", a bulk string as is, an array's elements joined by '\n').
  Result<std::string> Command(size_t i, const std::vector<std::string>& args);
  // Rereads every live node's role and id.
  Status Refresh();

 private:
  explicit RedisClusterHarness(RedisClusterHarnessOptions options) : options_(std::move(options)) {}
  Status StartNodes();
  // Starts a redis-server for `n` on n.port; sets its pid.
  Status StartNode(Node& n);
  Status CreateCluster();

  RedisClusterHarnessOptions options_;
  std::string dir_;
  std::vector<Node> nodes_;
};

}  // namespace sparsekv::bench
