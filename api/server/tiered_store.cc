#include "server/tiered_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "sparsekv/host_tier.h"
#include "sparsekv/ssd_tier.h"

namespace sparsekv::server {
namespace {

wire::ItemStatus ToItem(const Status& st) {
  return st.ok() ? wire::ItemStatus{} : wire::ItemStatus{st.code(), std::string(st.message())};
}

// Whether every range lies inside a value of `value_bytes`; InvalidArgument naming the first
// that does not.
Status CheckRanges(std::span<const wire::ByteRange> ranges, uint64_t value_bytes) {
  for (const wire::ByteRange& r : ranges) {
    if (r.offset > value_bytes || r.bytes > value_bytes - r.offset) {
      return Status::InvalidArgument(
          fmt::format("range of {} bytes at {} reaches past the value's {} bytes", r.bytes, r.offset, value_bytes));
    }
  }
  return Status::OK();
}

uint64_t RangesBytes(std::span<const wire::ByteRange> ranges) {
  uint64_t n = 0;
  for (const wire::ByteRange& r : ranges) n += r.bytes;
  return n;
}

// The ranges of `value`, back to back, into `out`.
Status GatherRanges(std::span<const std::byte> value, std::span<const wire::ByteRange> ranges,
                    std::vector<std::byte>& out) {
  SPARSEKV_RETURN_IF_ERROR(CheckRanges(ranges, value.size()));
  out.resize(RangesBytes(ranges));
  std::byte* p = out.data();
  for (const wire::ByteRange& r : ranges) {
    std::memcpy(p, value.data() + r.offset, r.bytes);
    p += r.bytes;
  }
  return Status::OK();
}

// Where a daemon value starts in its record: one segment after the header.
constexpr uint64_t kValueInRecord = BundleHeaderBytes(1);
constexpr uint64_t kSector = 4096;
// No value is this large (a frame holds at most 64 MiB): a range past it is refused unread.
constexpr uint64_t kBeyondAnyValue = 1ull << 40;
// Sectors one item may read from the SSD tier, and a request hold at a time.
constexpr uint64_t kMaxRangeSectors = 256;

// Hands host-tier item `i` to `sink` (the fast paths' answers): a damaged bundle, dropped just
// now, as its error, named in `removed`; a good one with its bytes and the bundle keeping them.
void SinkHostItem(size_t i, const wire::WireHash& hash, const Result<BundlePtr>& r, const DaemonStore::GetSink& sink,
                  uint64_t& hits, uint64_t& bytes, wire::EventRecord& removed) {
  if (!r.ok()) {
    removed.hashes.push_back(hash);
    sink(i, r.status(), {}, nullptr);
    return;
  }
  ++hits;
  bytes += (*r)->payload().size();
  sink(i, Status::OK(), (*r)->segment(0), *r);
}

}  // namespace

void DaemonStore::GetRanges(uint32_t ns, std::span<const wire::RangeItem> items, const RangesSink& sink) {
  std::vector<wire::WireHash> hashes;
  hashes.reserve(items.size());
  for (const wire::RangeItem& it : items) hashes.push_back(it.hash);
  std::vector<std::byte> out;
  Get(ns, hashes, [&](size_t i, const Status& st, std::span<const std::byte> bytes, const Keep&) {
    Status g = st.ok() ? GatherRanges(bytes, items[i].ranges, out) : st;
    sink(i, g, g.ok() ? std::span<const std::byte>(out) : std::span<const std::byte>{});
  });
}

BlockHash FromWire(const wire::WireHash& h) {
  BlockHash b;
  std::memcpy(&b.lo, h.data(), 8);
  std::memcpy(&b.hi, h.data() + 8, 8);
  return b;
}

wire::WireHash ToWire(const BlockHash& b) {
  wire::WireHash h{};
  std::memcpy(h.data(), &b.lo, 8);
  std::memcpy(h.data() + 8, &b.hi, 8);
  return h;
}

Result<std::unique_ptr<TieredStore>> TieredStore::Open(const TieredStoreOptions& options) {
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<TierChain> chain, OpenTierChain(options.offload));
  return std::unique_ptr<TieredStore>(new TieredStore(options, std::move(chain)));
}

TieredStore::TieredStore(const TieredStoreOptions& options, std::unique_ptr<TierChain> chain)
    : options_(options), chain_(std::move(chain)) {
  for (size_t i = 0; i < chain_->tier_count(); ++i) {
    const std::string_view n = chain_->tier(i).name();
    wire_tiers_.push_back(chain_->tier(i).remote()                    ? 4
                          : n.find("host") != std::string_view::npos  ? 1
                          : n.find("rocks") != std::string_view::npos ? 3
                                                                       : 2);
  }
}

TieredStore::~TieredStore() { chain_->WaitIdle(); }

uint8_t TieredStore::WireTier(int chain_index) const {
  return chain_index < 0 ? 0 : wire_tiers_[static_cast<size_t>(chain_index)];
}

wire::LookupReply TieredStore::Lookup(uint32_t ns, std::span<const wire::WireHash> hashes) {
  ExpireHints();
  std::vector<BundleKey> keys;
  keys.reserve(hashes.size());
  for (const auto& h : hashes) keys.push_back({ns, FromWire(h)});
  std::vector<int> where = chain_->Locate(keys);
  wire::LookupReply r;
  r.tiers.resize(hashes.size());
  {
    MutexLock l(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      r.tiers[i] = pinned_.count(keys[i]) ? 1 : WireTier(where[i]);
    }
  }
  while (r.prefix_blocks < r.tiers.size() && r.tiers[r.prefix_blocks] != 0) ++r.prefix_blocks;
  MutexLock l(mu_);
  NamespaceCounters& c = counters_[ns];
  ++c.lookups;
  c.lookup_blocks += hashes.size();
  c.lookup_hits += r.prefix_blocks;
  return r;
}

std::vector<wire::ItemStatus> TieredStore::Put(uint32_t ns, std::span<const wire::PutItem> items) {
  // Shared: set_value may still be returning on a tier's thread when get() has returned here.
  auto answered = std::make_shared<std::promise<std::vector<wire::ItemStatus>>>();
  std::future<std::vector<wire::ItemStatus>> out = answered->get_future();
  StartPut(ns, items, [answered](std::vector<wire::ItemStatus> st) { answered->set_value(std::move(st)); });
  return out.get();
}

// The local tiers (host, SSD, RocksDB) answer Contains from their in-memory indexes under a
// lock; the remote tier asks the Redis cluster.
bool TieredStore::LooksUpWithoutBlocking() const {
  for (size_t i = 0; i < chain_->tier_count(); ++i) {
    if (chain_->tier(i).remote()) return false;
  }
  return true;
}

bool TieredStore::PutsWithoutBlocking() const { return dynamic_cast<HostTier*>(&chain_->tier(0)) != nullptr; }

bool TieredStore::TryPutWithoutBlocking(uint32_t ns, std::span<const wire::PutItem> items, PutDone done) {
  if (!PutsWithoutBlocking()) return false;
  StartPut(ns, items, std::move(done));
  return true;
}

void TieredStore::StartPut(uint32_t ns, std::span<const wire::PutItem> items, PutDone done) {
  ExpireHints();  // before the put evicts
  auto p = std::make_shared<PendingPut>();
  p->out.resize(items.size());
  // With a host tier first, each value is written straight into its memory as a record (one
  // copy-and-hash pass from the request buffer, or from the client's shared-memory staging)
  // and handed to the chain pinned there; the chain's put then only refreshes it. A batch pins
  // at most a quarter of what hints do not protect: a connection's PUTs are stored one after
  // another, and the pins of the one answered a moment ago are let go by the tier chain's
  // threads just after its answer, so two batches' pins may be held at once, and together they
  // must never leave the hinted bundles the only ones to evict. The rest, and anything the tier
  // refuses, goes as a bundle of its own.
  auto* host = dynamic_cast<HostTier*>(&chain_->tier(0));
  const uint64_t in_place_limit =
      host != nullptr ? (host->capacity_bytes() - std::min(host->capacity_bytes(), host->Stats().protected_bytes)) / 4
                      : 0;
  uint64_t in_place = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const std::span<const std::byte> segments[1] = {items[i].bundle};
    const BundleKey key{ns, FromWire(items[i].hash)};
    // Each PUT is a new version: copies of older ones are never served again (tier_chain.h).
    const uint64_t sequence = chain_->NextSequence();
    const uint64_t record = BundleHeaderBytes(1) + items[i].bundle.size();
    BundlePtr bundle;
    if (host != nullptr && in_place + record <= in_place_limit) {
      Result<BundlePtr> pinned = host->PutGathered(key, segments, sequence);
      if (pinned.ok()) {
        in_place += record;
        bundle = std::move(pinned).value();
      }
    }
    if (!bundle) {
      auto b = Bundle::Make(key, segments, sequence);
      if (!b.ok()) {
        p->out[i] = ToItem(b.status());
        continue;
      }
      bundle = std::move(b).value();
    }
    p->bundles.push_back(std::move(bundle));
    p->index.push_back(i);
    p->hashes.push_back(items[i].hash);
    p->sizes.push_back(items[i].bundle.size());
  }
  FinishPut(ns, std::move(p), std::move(done));
}

void TieredStore::FinishPut(uint32_t ns, std::shared_ptr<PendingPut> p, PutDone done) {
  if (p->bundles.empty()) {
    CountPuts(ns, 0, p->out.size(), 0);
    done(std::move(p->out));
    return;
  }
  std::vector<BundlePtr> bundles = p->bundles;
  chain_->DemoteAsync(std::move(bundles), [this, ns, p, done = std::move(done)](std::vector<Status> st) {
    wire::EventRecord stored{1, WireTier(0), {}};
    uint64_t ok = 0, bytes = 0;
    for (size_t k = 0; k < st.size(); ++k) {
      p->out[p->index[k]] = ToItem(st[k]);
      if (st[k].ok()) {
        ++ok;
        bytes += p->sizes[k];
        stored.hashes.push_back(p->hashes[k]);
      }
    }
    {
      MutexLock l(mu_);
      if (pinning_ > 0) {
        for (const BundlePtr& b : p->bundles) changed_while_pinning_.insert(b->key());
      }
      // A pinned key holds its newest version: GETs answer from the pin first.
      for (size_t k = 0; k < st.size() && !pinned_.empty(); ++k) {
        auto it = pinned_.find(p->bundles[k]->key());
        if (it == pinned_.end()) continue;
        pinned_bytes_ -= it->second.bundle->record_bytes();
        if (st[k].ok()) {
          it->second.bundle = p->bundles[k];
          pinned_bytes_ += p->bundles[k]->record_bytes();
        } else {
          pinned_.erase(it);  // the new version may or may not have landed: the pin is no longer sure
        }
      }
    }
    CountPuts(ns, ok, p->out.size() - ok, bytes);
    if (!stored.hashes.empty()) Emit(ns, stored);
    p->bundles.clear();  // this put's pins go before its answer lets the next one in
    done(std::move(p->out));
  });
}

namespace {

// A write lease's room in the host tier, given back unless committed.
class HostReservation final : public DaemonStore::PutReservation {
 public:
  HostReservation(HostTier* host, const HostTier::Reservation& r, BundleKey key, wire::WireHash hash)
      : host_(host), r_(r), key_(key), hash_(hash) {}
  ~HostReservation() override {
    if (host_ != nullptr) host_->AbortReserved(r_);
  }
  uint64_t value_offset() const override {
    return static_cast<uint64_t>(r_.record - host_->arena().base) + r_.header_bytes;
  }
  uint64_t value_bytes() const override { return r_.record_bytes - r_.header_bytes; }
  // The commit: the reservation ends here either way.
  Result<BundlePtr> Commit(uint64_t checksum, uint64_t resequence = 0) {
    HostTier* host = std::exchange(host_, nullptr);
    return host->CommitReserved(r_, checksum, resequence);
  }
  const wire::WireHash& hash() const { return hash_; }

 private:
  HostTier* host_;
  HostTier::Reservation r_;
  BundleKey key_;
  wire::WireHash hash_;
};

}  // namespace

Result<std::unique_ptr<DaemonStore::PutReservation>> TieredStore::ReservePut(uint32_t ns, const wire::WireHash& hash,
                                                                             uint64_t bytes, bool shared) {
  auto* host = dynamic_cast<HostTier*>(&chain_->tier(0));
  if (host == nullptr || (shared && host->arena().fd < 0)) {
    return Status::NotSupported("no shared host arena to lease from");
  }
  ExpireHints();  // before the reservation evicts
  const BundleKey key{ns, FromWire(hash)};
  SPARSEKV_ASSIGN_OR_RETURN(HostTier::Reservation r, host->Reserve(key, bytes, chain_->NextSequence()));
  return std::unique_ptr<PutReservation>(new HostReservation(host, r, key, hash));
}

void TieredStore::CommitPuts(uint32_t ns, std::vector<std::unique_ptr<PutReservation>> reserved,
                             std::vector<uint64_t> checksums, PutDone done) {
  Commit(ns, std::move(reserved), std::move(checksums), /*resequence=*/false, std::move(done));
}

void TieredStore::CommitWritten(uint32_t ns, std::unique_ptr<PutReservation> room, PutDone done) {
  std::vector<std::unique_ptr<PutReservation>> rooms;
  rooms.push_back(std::move(room));
  Commit(ns, std::move(rooms), {0}, /*resequence=*/true, std::move(done));
}

void TieredStore::Commit(uint32_t ns, std::vector<std::unique_ptr<PutReservation>> reserved,
                         std::vector<uint64_t> checksums, bool resequence, PutDone done) {
  auto p = std::make_shared<PendingPut>();
  p->out.resize(reserved.size());
  for (size_t i = 0; i < reserved.size(); ++i) {
    auto* r = dynamic_cast<HostReservation*>(reserved[i].get());
    if (r == nullptr || i >= checksums.size()) {
      p->out[i] = {StatusCode::kInvalidArgument, "not a reservation of this store"};
      continue;
    }
    const uint64_t bytes = r->value_bytes();
    const wire::WireHash hash = r->hash();
    Result<BundlePtr> b = r->Commit(checksums[i], resequence ? chain_->NextSequence() : 0);
    reserved[i].reset();
    if (!b.ok()) {
      // Superseded: a PUT acknowledged since the reservation holds a newer version, which a
      // GET returns; this one is ordered before it (tier_chain.h's rule), as acknowledged.
      if (b.status().code() != StatusCode::kFailedPrecondition) p->out[i] = ToItem(b.status());
      continue;
    }
    p->bundles.push_back(std::move(b).value());
    p->index.push_back(i);
    p->hashes.push_back(hash);
    p->sizes.push_back(bytes);
  }
  FinishPut(ns, std::move(p), std::move(done));
}

void TieredStore::CountPuts(uint32_t ns, uint64_t ok, uint64_t failed, uint64_t bytes) {
  MutexLock l(mu_);
  NamespaceCounters& c = counters_[ns];
  c.puts += ok;
  c.put_failures += failed;
  c.put_bytes += bytes;
}

void TieredStore::Get(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink) {
  ExpireHints();  // a read can evict too (onload into the host tier)
  std::vector<BundlePtr> from_pins(hashes.size());
  std::vector<BundleKey> keys;
  std::vector<size_t> index;
  {
    MutexLock l(mu_);
    for (size_t i = 0; i < hashes.size(); ++i) {
      BundleKey key{ns, FromWire(hashes[i])};
      auto it = pinned_.find(key);
      if (it != pinned_.end()) {
        from_pins[i] = it->second.bundle;
      } else {
        keys.push_back(key);
        index.push_back(i);
      }
    }
  }
  std::vector<Result<BundlePtr>> got;
  if (!keys.empty()) got = chain_->Promote(keys).get();
  std::vector<const Result<BundlePtr>*> by_item(hashes.size(), nullptr);
  for (size_t k = 0; k < index.size(); ++k) by_item[index[k]] = &got[k];
  uint64_t hits = 0, bytes = 0, corrupt = 0;
  wire::EventRecord removed{2, 0, {}};
  for (size_t i = 0; i < hashes.size(); ++i) {
    if (from_pins[i]) {
      ++hits;
      bytes += from_pins[i]->payload().size();
      sink(i, Status::OK(), from_pins[i]->segment(0), from_pins[i]);
      continue;
    }
    const Result<BundlePtr>& r = *by_item[i];
    if (r.ok()) {
      ++hits;
      bytes += (*r)->payload().size();
      sink(i, Status::OK(), (*r)->segment(0), *r);
    } else {
      if (r.status().data_loss()) {
        ++corrupt;
        removed.hashes.push_back(hashes[i]);
      }
      sink(i, r.status(), {}, nullptr);
    }
  }
  CountGets(ns, hashes.size(), hits, bytes, corrupt);
  if (!removed.hashes.empty()) Emit(ns, removed);
}

void TieredStore::GetInPlace(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink) {
  auto* host = !wire_tiers_.empty() && wire_tiers_[0] == 1 ? dynamic_cast<HostTier*>(&chain_->tier(0)) : nullptr;
  if (host == nullptr || hashes.empty()) return Get(ns, hashes, sink);
  std::vector<BundleKey> keys;
  keys.reserve(hashes.size());
  for (const auto& h : hashes) keys.push_back({ns, FromWire(h)});
  {
    MutexLock l(mu_);
    for (const BundleKey& k : keys) {
      if (pinned_.count(k)) return Get(ns, hashes, sink);  // rare: the general path knows pins
    }
  }
  // Contains first, so that a miss is not counted twice (here and on the general path).
  std::vector<bool> present;
  host->ContainsAsync(keys, [&](std::vector<bool> r) { present = std::move(r); });
  if (present.size() != keys.size()) return Get(ns, hashes, sink);
  std::vector<Result<BundlePtr>> got(keys.size(), Status::NotFound(""));
  std::vector<wire::WireHash> rest;
  std::vector<size_t> rest_index;
  std::vector<bool> is_rest(keys.size(), false);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (present[i]) {
      got[i] = host->GetPinned(keys[i], /*check=*/true);
      // A corrupt bundle was dropped just now: reported below, as the general path would only
      // find it missing. Evicted meanwhile, or an older copy onloaded while a newer version
      // was written (the chain knows): the general path answers.
      if (got[i].ok() ? !chain_->IsStale(keys[i], (*got[i])->sequence()) : got[i].status().data_loss()) continue;
      got[i] = Status::NotFound("");  // its pin goes now
    }
    rest.push_back(hashes[i]);
    rest_index.push_back(i);
    is_rest[i] = true;
  }
  // The rest's answers, kept (each OK one's keep holds its bytes) so that `sink` hears every
  // item in order, as from Get: a SHM_GET reply lists its slots in item order.
  struct Answer {
    Status status;
    std::span<const std::byte> bytes;
    Keep keep;
  };
  std::vector<std::optional<Answer>> answered(keys.size());
  if (!rest.empty()) {
    Get(ns, rest, [&](size_t k, const Status& st, std::span<const std::byte> bytes, const Keep& keep) {
      answered[rest_index[k]] = Answer{st, st.ok() && keep ? bytes : std::span<const std::byte>{}, keep};
      if (st.ok() && !keep) answered[rest_index[k]]->status = Status::Internal("a GET answer without its keep");
    });
  }
  uint64_t bytes = 0, hits = 0;
  wire::EventRecord removed{2, 0, {}};
  for (size_t i = 0; i < keys.size(); ++i) {
    if (answered[i]) {
      sink(i, answered[i]->status, answered[i]->bytes, answered[i]->keep);
      continue;
    }
    if (is_rest[i]) {  // Get answers every item; this is only a guard
      sink(i, Status::Internal("the general path did not answer"), {}, nullptr);
      continue;
    }
    SinkHostItem(i, hashes[i], got[i], sink, hits, bytes, removed);
  }
  CountGets(ns, hashes.size() - rest.size(), hits, bytes, removed.hashes.size());
  if (!removed.hashes.empty()) Emit(ns, removed);
}

void TieredStore::CountGets(uint32_t ns, uint64_t asked, uint64_t hits, uint64_t bytes, uint64_t corrupt) {
  MutexLock l(mu_);
  NamespaceCounters& c = counters_[ns];
  c.gets += asked;
  c.get_hits += hits;
  c.get_bytes += bytes;
  c.corrupt += corrupt;
}

Status TieredStore::Recheck(uint32_t ns, const wire::WireHash& hash, const Keep& keep) {
  auto* host = wire_tiers_.empty() ? nullptr : dynamic_cast<HostTier*>(&chain_->tier(0));
  if (host == nullptr || !keep) return Status::OK();  // nothing was handed out unchecked
  Status st = host->CheckPinned(std::static_pointer_cast<const Bundle>(keep), BundleKey{ns, FromWire(hash)});
  if (!st.ok()) {
    CountGets(ns, 0, 0, 0, 1);
    Emit(ns, wire::EventRecord{2, 0, {hash}});
  }
  return st;
}

void TieredStore::GetRanges(uint32_t ns, std::span<const wire::RangeItem> items, const RangesSink& sink) {
  const size_t n = items.size();
  struct Item {
    bool done = false;
    Status st;
    std::vector<std::byte> bytes;
  };
  std::vector<Item> out(n);
  std::vector<BundleKey> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = {ns, FromWire(items[i].hash)};
  // Pinned blocks, then the host tier, in place (not checked whole: see DaemonStore). A pinned
  // bundle is shared out under the lock and copied from after it.
  std::vector<BundlePtr> pinned(n);
  {
    MutexLock l(mu_);
    for (size_t i = 0; i < n; ++i) {
      auto it = pinned_.find(keys[i]);
      if (it != pinned_.end()) pinned[i] = it->second.bundle;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!pinned[i]) continue;
    out[i].st = GatherRanges(pinned[i]->segment(0), items[i].ranges, out[i].bytes);
    out[i].done = true;
  }
  HostTier* host = nullptr;
  SsdTier* ssd = nullptr;
  for (size_t t = 0; t < chain_->tier_count(); ++t) {
    if (host == nullptr && t == 0) host = dynamic_cast<HostTier*>(&chain_->tier(t));
    if (ssd == nullptr) ssd = dynamic_cast<SsdTier*>(&chain_->tier(t));
  }
  if (host != nullptr) {
    for (size_t i = 0; i < n; ++i) {
      if (out[i].done) continue;
      Result<BundlePtr> b = host->GetPinned(keys[i], /*check=*/false);
      if (!b.ok() || chain_->IsStale(keys[i], (*b)->sequence())) continue;
      out[i].st = GatherRanges((*b)->segment(0), items[i].ranges, out[i].bytes);
      out[i].done = true;
    }
  }
  // The SSD tier: the sectors each item's ranges lie in, read in batches of at most
  // kMaxRangeSectors; an item needing more goes to the general path below.
  if (ssd != nullptr) {
    struct Want {
      size_t item;
      std::vector<uint64_t> sectors;  // record offsets, sorted, distinct: every one the ranges touch
    };
    std::vector<Want> wants;
    for (size_t i = 0; i < n; ++i) {
      if (out[i].done) continue;
      // Its distinct sectors, up to kMaxRangeSectors; an item needing more (or naming a range
      // past any value, which the general path answers) is left to the general path.
      std::set<uint64_t> sectors;
      bool general = false;
      for (const wire::ByteRange& r : items[i].ranges) {
        if (r.offset + r.bytes > kBeyondAnyValue) {
          general = true;
          break;
        }
        const uint64_t first = (kValueInRecord + r.offset) / kSector;
        const uint64_t last = (kValueInRecord + r.offset + r.bytes - 1) / kSector;
        for (uint64_t s = first; s <= last && !general; ++s) {
          sectors.insert(s * kSector);
          general = sectors.size() > kMaxRangeSectors;
        }
        if (general) break;
      }
      if (!general) wants.push_back({i, std::vector<uint64_t>(sectors.begin(), sectors.end())});
    }
    auto* staging = static_cast<std::byte*>(std::aligned_alloc(kSector, kMaxRangeSectors * kSector));
    size_t next = 0;
    while (staging != nullptr && next < wants.size()) {
      // One batch: as many whole items as fit the staging area.
      size_t end = next;
      uint64_t sectors = 0;
      while (end < wants.size() && sectors + wants[end].sectors.size() <= kMaxRangeSectors) {
        sectors += wants[end++].sectors.size();
      }
      std::vector<SsdTier::SectorRead> reads;
      reads.reserve(sectors);
      for (size_t w = next; w < end; ++w) {
        for (uint64_t s : wants[w].sectors) {
          reads.push_back({keys[wants[w].item], s, staging + reads.size() * kSector});
        }
      }
      std::vector<SsdTier::SectorRecord> records;
      const std::vector<Status> got = ssd->ReadSectors(reads, &records);
      size_t at = 0;
      for (size_t w = next; w < end; ++w) {
        const Want& want = wants[w];
        Item& it = out[want.item];
        const size_t first = at;
        at += want.sectors.size();
        // Every sector from one record, found and read (a PUT may replace it between reads;
        // then the general path answers).
        bool found = true, same = true;
        Status bad;
        for (size_t k = first; k < at; ++k) {
          if (got[k].code() == StatusCode::kNotFound) {
            found = false;
          } else if (!got[k].ok() && got[k].code() != StatusCode::kInvalidArgument && bad.ok()) {
            bad = got[k];  // a sector past the record is refused by CheckRanges, by name
          }
          if (records[k].sequence != records[first].sequence || records[k].record_bytes != records[first].record_bytes) {
            same = false;
          }
        }
        if (!found || !same || chain_->IsStale(keys[want.item], records[first].sequence)) continue;
        it.done = true;
        const uint64_t record_bytes = records[first].record_bytes;
        if (record_bytes < kValueInRecord) {
          it.st = Status::Corruption(fmt::format("a record of {} bytes in the SSD tier", record_bytes));
          continue;
        }
        it.st = CheckRanges(items[want.item].ranges, record_bytes - kValueInRecord);
        if (it.st.ok() && !bad.ok()) it.st = bad;
        if (!it.st.ok()) continue;
        it.bytes.resize(RangesBytes(items[want.item].ranges));
        std::byte* p = it.bytes.data();
        for (const wire::ByteRange& r : items[want.item].ranges) {
          // Copy sector by sector: the range's sectors are in `want.sectors`, staged in order.
          uint64_t pos = kValueInRecord + r.offset;
          uint64_t left = r.bytes;
          while (left > 0) {
            const uint64_t sector = pos / kSector * kSector;
            const auto at_sector = std::lower_bound(want.sectors.begin(), want.sectors.end(), sector);
            if (at_sector == want.sectors.end() || *at_sector != sector) {  // cannot happen: all were listed
              it.st = Status::Internal(fmt::format("GET_RANGES: sector {} was not read", sector));
              break;
            }
            const size_t k = first + static_cast<size_t>(at_sector - want.sectors.begin());
            const uint64_t take = std::min(left, sector + kSector - pos);
            std::memcpy(p, staging + k * kSector + (pos - sector), take);
            p += take;
            pos += take;
            left -= take;
          }
          if (!it.st.ok()) break;
        }
      }
      next = end;
    }
    std::free(staging);
  }
  // What is left (another tier, an SSD record replaced meanwhile, an item of many sectors):
  // the record comes up whole, as for a GET.
  std::vector<wire::RangeItem> rest;
  std::vector<size_t> rest_index;
  for (size_t i = 0; i < n; ++i) {
    if (out[i].done) continue;
    rest.push_back(items[i]);
    rest_index.push_back(i);
  }
  uint64_t asked = 0, hits = 0, bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!out[i].done) continue;
    ++asked;
    if (out[i].st.ok()) {
      ++hits;
      bytes += out[i].bytes.size();
    }
  }
  if (!rest.empty()) {
    DaemonStore::GetRanges(ns, rest, [&](size_t k, const Status& st, std::span<const std::byte> b) {
      Item& it = out[rest_index[k]];
      it.st = st;
      it.bytes.assign(b.begin(), b.end());
    });
  }
  CountGets(ns, asked, hits, bytes, 0);  // the general path counts its own items
  for (size_t i = 0; i < n; ++i) sink(i, out[i].st, out[i].st.ok() ? std::span<const std::byte>(out[i].bytes)
                                                                     : std::span<const std::byte>{});
}

DaemonStore::Arena TieredStore::SharedArena() const {
  if (wire_tiers_.empty() || wire_tiers_[0] != 1) return {};
  const auto* host = dynamic_cast<const HostTier*>(&chain_->tier(0));
  if (host == nullptr) return {};
  const HostTier::Arena a = host->arena();
  return {a.fd, a.base, a.bytes};
}

DaemonStore::Arena TieredStore::LendTable() const {
  if (wire_tiers_.empty() || wire_tiers_[0] != 1) return {};
  const auto* host = dynamic_cast<const HostTier*>(&chain_->tier(0));
  if (host == nullptr) return {};
  const HostTier::Arena a = host->lend_table();
  return {a.fd, a.base, a.bytes};
}

wire::LendInfo TieredStore::Lend(uint32_t ns, const wire::WireHash& hash, const Keep& keep) {
  if (wire_tiers_.empty() || wire_tiers_[0] != 1 || !keep) return {};
  auto* host = dynamic_cast<HostTier*>(&chain_->tier(0));
  if (host == nullptr) return {};
  const BundleKey key{ns, FromWire(hash)};
  {
    MutexLock l(mu_);
    if (pinned_.count(key)) return {};  // pins are answered from their own copy
  }
  // `keep` is what TryGetWithoutBlocking handed out: the host tier's bundle, in its arena.
  auto b = std::static_pointer_cast<const Bundle>(keep);
  const HostTier::Arena a = host->arena();
  const std::byte* rec = b->record().data();
  if (rec < a.base || rec >= a.base + a.bytes) return {};
  // A local read copies the one segment lent; a record of several is not read that way.
  if (b->payload().size() != b->segment(0).size()) return {};
  wire::LendInfo info;
  info.token = host->LendToken(key, b);
  info.record_offset = static_cast<uint64_t>(rec - a.base);
  info.checksum = b->checksum();
  return info;
}

uint64_t TieredStore::TouchRead(uint32_t ns, std::span<const wire::WireHash> hashes) {
  if (wire_tiers_.empty() || wire_tiers_[0] != 1 || hashes.empty()) return 0;
  auto* host = dynamic_cast<HostTier*>(&chain_->tier(0));
  if (host == nullptr) return 0;
  std::vector<BundleKey> keys;
  keys.reserve(hashes.size());
  for (const auto& h : hashes) keys.push_back({ns, FromWire(h)});
  const HostTier::Touched t = host->TouchRead(keys);
  CountGets(ns, t.items, t.items, t.bytes, 0);
  return t.items;
}

bool TieredStore::TryGetWithoutBlocking(uint32_t ns, std::span<const wire::WireHash> hashes, const GetSink& sink,
                                        bool check) {
  // Only the host tier answers on the caller's thread; anything else goes to a worker.
  if (wire_tiers_.empty() || wire_tiers_[0] != 1 || hashes.empty()) return false;
  std::vector<BundleKey> keys;
  keys.reserve(hashes.size());
  for (const auto& h : hashes) keys.push_back({ns, FromWire(h)});
  {
    MutexLock l(mu_);
    for (const BundleKey& k : keys) {
      if (pinned_.count(k)) return false;  // rare: the general path knows pins
    }
  }
  Tier& host = chain_->tier(0);
  // Contains first, so a miss is not counted twice (here and again on the general path).
  std::vector<bool> present;
  host.ContainsAsync(keys, [&](std::vector<bool> r) { present = std::move(r); });
  if (present.size() != keys.size()) return false;
  for (bool p : present) {
    if (!p) return false;
  }
  // The host tier's pages are read in place, pinned while the reply holds them.
  auto* pinnable = dynamic_cast<HostTier*>(&host);
  std::vector<Result<BundlePtr>> got;
  if (pinnable != nullptr) {
    got.reserve(keys.size());
    for (const BundleKey& k : keys) got.push_back(pinnable->GetPinned(k, check));
  } else {
    host.GetAsync(keys, [&](std::vector<Result<BundlePtr>> r) { got = std::move(r); });
  }
  if (got.size() != keys.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& r = got[i];
    // Evicted meanwhile: the general path answers. A corrupt bundle was dropped just now; it
    // is reported here, as the general path would only find it missing.
    if (!r.ok() && !r.status().data_loss()) return false;
    // An older copy onloaded while a newer version was written: the chain knows, and skips it.
    if (r.ok() && chain_->IsStale(keys[i], (*r)->sequence())) return false;
  }
  uint64_t bytes = 0, hits = 0;
  wire::EventRecord removed{2, 0, {}};
  for (size_t i = 0; i < got.size(); ++i) {
    SinkHostItem(i, hashes[i], got[i], sink, hits, bytes, removed);
  }
  CountGets(ns, hashes.size(), hits, bytes, removed.hashes.size());
  if (!removed.hashes.empty()) Emit(ns, removed);
  return true;
}

std::vector<Result<BundlePtr>> TieredStore::FetchForPin(const std::vector<BundleKey>& keys) {
  // A PUT or DELETE of a key between its read here and its pinning would leave the pin holding
  // the version before it (the PUT found no pin to update): such keys are read again, and Pin
  // checks once more, under the lock it pins under, before it pins them.
  {
    MutexLock l(mu_);
    ++pinning_;
  }
  std::vector<Result<BundlePtr>> got = chain_->Promote(keys).get();
  for (int attempt = 0;; ++attempt) {
    std::vector<size_t> again;
    {
      MutexLock l(mu_);
      for (size_t k = 0; k < keys.size(); ++k) {
        if (changed_while_pinning_.erase(keys[k])) again.push_back(k);
      }
      if (again.empty() || attempt == 3) {
        for (size_t k : again) {
          got[k] = Status::Aborted("block changed while it was being pinned; pin it again");
        }
        return got;  // still counted in pinning_: Pin checks once more as it pins
      }
    }
    std::vector<BundleKey> retry;
    for (size_t k : again) retry.push_back(keys[k]);
    std::vector<Result<BundlePtr>> re = chain_->Promote(retry).get();
    for (size_t j = 0; j < again.size(); ++j) got[again[j]] = std::move(re[j]);
  }
}

std::vector<wire::ItemStatus> TieredStore::Pin(uint32_t ns, std::span<const wire::WireHash> hashes, uint8_t priority) {
  std::vector<BundleKey> keys;
  for (const auto& h : hashes) keys.push_back({ns, FromWire(h)});
  std::vector<wire::ItemStatus> out(hashes.size());
  // Blocks already pinned only change priority; the others are fetched from the chain.
  std::vector<BundleKey> fetch;
  std::vector<size_t> index;
  {
    MutexLock l(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = pinned_.find(keys[i]);
      if (it != pinned_.end()) {
        it->second.priority = std::max(it->second.priority, priority);
      } else {
        fetch.push_back(keys[i]);
        index.push_back(i);
      }
    }
  }
  std::vector<Result<BundlePtr>> got;
  if (!fetch.empty()) got = FetchForPin(fetch);
  std::vector<BundlePtr> displaced;
  {
    MutexLock l(mu_);
    for (size_t k = 0; k < fetch.size(); ++k) {
      if (got[k].ok() && changed_while_pinning_.erase(fetch[k])) {
        got[k] = Status::Aborted("block changed while it was being pinned; pin it again");
      }
      if (!got[k].ok()) {
        out[index[k]] = ToItem(got[k].status());
        continue;
      }
      const BundlePtr& b = *got[k];
      const uint64_t need = b->record_bytes();
      if (pinned_.count(fetch[k])) continue;  // pinned meanwhile by another request
      // Make room by displacing lower-priority pins, lowest first.
      while (pinned_bytes_ + need > options_.pin_budget_bytes) {
        auto victim = pinned_.end();
        for (auto it = pinned_.begin(); it != pinned_.end(); ++it) {
          if (it->second.priority < priority && (victim == pinned_.end() || it->second.priority < victim->second.priority)) {
            victim = it;
          }
        }
        if (victim == pinned_.end()) break;
        pinned_bytes_ -= victim->second.bundle->record_bytes();
        displaced.push_back(victim->second.bundle);
        pinned_.erase(victim);
      }
      if (pinned_bytes_ + need > options_.pin_budget_bytes) {
        out[index[k]] = {StatusCode::kResourceExhausted,
                         fmt::format("pin budget of {} bytes is held by pins of priority {} or more",
                                     options_.pin_budget_bytes, priority)};
        continue;
      }
      pinned_.emplace(fetch[k], Pinned{b, priority});
      pinned_bytes_ += need;
    }
    if (!fetch.empty() && --pinning_ == 0) changed_while_pinning_.clear();
    NamespaceCounters& c = counters_[ns];
    ++c.pins;
  }
  // Displaced pins go back to the chain, where the LRU decides their fate.
  if (!displaced.empty()) chain_->DemoteAsync(std::move(displaced), [](std::vector<Status>) {});
  return out;
}

std::vector<wire::ItemStatus> TieredStore::Unpin(uint32_t ns, std::span<const wire::WireHash> hashes) {
  std::vector<wire::ItemStatus> out(hashes.size());
  std::vector<BundlePtr> back;
  {
    MutexLock l(mu_);
    for (size_t i = 0; i < hashes.size(); ++i) {
      auto it = pinned_.find({ns, FromWire(hashes[i])});
      if (it == pinned_.end()) {
        out[i] = {StatusCode::kNotFound, "block is not pinned"};
        continue;
      }
      pinned_bytes_ -= it->second.bundle->record_bytes();
      back.push_back(it->second.bundle);
      pinned_.erase(it);
    }
  }
  if (!back.empty()) chain_->Demote(std::move(back)).get();
  return out;
}

std::vector<wire::ItemStatus> TieredStore::Delete(uint32_t ns, std::span<const wire::WireHash> hashes) {
  std::vector<BundleKey> keys;
  for (const auto& h : hashes) keys.push_back({ns, FromWire(h)});
  {
    MutexLock l(mu_);
    for (const BundleKey& k : keys) {
      auto it = pinned_.find(k);
      if (it != pinned_.end()) {
        pinned_bytes_ -= it->second.bundle->record_bytes();
        pinned_.erase(it);
      }
      if (pinning_ > 0) changed_while_pinning_.insert(k);
    }
    counters_[ns].deletes += keys.size();
  }
  std::vector<Status> st = chain_->Erase(keys).get();
  std::vector<wire::ItemStatus> out;
  wire::EventRecord removed{2, 0, {}};
  for (size_t i = 0; i < st.size(); ++i) {
    out.push_back(ToItem(st[i]));
    if (st[i].ok()) removed.hashes.push_back(hashes[i]);
  }
  if (!removed.hashes.empty()) Emit(ns, removed);
  return out;
}

std::string TieredStore::StatsJson(uint32_t ns) {
  ExpireHints();
  nlohmann::json j;
  {
    MutexLock l(hint_mu_);
    uint64_t live = 0, blocks = 0;
    for (const auto& [id, h] : hints_) {
      if (h.ns != ns) continue;
      ++live;
      blocks += h.keys.size();
    }
    const HintCounters& c = hint_counters_[ns];
    j["hints"] = {{"live", live},
                  {"hinted_blocks", blocks},
                  {"given", c.given},
                  {"given_blocks", c.blocks},
                  {"expired", c.expired},
                  {"dropped", c.dropped},
                  {"ended_with_session", c.ended_with_session},
                  {"refused", c.refused}};
  }
  {
    MutexLock l(mu_);
    const NamespaceCounters& c = counters_[ns];
    uint64_t pinned_blocks = 0, pinned_bytes = 0;
    for (const auto& [k, p] : pinned_) {
      if (k.namespace_id == ns) {
        ++pinned_blocks;
        pinned_bytes += p.bundle->record_bytes();
      }
    }
    j["lookups"] = c.lookups;
    j["lookup_blocks"] = c.lookup_blocks;
    j["lookup_hit_blocks"] = c.lookup_hits;
    j["puts"] = c.puts;
    j["put_failures"] = c.put_failures;
    j["put_bytes"] = c.put_bytes;
    j["gets"] = c.gets;
    j["get_hits"] = c.get_hits;
    j["get_misses"] = c.gets - c.get_hits;
    j["get_bytes"] = c.get_bytes;
    j["hit_ratio"] = c.gets ? static_cast<double>(c.get_hits) / static_cast<double>(c.gets) : 0.0;
    j["pinned_blocks"] = pinned_blocks;
    j["pinned_bytes"] = pinned_bytes;
    j["deletes"] = c.deletes;
    j["corrupt_detected"] = c.corrupt;
  }
  // Tier names and capacities only: byte counts are shared by every namespace.
  nlohmann::json tiers = nlohmann::json::array();
  for (size_t i = 0; i < chain_->tier_count(); ++i) {
    tiers.push_back({{"name", chain_->tier(i).name()}, {"capacity_bytes", chain_->tier(i).capacity_bytes()}});
  }
  j["tiers"] = std::move(tiers);
  return j.dump();
}

Result<wire::HintReply> TieredStore::Hint(uint64_t session, uint32_t ns, std::span<const wire::WireHash> hashes,
                                          uint32_t ttl_ms) {
  ExpireHints();
  if (ttl_ms == 0 || ttl_ms > options_.max_hint_ttl_ms) {
    return Status::InvalidArgument(fmt::format("HINT time to live {} ms: must be from 1 to {} ms (max_hint_ttl_ms)",
                                               ttl_ms, options_.max_hint_ttl_ms));
  }
  std::vector<BundleKey> keys;
  keys.reserve(hashes.size());
  for (const auto& h : hashes) keys.push_back({ns, FromWire(h)});
  wire::HintReply reply;
  {
    MutexLock l(hint_mu_);
    uint64_t& held = session_hinted_[session];
    if (held + keys.size() > options_.max_hinted_blocks_per_session) {
      ++hint_counters_[ns].refused;
      const uint64_t now_held = held;
      if (held == 0) session_hinted_.erase(session);
      return Status::ResourceExhausted(fmt::format(
          "HINT of {} blocks: the session hints {} already, and may hint at most {} at once "
          "(max_hinted_blocks_per_session); drop a hint or let one expire",
          keys.size(), now_held, options_.max_hinted_blocks_per_session));
    }
    held += keys.size();
    hinted_blocks_ += keys.size();
    const uint64_t id = next_hint_++;
    const Clock::time_point expiry = Clock::now() + std::chrono::milliseconds(ttl_ms);
    // Tiers first, then the record: a block stored from now on finds its key hinted.
    for (size_t t = 0; t < chain_->tier_count(); ++t) chain_->tier(t).Hint(keys, true);
    hints_.emplace(id, HintRecord{session, ns, keys, expiry});
    hint_expiry_.emplace(expiry, id);
    const int64_t at = std::chrono::duration_cast<std::chrono::nanoseconds>(hint_expiry_.top().first.time_since_epoch()).count();
    next_hint_expiry_ns_.store(at, std::memory_order_relaxed);
    HintCounters& c = hint_counters_[ns];
    ++c.given;
    c.blocks += keys.size();
    reply.hint = id;
  }
  // What the tiers hold now; blocks held only below the first tier come up into it (where the
  // hint protects them as they land).
  const std::vector<int> where = chain_->Locate(keys);
  std::vector<BundleKey> below;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (where[i] < 0) continue;
    ++reply.found;
    if (where[i] == 0) {
      ++reply.in_memory;
    } else {
      below.push_back(keys[i]);
    }
  }
  reply.prefetching = static_cast<uint32_t>(below.size());
  if (!below.empty()) chain_->Prefetch(std::move(below));
  return reply;
}

void TieredStore::EndHintLocked(uint64_t id, uint64_t* how) {
  auto it = hints_.find(id);
  if (it == hints_.end()) return;
  HintRecord& h = it->second;
  for (size_t t = 0; t < chain_->tier_count(); ++t) chain_->tier(t).Hint(h.keys, false);
  auto s = session_hinted_.find(h.session);
  if (s != session_hinted_.end()) {
    s->second -= h.keys.size();
    if (s->second == 0) session_hinted_.erase(s);
  }
  hinted_blocks_ -= h.keys.size();
  ++*how;
  hints_.erase(it);
}

void TieredStore::ExpireHints() {
  const Clock::time_point now = Clock::now();
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
  if (now_ns < next_hint_expiry_ns_.load(std::memory_order_relaxed)) return;
  MutexLock l(hint_mu_);
  while (!hint_expiry_.empty() && hint_expiry_.top().first <= now) {
    const uint64_t id = hint_expiry_.top().second;
    hint_expiry_.pop();
    auto it = hints_.find(id);
    if (it != hints_.end()) EndHintLocked(id, &hint_counters_[it->second.ns].expired);
  }
  // Entries of hints ended early are dropped as they come to the top.
  int64_t next = INT64_MAX;
  if (!hint_expiry_.empty()) {
    next = std::chrono::duration_cast<std::chrono::nanoseconds>(hint_expiry_.top().first.time_since_epoch()).count();
  }
  next_hint_expiry_ns_.store(next, std::memory_order_relaxed);
}

Status TieredStore::DropHint(uint64_t session, uint64_t hint) {
  ExpireHints();
  MutexLock l(hint_mu_);
  auto it = hints_.find(hint);
  if (it == hints_.end() || it->second.session != session) {
    return Status::NotFound(fmt::format("no live hint {} in this session (never given, dropped or expired)", hint));
  }
  EndHintLocked(hint, &hint_counters_[it->second.ns].dropped);
  return Status::OK();
}

void TieredStore::EndSession(uint64_t session) {
  MutexLock l(hint_mu_);
  if (session_hinted_.count(session) == 0) return;
  std::vector<std::pair<uint64_t, uint32_t>> mine;
  for (const auto& [id, h] : hints_) {
    if (h.session == session) mine.emplace_back(id, h.ns);
  }
  for (const auto& [id, ns] : mine) EndHintLocked(id, &hint_counters_[ns].ended_with_session);
}

std::vector<wire::WireHash> TieredStore::ListHashes(uint32_t ns) {
  std::vector<BlockHash> hashes;
  {
    MutexLock l(mu_);
    for (const auto& [k, p] : pinned_) {
      if (k.namespace_id == ns) hashes.push_back(k.hash);
    }
  }
  for (size_t t = 0; t < chain_->tier_count(); ++t) {
    std::optional<std::vector<BundleKey>> keys = chain_->tier(t).ListKeys();
    if (!keys) continue;
    for (const BundleKey& k : *keys) {
      if (k.namespace_id == ns) hashes.push_back(k.hash);
    }
  }
  std::sort(hashes.begin(), hashes.end(),
            [](const BlockHash& a, const BlockHash& b) { return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo; });
  hashes.erase(std::unique(hashes.begin(), hashes.end()), hashes.end());
  std::vector<wire::WireHash> out;
  out.reserve(hashes.size());
  for (const BlockHash& h : hashes) out.push_back(ToWire(h));
  return out;
}

uint64_t TieredStore::MaxValueBytes() const {
  uint64_t record = UINT64_MAX;
  for (size_t t = 0; t < chain_->tier_count(); ++t) {
    const Tier& tier = chain_->tier(t);
    if (tier.remote()) continue;
    record = std::min(record, tier.max_record_bytes());
    if (chain_->options().write_policy == WritePolicy::kWriteBack) break;
  }
  const uint64_t header = BundleHeaderBytes(1);
  return record > header ? record - header : 0;
}

std::vector<DaemonStore::TierInfo> TieredStore::Tiers() {
  std::vector<TierInfo> out;
  for (size_t t = 0; t < chain_->tier_count(); ++t) {
    const Tier& tier = chain_->tier(t);
    const TierStats s = tier.Stats();
    out.push_back({std::string(tier.name()), s.capacity_bytes, s.bytes, s.items, s.hits, s.misses, s.evictions,
                   s.corrupt, tier.remote()});
  }
  return out;
}

uint64_t TieredStore::Subscribe(uint32_t ns, EventSink sink) {
  MutexLock l(mu_);
  const uint64_t id = next_subscription_++;
  subscribers_.emplace(id, Subscriber{ns, std::move(sink)});
  return id;
}

void TieredStore::Unsubscribe(uint64_t subscription) {
  MutexLock l(mu_);
  subscribers_.erase(subscription);
}

void TieredStore::Emit(uint32_t ns, const wire::EventRecord& e) {
  std::vector<EventSink> sinks;
  {
    MutexLock l(mu_);
    for (const auto& [id, s] : subscribers_) {
      if (s.ns == ns) sinks.push_back(s.sink);
    }
  }
  for (const EventSink& s : sinks) s(e);
  if (observer_) observer_(ns, e);
}

std::vector<BundleKey> TieredStore::PinnedKeys() {
  MutexLock l(mu_);
  std::vector<BundleKey> out;
  out.reserve(pinned_.size());
  for (const auto& [k, p] : pinned_) out.push_back(k);
  return out;
}

void TieredStore::RenderMetrics(std::string& out) {
  auto gauge_header = [&](const char* name, const char* help, const char* type) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  std::vector<TierStats> stats;
  for (size_t i = 0; i < chain_->tier_count(); ++i) stats.push_back(chain_->tier(i).Stats());
  auto series = [&](const char* name, const char* help, const char* type, auto get) {
    gauge_header(name, help, type);
    for (const TierStats& s : stats) out += fmt::format("{}{{tier=\"{}\"}} {}\n", name, s.name, get(s));
  };
  series("sparsekv_tier_bytes", "Record bytes held by the tier.", "gauge", [](const TierStats& s) { return s.bytes; });
  series("sparsekv_tier_capacity_bytes", "Tier capacity.", "gauge", [](const TierStats& s) { return s.capacity_bytes; });
  series("sparsekv_tier_items", "Bundles held by the tier.", "gauge", [](const TierStats& s) { return s.items; });
  series("sparsekv_tier_hits_total", "Gets the tier served.", "counter", [](const TierStats& s) { return s.hits; });
  series("sparsekv_tier_misses_total", "Gets of keys the tier lacked.", "counter", [](const TierStats& s) { return s.misses; });
  series("sparsekv_tier_evictions_total", "Bundles the tier evicted for room.", "counter", [](const TierStats& s) { return s.evictions; });
  series("sparsekv_tier_corrupt_total", "Bundles that failed their checksum (erased, never served).", "counter",
         [](const TierStats& s) { return s.corrupt; });
  series("sparsekv_tier_other_version_total",
         "Reads that found another release's record (another bundle format): misses, the record left in place.",
         "counter", [](const TierStats& s) { return s.other_version; });
  series("sparsekv_tier_io_errors_total", "Operations the device failed.", "counter", [](const TierStats& s) { return s.io_errors; });
  series("sparsekv_tier_superseded_total", "Puts skipped because the tier held a newer version of the key.",
         "counter", [](const TierStats& s) { return s.superseded; });
  series("sparsekv_tier_protected_bytes", "Record bytes the tier protects for hints (evicted last).", "gauge",
         [](const TierStats& s) { return s.protected_bytes; });
  series("sparsekv_tier_protected_items", "Bundles the tier protects for hints.", "gauge",
         [](const TierStats& s) { return s.protected_items; });
  series("sparsekv_tier_hint_cut_total", "Hinted bundles left unprotected by the tier's hint bound.", "counter",
         [](const TierStats& s) { return s.hint_cut; });
  {
    MutexLock l(hint_mu_);
    gauge_header("sparsekv_hints_live", "HINTs alive now.", "gauge");
    out += fmt::format("sparsekv_hints_live {}\n", hints_.size());
    gauge_header("sparsekv_hinted_blocks", "Blocks named by the live HINTs.", "gauge");
    out += fmt::format("sparsekv_hinted_blocks {}\n", hinted_blocks_);
    uint64_t expired = 0;
    for (const auto& [ns, c] : hint_counters_) expired += c.expired;
    gauge_header("sparsekv_hints_expired_total", "HINTs that ended at their time to live.", "counter");
    out += fmt::format("sparsekv_hints_expired_total {}\n", expired);
  }
  const TierChainStats c = chain_->Stats();
  const auto chain_series = [&](const char* name, const char* help, const char* type, uint64_t value) {
    gauge_header(name, help, type);
    out += fmt::format("{} {}\n", name, value);
  };
  chain_series("sparsekv_chain_stale_skipped_total",
               "Copies a read found older than the key's newest version (skipped).", "counter", c.stale_skipped);
  chain_series("sparsekv_chain_invalidated_total",
               "Older copies erased from tiers a new version or a delete did not reach.", "counter", c.invalidated);
  chain_series("sparsekv_chain_invalidate_failures_total",
               "Erasures of older copies that failed (reads keep skipping those copies).",
               "counter", c.invalidate_failures);
  chain_series("sparsekv_chain_demote_dropped_total",
               "Demotes that failed; the block was dropped.", "counter", c.demote_dropped);
  chain_series("sparsekv_chain_cascaded_total", "Evicted bundles moved to the next tier.", "counter", c.cascaded);
  chain_series("sparsekv_chain_written_behind_total",
               "Bundles written to a remote tier behind a PUT.", "counter", c.written_behind);
  chain_series("sparsekv_chain_write_behind_failures_total",
               "Writes to a remote tier that failed (reads skip an older copy there).",
               "counter", c.write_behind_failures);
  chain_series("sparsekv_chain_stale_keys",
               "Keys a tier may hold an older copy of after a failed erase or write (skipped until repaired).",
               "gauge", c.stale_keys);
  chain_series("sparsekv_chain_repaired_total",
               "Such older copies erased once their tier answered again.", "counter", c.repaired);
  for (size_t i = 0; i < chain_->tier_count(); ++i) {
    for (const TierMetric& m : chain_->tier(i).Metrics()) {
      gauge_header(m.name.c_str(), m.help.c_str(), m.counter ? "counter" : "gauge");
      out += fmt::format("{}{{tier=\"{}\"}} {}\n", m.name, chain_->tier(i).name(), m.value);
    }
  }
  MutexLock l(mu_);
  gauge_header("sparsekv_pinned_bytes", "Bytes of pinned blocks held in memory.", "gauge");
  out += fmt::format("sparsekv_pinned_bytes {}\n", pinned_bytes_);
}

// Under write-back a bundle goes below the host tier only when the host tier evicts it, so at a
// graceful stop the host tier holds bundles no other tier has: they are copied to the tier
// below (in the host tier's eviction order, the next to go first, so that if that tier runs out
// of room it keeps what the host tier valued most), in batches of at most kSpillBatchBytes
// pinned, each batch waited for.
Status TieredStore::Flush() {
  chain_->WaitIdle();
  Status st;
  auto* host = dynamic_cast<HostTier*>(&chain_->tier(0));
  // A remote tier below has every block already (written behind each PUT).
  if (chain_->options().write_policy == WritePolicy::kWriteBack && chain_->tier_count() > 1 && host != nullptr &&
      !chain_->tier(1).remote()) {
    constexpr uint64_t kSpillBatchBytes = 64ull << 20;
    Tier& below = chain_->tier(1);
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t spilled = 0, bytes = 0, failed = 0;
    const std::vector<BundleKey> keys = host->Keys();
    size_t next = 0;
    while (next < keys.size()) {
      std::vector<BundlePtr> batch;
      uint64_t batch_bytes = 0;
      for (; next < keys.size() && batch_bytes < kSpillBatchBytes; ++next) {
        Result<BundlePtr> b = host->GetPinned(keys[next]);  // checked: a damaged one stays behind
        if (!b.ok()) continue;
        batch_bytes += (*b)->record_bytes();
        batch.push_back(std::move(*b));
      }
      if (batch.empty()) continue;
      std::promise<std::vector<Status>> done;
      auto answered = done.get_future();
      below.PutAsync(batch, [&done](std::vector<Status> s) { done.set_value(std::move(s)); });
      const std::vector<Status> results = answered.get();
      for (size_t i = 0; i < results.size(); ++i) {
        // A newer version below already stands in for this copy.
        if (results[i].ok() || results[i].Is(StatusCode::kFailedPrecondition)) {
          ++spilled;
          bytes += batch[i]->record_bytes();
        } else {
          ++failed;
          if (st.ok())
            st = results[i].WithContext(fmt::format("spilling the host tier to {}", below.name()));
        }
      }
    }
    spdlog::info("write-back: {} bundles ({} bytes) copied from the host tier to {} in {:.3f} s{}", spilled, bytes,
                 below.name(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 failed ? fmt::format(", {} failed", failed) : std::string());
  }
  chain_->WaitIdle();
  return st;
}

}  // namespace sparsekv::server
