// KV events: what a cache manager tells a router about the blocks it holds.
//
// "Blocks stored" carries the block hashes (see block_hash.h), the parent of the first one and
// the cache kinds stored; "blocks removed" the hashes and the kinds that are gone (a block can
// lose its sliding-window or compressor-snapshot pages and keep its full-history ones: it is then
// still a prefix, but no longer a point to resume from; a later "stored" event with just those
// kinds says it got them back); "all cleared" says everything is gone. With the model's kinds a
// router can tell which prefixes a cache can resume.
//
// Events are values. A manager delivers them to each subscriber in the order the changes
// happened (`sequence_number` increases by one per event), after its lock is released, on a
// thread calling into it: usually the one that made the change, which returns only once its
// events have been delivered; see cache_manager.h.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/block_hash.h"
#include "sparsekv/storage_format.h"

namespace sparsekv {

// A set of cache kinds, one bit per CacheKind.
class KindSet {
 public:
  constexpr KindSet() = default;
  static constexpr KindSet Of(CacheKind k) {
    return KindSet(static_cast<uint8_t>(1u << static_cast<int>(k)));
  }
  constexpr bool Has(CacheKind k) const { return (bits_ >> static_cast<int>(k)) & 1u; }
  constexpr void Add(CacheKind k) { bits_ |= static_cast<uint8_t>(1u << static_cast<int>(k)); }
  constexpr void Add(KindSet s) { bits_ |= s.bits_; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr uint8_t bits() const { return bits_; }
  constexpr bool operator==(const KindSet&) const = default;
  // Kinds in enum order.
  std::vector<CacheKind> Kinds() const;
  // "mla_latent,indexer_key".
  std::string ToString() const;

 private:
  constexpr explicit KindSet(uint8_t bits) : bits_(bits) {}
  uint8_t bits_ = 0;
};

enum class KvEventType : uint8_t {
  kBlocksStored = 0,
  kBlocksRemoved,
  kAllCleared,
};
std::string_view KvEventTypeName(KvEventType type);

struct KvEvent {
  KvEventType type = KvEventType::kBlocksStored;
  // Position in the manager's event stream: 1, 2, 3, ... with no gaps.
  uint64_t sequence_number = 0;
  // Stored: the kinds written with the blocks. Removed: the kinds the blocks lost. Cleared: empty.
  KindSet kinds;
  // Stored: consecutive blocks of one sequence, in order. Removed: in no particular order.
  std::vector<BlockHash> block_hashes;
  // Stored: the hash of the block before block_hashes[0] (the namespace root for block 0).
  BlockHash parent_hash;
  uint32_t block_tokens = 0;
  // Stored: the blocks' tokens, block_tokens per block, when the manager keeps them
  // (CacheManagerOptions::event_token_ids); empty otherwise.
  std::vector<TokenId> token_ids;
};

// Called once per event, one event at a time. It may call back into the manager; the events its
// calls cause are delivered after it returns. It must not wait for another thread that is itself
// waiting on the manager.
using KvEventListener = std::function<void(const KvEvent&)>;
// A run of events as the manager queued them, flat: each event's hashes and tokens are ranges of
// the run's arrays (no vector per event). KvEventBatchListener's argument.
struct KvEventRecord {
  KvEventType type = KvEventType::kBlocksStored;
  KindSet kinds;
  uint32_t block_tokens = 0;
  uint64_t sequence_number = 0;
  BlockHash parent_hash;
  size_t hash_begin = 0, hash_count = 0;
  size_t token_begin = 0, token_count = 0;
};
struct KvEventRun {
  std::span<const KvEventRecord> events;
  std::span<const BlockHash> hashes;
  std::span<const TokenId> tokens;
  std::span<const BlockHash> HashesOf(const KvEventRecord& e) const { return hashes.subspan(e.hash_begin, e.hash_count); }
  std::span<const TokenId> TokensOf(const KvEventRecord& e) const { return tokens.subspan(e.token_begin, e.token_count); }
  // events[i] as a KvEvent (with its own vectors).
  KvEvent Event(size_t i) const;
};
// Called once per run of events the manager delivers (consecutive sequence numbers, in order),
// after every per-event listener has seen them; the run is valid during the call only. The same
// rules as KvEventListener otherwise. For a sink that copies what it needs in bulk, as
// VllmKvEventPublisher::Attach does: no allocation per event on the manager's side.
using KvEventBatchListener = std::function<void(const KvEventRun&)>;
using SubscriptionId = uint64_t;

}  // namespace sparsekv
