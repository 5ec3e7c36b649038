#include "sparsekv/daemon_tier.h"

#include <fmt/format.h>

#include <cstring>
#include <mutex>

#include "sparsekv/bundle.h"

namespace sparsekv {
namespace {

WireBlockHash Wire(const BlockHash& h) {
  WireBlockHash w;
  std::memcpy(w.data(), &h.lo, 8);
  std::memcpy(w.data() + 8, &h.hi, 8);
  return w;
}

class DaemonTierImpl final : public DaemonTier {
 public:
  DaemonTierImpl(DaemonTierOptions o, std::unique_ptr<Client> c) : o_(std::move(o)), client_(std::move(c)) {}

  std::string_view name() const override { return o_.name; }
  uint64_t capacity_bytes() const override { return 0; }
  uint64_t max_record_bytes() const override { return o_.max_record_bytes; }
  TierStats Stats() const override {
    std::lock_guard l(mu_);
    return stats_;
  }

  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    std::vector<Status> out(bundles.size());
    std::vector<BundleRef> refs;
    std::vector<size_t> at;
    for (size_t i = 0; i < bundles.size(); ++i) {
      const std::span<const std::byte> r = bundles[i]->record();
      if (r.size() > o_.max_record_bytes) {
        out[i] = Status::InvalidArgument(fmt::format("{} tier: a record of {} bytes exceeds max_record_bytes ({})",
                                                     o_.name, r.size(), o_.max_record_bytes));
        continue;
      }
      refs.push_back(BundleRef{Wire(bundles[i]->key().hash), r});
      at.push_back(i);
    }
    uint64_t bytes = 0;
    if (!refs.empty()) {
      Result<std::vector<Status>> st = client_->Put(refs);
      for (size_t j = 0; j < at.size(); ++j) {
        out[at[j]] = st.ok() ? (*st)[j] : st.status();
        if (out[at[j]].ok()) bytes += refs[j].bytes.size();
      }
    }
    {
      std::lock_guard l(mu_);
      for (const Status& s : out) {
        ++(s.ok() ? stats_.puts : stats_.put_failures);
      }
      stats_.bytes_written += bytes;
    }
    done(std::move(out));
  }

  void GetAsync(std::vector<BundleKey> keys, BundlesCallback done) override {
    done(GetNow(keys));
  }

  void ContainsAsync(std::vector<BundleKey> keys, ContainsCallback done) override {
    std::vector<WireBlockHash> hashes;
    for (const BundleKey& k : keys) hashes.push_back(Wire(k.hash));
    std::vector<bool> out(keys.size(), false);
    Result<LookupResult> r = client_->Lookup(hashes);
    if (r.ok()) {
      for (size_t i = 0; i < keys.size() && i < r->tiers.size(); ++i) out[i] = r->tiers[i] != BlockTier::kAbsent;
    }
    done(std::move(out));
  }

  void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) override {
    std::vector<WireBlockHash> hashes;
    for (const BundleKey& k : keys) hashes.push_back(Wire(k.hash));
    Result<std::vector<Status>> st = client_->Delete(hashes);
    std::vector<Status> out(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      // Erasing what is not there leaves the key absent, as asked.
      out[i] = !st.ok() ? st.status() : (*st)[i].Is(StatusCode::kNotFound) ? Status::OK() : (*st)[i];
    }
    {
      std::lock_guard l(mu_);
      for (const Status& s : out) stats_.erased += s.ok();
    }
    done(std::move(out));
  }

  void EraseOlderAsync(std::vector<BundleKey> keys, std::vector<uint64_t> below, StatusesCallback done) override {
    std::vector<Result<BundlePtr>> got = GetNow(keys);
    std::vector<WireBlockHash> old;
    std::vector<size_t> at;
    std::vector<Status> out(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (got[i].ok() && (*got[i])->sequence() < below[i]) {
        old.push_back(Wire(keys[i].hash));
        at.push_back(i);
      } else if (!got[i].ok() && !got[i].status().Is(StatusCode::kNotFound) &&
                 !got[i].status().Is(StatusCode::kCorruption)) {
        out[i] = got[i].status();
      }
    }
    if (!old.empty()) {
      Result<std::vector<Status>> st = client_->Delete(old);
      for (size_t j = 0; j < at.size(); ++j) {
        const Status s = st.ok() ? (*st)[j] : st.status();
        out[at[j]] = s.Is(StatusCode::kNotFound) ? Status::OK() : s;
      }
    }
    done(std::move(out));
  }

 private:
  std::vector<Result<BundlePtr>> GetNow(const std::vector<BundleKey>& keys) {
    std::vector<WireBlockHash> hashes;
    for (const BundleKey& k : keys) hashes.push_back(Wire(k.hash));
    std::vector<Result<BundlePtr>> out(keys.size(), Status::NotFound(""));
    Result<std::vector<GetResult>> r = client_->Get(hashes);
    std::vector<WireBlockHash> bad;
    uint64_t hits = 0, misses = 0, corrupt = 0, bytes = 0, other_version = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!r.ok()) {
        out[i] = r.status();
        continue;
      }
      GetResult& g = (*r)[i];
      if (!g.status.ok()) {
        out[i] = g.status.Is(StatusCode::kNotFound)
                     ? Status::NotFound(fmt::format("{} tier: no bundle {}", o_.name, keys[i].ToString()))
                     : g.status;
        ++misses;
        continue;
      }
      Result<BundlePtr> b = Bundle::ParseRecord(g.bytes, keys[i]);
      if (!b.ok() && IsOtherBundleVersion(b.status())) {
        // Another release's record (engines of two releases sharing a daemon): a miss, left in
        // the daemon for its writer.
        out[i] = Status::NotFound(fmt::format("{} tier: {}", o_.name, b.status().message()));
        ++misses;
        ++other_version;
        continue;
      }
      if (!b.ok()) {
        out[i] = b.status().WithContext(fmt::format("{} tier", o_.name));
        bad.push_back(hashes[i]);
        ++corrupt;
        continue;
      }
      bytes += g.bytes.size();
      ++hits;
      out[i] = std::move(b);
    }
    if (!bad.empty()) (void)client_->Delete(bad);  // a value that is no good record of its key
    std::lock_guard l(mu_);
    stats_.hits += hits;
    stats_.misses += misses;
    stats_.corrupt += corrupt;
    stats_.other_version += other_version;
    stats_.bytes_read += bytes;
    return out;
  }

  const DaemonTierOptions o_;
  std::unique_ptr<Client> client_;
  mutable std::mutex mu_;
  TierStats stats_;
};

}  // namespace

Result<std::unique_ptr<DaemonTier>> DaemonTier::Open(const DaemonTierOptions& options) {
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<Client> c, Client::Connect(options.client));
  return std::unique_ptr<DaemonTier>(new DaemonTierImpl(options, std::move(c)));
}

}  // namespace sparsekv
