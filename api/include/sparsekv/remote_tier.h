// RemoteTier: bundles in a Redis Cluster that several daemons (or engines) share, so that a
// prefix computed on one machine hits on another. Last in a tier chain (Tier::remote()).
//
// Each bundle is one Redis value: its record as every tier stores it (bundle.h), checksum
// included, under the key "<key_prefix>:<namespace label>:<32 hex digits of the block hash>".
// The namespace label is the daemon's namespace name (`namespace_labels`), so two daemons that
// list the same namespaces in a different order still share; a record written under another
// namespace id is checked as written, then re-stamped with the reader's id. A put is a small
// Lua script that replaces the value only when the new record's sequence is larger (tier.h:
// a copy never overwrites a newer one), sequences being comparable across machines because a
// chain with a remote tier draws them from the clock (tier_chain.h); an erase of older copies
// is a script too, reading only the 8 bytes of the stored sequence.
//
// Routing follows the Redis Cluster specification (CRC16 key slots, CLUSTER SLOTS, MOVED and
// ASK); commands of a batch are pipelined per node and sent to all nodes at once. Eviction is
// Redis's own (maxmemory-policy allkeys-lru): a miss is normal.
//
// Failures are misses, never errors and never stalls: a node that makes no progress for
// `timeout_ms` (connecting included) or drops its connection fails the commands it holds;
// until it answers a PING again (retried with exponential backoff) or the slot map moves its
// slots to a promoted replica, its keys miss at once. Gets and contains answer NotFound /
// false for them, puts fail (the chain keeps the key's newer version known, tier_chain.h), and
// each incident is logged once. Stats() counts them; Metrics() gives the tier's state.
//
// Puts are queued and run on the tier's writer threads (PutAsync returns at once); past
// `max_pending_write_bytes` a put is refused (ResourceExhausted). Gets, contains and erases
// run on the caller's thread, which waits at most `timeout_ms` per stalled node.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sparsekv/tier.h"

namespace sparsekv {

struct RemoteTierOptions {
  // Name used in messages and statistics. Default: "remote".
  std::string name = "remote";
  // Some nodes of the cluster, "host:port" (the others are learned). Default: none (must be set).
  std::vector<std::string> nodes;
  // AUTH password of the cluster ("" sends none). Default: "".
  std::string password;
  // First part of every key, so that several deployments can share a cluster. Default: "skv".
  std::string key_prefix = "skv";
  // Label of namespace id i + 1 is namespace_labels[i] (the daemon's namespace names); other
  // ids are labelled "ns<id>". Default: none.
  std::vector<std::string> namespace_labels;
  // A node that makes no progress for this long fails its commands (as misses). Default: 50 ms.
  uint32_t timeout_ms = 50;
  // Idle connections kept per node (more are opened while more threads read at once).
  // Default: 8.
  uint32_t connections_per_node = 8;
  // Largest record stored; larger puts are refused (InvalidArgument). Default: 64 MiB.
  uint64_t max_record_bytes = 64ull << 20;
  // Bytes of queued puts; past it a put is refused (ResourceExhausted). Default: 256 MiB.
  uint64_t max_pending_write_bytes = 256ull << 20;
  // Threads running queued puts. Default: 2.
  uint32_t writer_threads = 2;
  // Reported as the tier's capacity (Redis's maxmemory decides what is kept). Default: 0.
  uint64_t capacity_bytes = 0;
};

// The cluster as the tier sees it.
struct RemoteTierState {
  bool healthy = false;        // every slot served by a node that answers
  uint64_t nodes = 0;          // primaries serving slots
  uint64_t nodes_down = 0;     // marked down (a dead primary replaced by its replica stays
                               // counted, and probed, until it answers again)
  uint64_t slots_uncovered = 0;
  uint64_t incidents = 0;
  uint64_t failed_commands = 0;  // answered as misses or failed puts because a node failed
  uint64_t timeouts = 0;
  uint64_t redirects = 0;
  uint64_t slot_map_refreshes = 0;
  uint64_t connections_opened = 0;
  uint64_t pending_write_bytes = 0;
  uint64_t write_refusals = 0;  // puts refused for want of queue room
};

class RemoteTier : public Tier {
 public:
  // Errors: no node, a node that is not host:port, a key prefix with '{' or '}', zero limits.
  // An unreachable cluster is not an error (its keys miss until it is reached).
  static Result<std::unique_ptr<RemoteTier>> Open(const RemoteTierOptions& options);

  bool remote() const override { return true; }
  virtual RemoteTierState State() const = 0;
  // Waits until every slot is served by a node that answers; false if not within `within`.
  virtual bool WaitHealthy(std::chrono::milliseconds within) = 0;
  // The Redis key of `key` (for tests and tools).
  virtual std::string RedisKey(const BundleKey& key) const = 0;
};

}  // namespace sparsekv
