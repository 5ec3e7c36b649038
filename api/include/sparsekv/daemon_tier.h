// DaemonTier: a running sparsekvd as a tier of an in-process TierChain, through the client
// library (client.h), so an engine's OffloadedCache keeps its blocks and its suspended
// sequences' tail records (OffloadedCache::Suspend) in the daemon the engines share, next to
// the request log it keeps there (LOG_*).
//
// Every bundle is stored as one value: its whole record (bundle.h) under its 16-byte hash, in
// the client's namespace. BundleKey::namespace_id is not part of the daemon's key: use one
// OffloadedCache namespace per daemon namespace. A value read back is checked as any record
// (magic, sizes, XXH3, the key): a value that is not a good record of its key is Corruption,
// and is deleted.
//
// Versions: the daemon keeps one value per key, the last PUT. EraseOlder reads the value and
// deletes it when its record's sequence is below the bound, which another writer's PUT between
// the two can defeat: do not share keys between chains that write different versions of them
// (content-named blocks and tails are written with the same bytes by everyone).
//
// Calls are synchronous on the calling thread (the callbacks run before the *Async call
// returns). Thread safety: as the client, every method is thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "sparsekv/client.h"
#include "sparsekv/tier.h"

namespace sparsekv {

struct DaemonTierOptions {
  ClientOptions client;
  // Name in messages and statistics. Default: "daemon".
  std::string name = "daemon";
  // The largest record put. Default: 64 MiB (the protocol's largest payload).
  uint64_t max_record_bytes = 64ull << 20;
};

class DaemonTier : public Tier {
 public:
  // Connects. Errors: the client's (an unreachable daemon, a refused namespace or token).
  static Result<std::unique_ptr<DaemonTier>> Open(const DaemonTierOptions& options);
};

}  // namespace sparsekv
