// Tier: one level of offload storage for bundles (host DRAM, SSD slabs, RocksDB).
//
// Every operation is batched and asynchronous: it takes a batch of bundles or keys and calls
// `done` exactly once with one result per item, in the order of the batch. `done` may run
// before the call returns (on the caller's thread: the host tier always does so) or later on
// one of the tier's threads; it must not block for long. Items of one batch succeed or fail
// independently. The future-returning forms wrap the callback forms.
//
// A tier has a capacity in bytes and evicts bundles to make room for new ones, in its eviction
// policy's order (eviction_policy.h; ARC unless set otherwise). It checks the checksum of every bundle it reads (bundle.h): a bundle that fails is
// reported as Corruption (data_loss), counted in TierStats::corrupt, erased, and never
// returned. Putting a key that is present replaces its bundle, unless the bundle held has a
// larger sequence (bundle.h): a copy never overwrites a newer one, so a late write-back or
// onload of an old version cannot undo a newer put. Such a put is skipped, reported OK, and
// counted in TierStats::superseded.
//
// Space holds bytes, not slots: a tier that is full evicts its policy's victims until
// the new one fits, and refuses a put only for a record larger than the tier can ever hold
// (InvalidArgument) or when everything it could evict is being read (ResourceExhausted).
//
// Ownership: a tier shares the bundles it is given (BundlePtr) and returns new ones it owns
// jointly with the caller. Destroying a tier first completes every operation in flight.
// Thread safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/bundle.h"
#include "sparsekv/status.h"

namespace sparsekv {

// When a tier's acknowledgement means the data would survive a power cut, not only a crash of
// the process (which loses nothing acknowledged under every policy).
enum class Durability : uint8_t {
  kNone = 0,   // no flush: the device's and the kernel's caches may still hold acknowledged data
  kFdatasync,  // fdatasync of the data before the index entries naming it are written (synced)
  kDsync,      // every data write with RWF_DSYNC / O_DSYNC, index writes synced
};
std::string_view DurabilityName(Durability d);
Result<Durability> ParseDurability(std::string_view name);  // "none", "fdatasync", "dsync"

struct TierStats {
  std::string name;
  uint64_t capacity_bytes = 0;
  uint64_t bytes = 0;         // record bytes of the bundles held
  uint64_t items = 0;         // bundles held
  uint64_t hits = 0;          // gets that returned a bundle
  uint64_t misses = 0;        // gets of absent keys
  uint64_t puts = 0;          // bundles stored
  uint64_t put_failures = 0;  // puts refused or failed (full, too large, I/O error)
  uint64_t evictions = 0;     // bundles dropped for room
  uint64_t erased = 0;        // bundles erased on request
  uint64_t superseded = 0;    // puts skipped because the tier held a newer copy of the key
  uint64_t corrupt = 0;       // bundles that failed their checks on read (then erased)
  // Reads that found a record of another bundle format version (another release's): misses,
  // the record left in place for its writer and for eviction (bundle.h).
  uint64_t other_version = 0;
  uint64_t io_errors = 0;     // operations the device failed
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  // Hints (Tier::Hint), in a tier that evicts by policy: bundles protected now and their record
  // bytes, keys hinted (held or not), and hinted bundles left unprotected by the hint bound.
  uint64_t protected_items = 0;
  uint64_t protected_bytes = 0;
  uint64_t hinted_keys = 0;
  uint64_t hint_cut = 0;
};

// A figure of a tier's own beyond TierStats (the remote tier's state), for /metrics.
struct TierMetric {
  std::string name;  // "sparsekv_remote_..." (a Prometheus metric name)
  std::string help;
  bool counter = false;  // a counter, else a gauge
  double value = 0;
};

// The keys a tier added and removed, in the order it did (Tier::SetKeyJournal): a reader that
// mirrors the tier's key set (sparsekvd's KV-event tracker) applies them instead of listing the
// tier. Thread-safe; a tier notes under its own lock, so the order is the tier's.
class KeyJournal {
 public:
  explicit KeyJournal(size_t max_entries) : max_entries_(max_entries) {}
  void Note(const BundleKey& key, bool present) {
    std::lock_guard<std::mutex> l(mu_);
    if (changes_.size() >= max_entries_) {
      overflowed_ = true;  // the reader lists the tier instead
      return;
    }
    changes_.emplace_back(key, present);
  }
  // The changes noted since the last Take, in order. `*overflowed` true when some were not kept
  // (more than max_entries between two takes): the reader must list the tier to know its keys.
  std::vector<std::pair<BundleKey, bool>> Take(bool* overflowed) {
    std::lock_guard<std::mutex> l(mu_);
    *overflowed = overflowed_;
    overflowed_ = false;
    std::vector<std::pair<BundleKey, bool>> out;
    out.swap(changes_);
    return out;
  }

 private:
  const size_t max_entries_;
  std::mutex mu_;
  std::vector<std::pair<BundleKey, bool>> changes_;
  bool overflowed_ = false;
};

class Tier {
 public:
  using StatusesCallback = std::function<void(std::vector<Status>)>;
  using BundlesCallback = std::function<void(std::vector<Result<BundlePtr>>)>;
  using ContainsCallback = std::function<void(std::vector<bool>)>;
  // Bundles a tier evicted, handed over so that the next tier can keep them (write-back).
  using EvictionListener = std::function<void(std::vector<BundlePtr>)>;

  virtual ~Tier() = default;

  virtual std::string_view name() const = 0;
  virtual uint64_t capacity_bytes() const = 0;
  // The largest record this tier can store.
  virtual uint64_t max_record_bytes() const = 0;
  virtual TierStats Stats() const = 0;

  // Per item: OK, InvalidArgument (too large), ResourceExhausted (no room even after
  // eviction), IOError. An OK item is readable, and survives a crash as Durability says.
  virtual void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) = 0;
  // Per item: the bundle, NotFound, Corruption (data_loss; the bundle was erased) or IOError.
  virtual void GetAsync(std::vector<BundleKey> keys, BundlesCallback done) = 0;
  // Per item: whether a get would find it (it may still turn out corrupt).
  virtual void ContainsAsync(std::vector<BundleKey> keys, ContainsCallback done) = 0;
  // Per item: OK (erased, or was absent) or an error; an erased key is not found again, even
  // after a restart.
  virtual void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) = 0;
  // Per item: erases the copy of keys[i] if its sequence is below `below[i]` (a newer version
  // was written elsewhere, or the key was deleted); a copy at or above it stays. OK when erased
  // or when nothing older was held; durable like EraseAsync.
  virtual void EraseOlderAsync(std::vector<BundleKey> keys, std::vector<uint64_t> below,
                               StatusesCallback done) = 0;
  // The largest sequence of any bundle held (0 when empty): where a chain reopened over this
  // tier resumes numbering, so new versions sort after everything that survived a restart.
  virtual uint64_t max_sequence() const { return 0; }

  // A tier on other machines, shared by several chains (RemoteTier). A chain writes it in the
  // background after every demote and never waits for it on a write's path, never moves
  // evicted bundles into it, and reads it only for keys no local tier holds (tier_chain.h).
  virtual bool remote() const { return false; }
  // Every key the tier holds, when it keeps an index in memory (host, SSD, RocksDB); a tier
  // that cannot list its keys cheaply (a remote cluster) returns nullopt.
  virtual std::optional<std::vector<BundleKey>> ListKeys() const { return std::nullopt; }
  // From now on, notes every key added to or removed from what ListKeys lists in `journal`
  // (null stops it); false when the tier cannot (its reader lists it instead).
  virtual bool SetKeyJournal(std::shared_ptr<KeyJournal> journal) { return false; }
  // Figures beyond TierStats, for /metrics.
  virtual std::vector<TierMetric> Metrics() const { return {}; }

  // A scheduler will read `keys` soon (on) or no longer says so (off); each Hint(keys, true)
  // is undone by one Hint(keys, false). A tier that evicts by policy (host, SSD) protects a
  // hinted key's bundle, held now or stored while hinted: it is evicted only when nothing else
  // can be, and at most the tier's hint bound of bytes is protected. Others ignore hints.
  virtual void Hint(std::span<const BundleKey> keys, bool on) {}

  // Tiers that keep evicted bundles' bytes at hand (the host tier) pass them to `listener`,
  // on the thread that caused the eviction, outside the tier's locks. Others return
  // NotSupported: their evictions are final. Set before the tier is shared.
  virtual Status SetEvictionListener(EvictionListener listener) {
    return Status::NotSupported(std::string(name()) + " tier does not hand over evicted bundles");
  }

  // Future forms.
  std::future<std::vector<Status>> Put(std::vector<BundlePtr> bundles);
  std::future<std::vector<Result<BundlePtr>>> Get(std::vector<BundleKey> keys);
  std::future<std::vector<bool>> Contains(std::vector<BundleKey> keys);
  std::future<std::vector<Status>> Erase(std::vector<BundleKey> keys);
  std::future<std::vector<Status>> EraseOlder(std::vector<BundleKey> keys,
                                              std::vector<uint64_t> below);
};

}  // namespace sparsekv
