// VllmKvEventPublisher: KV events on vLLM's wire, for routers that read it (llm-d's KV-cache
// indexer, Dynamo's KV router).
//
// The wire, as vLLM's `vllm/distributed/kv_events.py` writes it (docs/guide/kv-events.md names
// the commit read and the readers checked):
// - a ZMQ PUB socket, bound to `endpoint`; each message is three frames: the topic, an 8-byte
//   big-endian sequence number (0, 1, 2, ... per batch), and a msgpack payload
//   `[ts, [events], data_parallel_rank]` (an array: msgspec array_like);
// - each event is a msgpack map whose first key is "type" (msgspec tag=True, no array_like):
//   `BlockStored` {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//   lora_name, then group_idx / kv_cache_spec_kind only when set}, `BlockRemoved`
//   {block_hashes, medium, then group_idx when set}, `AllBlocksCleared` {};
// - an optional ROUTER socket (`replay_endpoint`): a request `[identity, "", start_seq]` gets one
//   reply `[identity, "", topic, seq, payload]` per buffered batch with seq >= start_seq, then
//   `[identity, "", "", -1 (8 bytes, all ones), ""]`.
//
// Hashes are 16 digest bytes; they go out as the 16 bytes (bin) or as their last 8 bytes read
// big-endian (uint64), which is the uint64 llm-d derives from a bytes hash.
//
// Batching and back-pressure: Publish only appends to a bounded queue (never blocks on the
// network); a background thread drains it every `tick_ms` into one batch. Events that find the
// queue full are dropped and counted, and the next batch's sequence number skips one, so a
// subscriber sees the loss as a gap. ZMQ's own high-water mark drops whole messages for a slow
// subscriber: gaps too, which replay fills while they are in the buffer.
//
// Thread safety: every method is thread-safe. The publisher owns its sockets and thread; the
// destructor publishes what is queued (up to a second), then closes them.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/kv_events.h"
#include "sparsekv/status.h"

namespace sparsekv {

class CacheManager;

enum class KvEventHashEncoding : uint8_t {
  kUint64 = 0,  // the last 8 digest bytes, big-endian, as a msgpack uint
  kBytes,       // the 16 digest bytes, as msgpack bin
};
std::string_view KvEventHashEncodingName(KvEventHashEncoding e);
Result<KvEventHashEncoding> ParseKvEventHashEncoding(std::string_view name);  // "uint64", "bytes"

struct VllmKvEventOptions {
  // PUB address, bound (e.g. "tcp://127.0.0.1:5557", "ipc:///run/kv.sock"). Required.
  std::string endpoint;
  // ROUTER address for replay requests, bound; "" for none. Default: "".
  std::string replay_endpoint;
  // First frame of every message. Default: "" (callers build "kv@<pod>@<model>", DefaultTopic).
  std::string topic;
  // How block hashes go out. Default: kUint64.
  KvEventHashEncoding hash = KvEventHashEncoding::kUint64;
  // Recent batches kept for replay. Default: 10000 (vLLM's buffer_steps).
  uint32_t buffer_batches = 10000;
  // Events waiting to be published; more are dropped (a sequence gap). Default: 100000.
  uint32_t max_queued_events = 100000;
  // Events per batch at most. Default: 4096.
  uint32_t max_batch_events = 4096;
  // How often queued events become a batch. Default: 10 ms.
  uint32_t tick_ms = 10;
  // ZMQ send high-water mark of the PUB socket (messages). Default: 100000 (vLLM's hwm).
  int send_hwm = 100000;
  // Third element of every payload. Default: 0.
  int data_parallel_rank = 0;
};

// "kv@<pod>@<model>": pod from $POD_NAME, else the host name.
std::string DefaultKvEventTopic(std::string_view model);

using KvEventDigest = std::array<uint8_t, 16>;
// A cache manager's BlockHash as digest bytes: hi then lo, big-endian (BlockHash::ToHex order),
// so the uint64 form is `lo`.
KvEventDigest DigestOf(const BlockHash& h);

struct VllmKvEvent {
  enum class Type : uint8_t { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Type type = Type::kBlockStored;
  std::vector<KvEventDigest> block_hashes;
  // Stored: the block before block_hashes[0]; none for a first block or when unknown.
  std::optional<KvEventDigest> parent_block_hash;
  // Stored: the blocks' tokens, block_size per block (empty when not known).
  std::vector<uint32_t> token_ids;
  uint32_t block_size = 0;
  // "GPU", "CPU", "DISK", "SHARED"; "" goes out as nil.
  std::string medium;
  // Optional fields vLLM sends for hybrid models; omitted when unset (msgspec omit_defaults).
  std::optional<int> group_idx;
  std::optional<std::string> kv_cache_spec_kind;
};

struct VllmKvEventStats {
  uint64_t published_batches = 0;
  uint64_t published_events = 0;
  uint64_t accepted_events = 0;  // queued by Publish since the start (not dropped), in order
  uint64_t dropped_events = 0;   // found the queue full
  uint64_t sequence_gaps = 0;    // sequence numbers skipped for them
  uint64_t replay_requests = 0;
  uint64_t replayed_batches = 0;
  uint64_t queued_events = 0;    // now
  uint64_t next_sequence = 0;
};

class VllmKvEventPublisher {
 public:
  // Binds the sockets and starts the thread; InvalidArgument for a bad endpoint (with ZMQ's
  // reason), e.g. a port in use.
  static Result<std::unique_ptr<VllmKvEventPublisher>> Start(const VllmKvEventOptions& options);
  ~VllmKvEventPublisher();
  VllmKvEventPublisher(const VllmKvEventPublisher&) = delete;
  VllmKvEventPublisher& operator=(const VllmKvEventPublisher&) = delete;

  // Queues events, in order; never blocks on subscribers. Returns how many were dropped.
  size_t Publish(std::vector<VllmKvEvent> events);
  size_t Publish(VllmKvEvent event);
  // Waits until what was queued before the call is published (tests, shutdown).
  void Flush();
  VllmKvEventStats Stats() const;
  const VllmKvEventOptions& options() const;

  // Publishes `manager`'s events (kv_events.h) with `medium`: stored blocks with their parent
  // and token ids (when the manager keeps them: CacheManagerOptions::event_token_ids), removed
  // blocks, all cleared. The publisher must outlive the subscription (Unsubscribe it first).
  SubscriptionId Attach(CacheManager& manager, std::string medium = "GPU");
  // The vLLM form of one manager event (kBlocksRemoved of only window or snapshot kinds is
  // not a removal of the block: none is returned).
  static std::optional<VllmKvEvent> FromCacheEvent(const KvEvent& e, const std::string& medium);

  // The msgpack payload of one batch (what the third frame carries).
  static std::vector<uint8_t> EncodeBatch(double ts, std::span<const VllmKvEvent> events, KvEventHashEncoding hash,
                                          int data_parallel_rank);

 private:
  class Impl;
  explicit VllmKvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsekv
