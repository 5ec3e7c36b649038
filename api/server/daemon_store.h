// DaemonStore: what sparsekvd serves. Bundles of opaque bytes filed per namespace under block
// hashes, kept in a chain of offload tiers (host memory first, then SSD or RocksDB), with pins
// and KV events per namespace.
//
// A namespace id is given by the server after HELLO; every method reads and writes only that
// namespace's keys, so one namespace can neither read nor learn of another's blocks.
// Thread safety: every method is thread-safe; methods block on tier I/O, so the server calls
// them from its worker threads, except the two made for its network threads
// (TryGetWithoutBlocking, TryPutWithoutBlocking).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "protocol/wire.h"
#include "sparsekv/status.h"

namespace sparsekv::server {

struct DaemonStoreOptions;

class DaemonStore {
 public:
  virtual ~DaemonStore() = default;

  // Longest run of leading hashes present in some tier, and the tier of each hash.
  virtual wire::LookupReply Lookup(uint32_t ns, std::span<const wire::WireHash> hashes) = 0;
  // Whether Lookup answers from memory without waiting for I/O (no tier asks another machine),
  // so a network thread may serve a LOOKUP itself instead of handing it to a worker.
  virtual bool LooksUpWithoutBlocking() const { return false; }
  virtual std::vector<wire::ItemStatus> Put(uint32_t ns, std::span<const wire::PutItem> items) = 0;
  // As Put, for a network thread: false, having done nothing, when the store cannot take the
  // items without waiting for tier I/O. Otherwise the items' bytes are copied by the time it
  // returns (the caller may free them), and `done` gets Put's answer exactly once: on this
  // thread when nothing below has to be waited for, else later on a tier's thread.
  using PutDone = std::function<void(std::vector<wire::ItemStatus>)>;
  virtual bool TryPutWithoutBlocking(uint32_t ns, std::span<const wire::PutItem> items, PutDone done) {
    return false;
  }
  // Whether TryPutWithoutBlocking may take items at all (the server reads such PUTs whole
  // into its receive buffer, to be stored from there).
  virtual bool PutsWithoutBlocking() const { return false; }
  // Calls `sink(i, status, bytes, keep)` once per hash, in order. `bytes` stays valid while a
  // copy of `keep` is held (a reply can then be sent from them without copying); with a null
  // `keep`, only during the call.
  using Keep = std::shared_ptr<const void>;
  using GetSink = std::function<void(size_t, const Status&, std::span<const std::byte>, const Keep&)>;
  virtual void Get(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink) = 0;
  // As Get, but a value the host tier holds is handed out in place, in its arena, pinned while
  // its `keep` lives (checked first): for a shared-memory GET that may lend it. The rest as Get.
  virtual void GetInPlace(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink) {
    Get(ns, hashes, sink);
  }
  // As Get, but only when every hash can be served at once from memory without blocking;
  // returns false, having called `sink` for nothing, otherwise. Network threads call it to
  // skip the hop to a worker thread for the common hit. With `check` false the bytes are not
  // checked yet: the caller must pass each item's `keep` to Recheck before anyone trusts them.
  virtual bool TryGetWithoutBlocking(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink,
                                     bool check) {
    return false;
  }
  // Checks bytes TryGetWithoutBlocking handed out unchecked; a damaged bundle is dropped (and
  // reported as removed) and Corruption returned.
  virtual Status Recheck(uint32_t ns, const wire::WireHash& hash, const Keep& keep) { return Status::OK(); }
  // GET_RANGES: calls `sink(i, status, bytes)` once per item, in order, `bytes` being the
  // item's ranges of its value back to back (valid during the call). A store may read no more
  // of a value than its ranges need (TieredStore's SSD tier: the 4 KiB sectors holding them),
  // and then does not check the whole value's checksum, which would read all of it: ranges
  // carry their own checks (sparse records, api/PROTOCOL.md). Per item: NotFound,
  // InvalidArgument (a range past the value's end), IOError. The default reads each value
  // whole with Get.
  using RangesSink = std::function<void(size_t, const Status&, std::span<const std::byte>)>;
  virtual void GetRanges(uint32_t ns, std::span<const wire::RangeItem> items, const RangesSink& sink);
  // Memory the store's GET bytes may lie in, with a memfd another process can map (the
  // shared-memory path lends bundles in place from it). fd -1: none.
  struct Arena {
    int fd = -1;
    const std::byte* base = nullptr;
    uint64_t bytes = 0;
  };
  virtual Arena SharedArena() const { return {}; }
  // Local reads (api/PROTOCOL.md): the host tier's lend table (HostTier::lend_table), a memfd of
  // one u32 per 4 KiB unit of SharedArena(); fd -1: none.
  virtual Arena LendTable() const { return {}; }
  // For an item TryGetWithoutBlocking lent in place (its `keep`): the token a client may read
  // it again with, locally, while its lend-table entry stays the same, with its record's offset
  // in SharedArena() and checksum; a token of 0 when it may not (not the host tier's current
  // copy of the key, no table).
  virtual wire::LendInfo Lend(uint32_t ns, const wire::WireHash& hash, const Keep& keep) { return {}; }
  // Values clients read locally since (TOUCH): each held one counts as a GET hit now (eviction
  // order, statistics). Returns how many were held.
  virtual uint64_t TouchRead(uint32_t ns, std::span<const wire::WireHash> hashes) { return 0; }

  // Write leases (api/PROTOCOL.md, PUT_LEASE): room for one value's record in SharedArena(),
  // its header written, its value's bytes for a client to fill in place. Destroying it
  // uncommitted gives the room back, nothing published.
  class PutReservation {
   public:
    virtual ~PutReservation() = default;
    virtual uint64_t value_offset() const = 0;  // of the value's first byte, from the arena's base
    virtual uint64_t value_bytes() const = 0;
  };
  // Reserves room for a new version of `hash` of `bytes` bytes. With `shared` (a write lease,
  // for a client to fill) the arena must be one another process can map; without (a room the
  // daemon fills itself, CommitWritten) any host memory serves. Errors: NotSupported (no such
  // arena), as a PUT's (too large, no room).
  virtual Result<std::unique_ptr<PutReservation>> ReservePut(uint32_t ns, const wire::WireHash& hash,
                                                             uint64_t bytes, bool shared = true) {
    return Status::NotSupported("this store takes no write leases");
  }
  // Checks each reserved record against `checksums[i]` (the record's XXH3-64) and publishes
  // those that match, as a PUT of them would; `done` gets one status per reservation, once, on
  // this thread or a tier's (TryPutWithoutBlocking's rule). A mismatch is Corruption, nothing
  // published. Does not wait for tier I/O when PutsWithoutBlocking().
  virtual void CommitPuts(uint32_t ns, std::vector<std::unique_ptr<PutReservation>> reserved,
                          std::vector<uint64_t> checksums, PutDone done) {
    done(std::vector<wire::ItemStatus>(reserved.size(), {StatusCode::kNotSupported, "no write leases"}));
  }
  // A room the daemon filled itself (no client could write it: a large RESP SET received
  // straight into it). Unlike CommitPuts, the version is ordered as of this call, not of its
  // reservation, as a PUT made now would be: a PUT of the same key acknowledged while the room
  // was being filled does not win over it. The record is hashed here; `done` as CommitPuts's.
  virtual void CommitWritten(uint32_t ns, std::unique_ptr<PutReservation> room, PutDone done) {
    done(std::vector<wire::ItemStatus>(1, {StatusCode::kNotSupported, "no reservations"}));
  }

  virtual std::vector<wire::ItemStatus> Pin(uint32_t ns, std::span<const wire::WireHash> hashes,
                                            uint8_t priority) = 0;
  virtual std::vector<wire::ItemStatus> Unpin(uint32_t ns, std::span<const wire::WireHash> hashes) = 0;
  virtual std::vector<wire::ItemStatus> Delete(uint32_t ns, std::span<const wire::WireHash> hashes) = 0;
  virtual std::string StatsJson(uint32_t ns) = 0;
  // The largest value a PUT can store (what every tier a PUT writes can hold); a larger one is
  // refused, and refused before anything stored changes by callers that check it first.
  virtual uint64_t MaxValueBytes() const { return UINT64_MAX; }
  // Every block hash namespace `ns` holds in a local tier or a pin, sorted (high 64 bits, then
  // low) and without duplicates: what RESP's DBSIZE, SCAN and FLUSHDB enumerate. A remote tier
  // shared by other daemons is not listed. The default lists nothing.
  virtual std::vector<wire::WireHash> ListHashes(uint32_t ns) { return {}; }
  // Per tier, fastest first: its name, capacity and what it holds (RESP's INFO).
  struct TierInfo {
    std::string name;
    uint64_t capacity_bytes = 0, bytes = 0, items = 0, hits = 0, misses = 0, evictions = 0, corrupt = 0;
    bool remote = false;
  };
  virtual std::vector<TierInfo> Tiers() { return {}; }

  // HINT: session `session` says the blocks `hashes` of `ns` will be read soon. Every tier that
  // evicts by policy protects them (tier.h, Tier::Hint) and blocks held only below the first
  // tier are brought up into it, until the time to live ends, DropHint, or EndSession.
  // InvalidArgument for a time to live above the store's maximum; ResourceExhausted when the
  // session would hint more blocks than its bound. The default answers NotSupported.
  virtual Result<wire::HintReply> Hint(uint64_t session, uint32_t ns, std::span<const wire::WireHash> hashes,
                                       uint32_t ttl_ms) {
    return Status::NotSupported("this store takes no hints");
  }
  // Ends a hint of `session` early. NotFound when the session holds no such hint (never given,
  // dropped, expired, or another session's).
  virtual Status DropHint(uint64_t session, uint64_t hint) { return Status::NotFound("no such hint"); }
  // The session is gone: its hints end.
  virtual void EndSession(uint64_t session) {}

  // Events of namespace `ns` go to `sink` (from whichever thread made the change).
  using EventSink = std::function<void(const wire::EventRecord&)>;
  virtual uint64_t Subscribe(uint32_t ns, EventSink sink) = 0;
  virtual void Unsubscribe(uint64_t subscription) = 0;

  // Per-tier gauges and counters in Prometheus text.
  virtual void RenderMetrics(std::string& out) = 0;
  // At a graceful stop: makes every acknowledged bundle durable and the tier indexes current
  // (under write-back, what only host memory holds is copied to the tier below first).
  virtual Status Flush() = 0;
};

}  // namespace sparsekv::server
