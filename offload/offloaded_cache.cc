#include "sparsekv/offloaded_cache.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>

namespace sparsekv {

// What the wrapper knows of a sequence: enough to name its blocks' bundles.
struct OffloadedCache::SequenceState {
  std::string namespace_salt;
  std::string extra_keys;
  bool cache_blocks = true;
  BlockDigest root;
  std::vector<TokenId> tail;         // tokens after the last full block
  std::vector<BlockDigest> digests;  // one per full block
  uint64_t tokens = 0;
};

struct OffloadedCache::Shared {
  Mutex mu;
  std::condition_variable_any idle;
  uint64_t in_flight SPARSEKV_GUARDED_BY(mu) = 0;
  OffloadedCacheStats stats SPARSEKV_GUARDED_BY(mu);
};

OffloadedCache::OffloadedCache(CacheManager& manager, TierChain& chain,
                               OffloadedCacheOptions options)
    : manager_(manager), chain_(chain), options_(options), shared_(std::make_shared<Shared>()) {}

OffloadedCache::~OffloadedCache() {
  WaitIdle();
}

void OffloadedCache::WaitIdle() {
  {
    MutexLock lock(shared_->mu);
    shared_->idle.wait(shared_->mu, [this]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
      return shared_->in_flight == 0;
    });
  }
  chain_.WaitIdle();
}

OffloadedCacheStats OffloadedCache::Stats() const {
  MutexLock lock(shared_->mu);
  return shared_->stats;
}

Result<SequenceId> OffloadedCache::CreateSequence(const SequenceOptions& options) {
  SPARSEKV_ASSIGN_OR_RETURN(SequenceId id, manager_.CreateSequence(options));
  auto st = std::make_shared<SequenceState>();
  st->namespace_salt = options.namespace_salt;
  st->extra_keys = options.extra_keys;
  st->cache_blocks = options.cache_blocks && manager_.options().enable_prefix_caching;
  st->root = manager_.hasher().Root(options.namespace_salt);
  MutexLock lock(mu_);
  sequences_[id] = std::move(st);
  return id;
}

Status OffloadedCache::AppendTokens(SequenceId seq, std::span<const TokenId> tokens) {
  std::shared_ptr<SequenceState> st;
  {
    MutexLock lock(mu_);
    auto it = sequences_.find(seq);
    if (it == sequences_.end())
      return Status::NotFound(fmt::format("offloaded cache: no sequence {}", seq));
    st = it->second;
  }
  SPARSEKV_RETURN_IF_ERROR(manager_.AppendTokens(seq, tokens));
  // The same chain the manager hashes (block_hash.h), kept here to name bundles.
  st->tail.insert(st->tail.end(), tokens.begin(), tokens.end());
  st->tokens += tokens.size();
  const BlockDigest parent = st->digests.empty() ? st->root : st->digests.back();
  const size_t added =
      manager_.hasher().HashFullBlocks(parent, st->tail, st->extra_keys, &st->digests);
  st->tail.erase(
      st->tail.begin(),
      st->tail.begin() + static_cast<std::ptrdiff_t>(added * manager_.geometry().block_tokens));
  return Status::OK();
}

Status OffloadedCache::Free(SequenceId seq) {
  {
    MutexLock lock(mu_);
    sequences_.erase(seq);
  }
  return manager_.Free(seq);
}

BundlePtr OffloadedCache::GatherBlock(SequenceId seq, uint32_t block, const BlockDigest& digest,
                                      const std::vector<std::vector<PageId>>& tables) const {
  const BlockGeometry& geo = manager_.geometry();
  std::vector<uint64_t> sizes;
  for (size_t p = 0; p < geo.pools.size(); ++p) {
    if (block >= tables[p].size() || tables[p][block] == kInvalidPage) return nullptr;
    sizes.push_back(geo.pools[p].block_stride);
  }
  sizes.push_back(sizeof digest.check);
  auto b = Bundle::MakeWith(KeyOf(digest), sizes, [&](uint32_t seg, std::span<std::byte> out) {
    if (seg < geo.pools.size()) {
      std::memcpy(out.data(), manager_.pool(seg).PageData(tables[seg][block]), out.size());
    } else {
      std::memcpy(out.data(), &digest.check, sizeof digest.check);
    }
  });
  return b.ok() ? *b : nullptr;
}

Status OffloadedCache::CheckLayout(const Bundle& b, const BlockDigest& digest) const {
  const BlockGeometry& geo = manager_.geometry();
  if (b.segment_count() != geo.pools.size() + 1) {
    return Status::Corruption(
        fmt::format("bundle {} has {} segments; this model's block has {} kinds + a digest",
                    b.key().ToString(), b.segment_count(), geo.pools.size()));
  }
  for (size_t p = 0; p < geo.pools.size(); ++p) {
    if (b.segment_bytes(static_cast<uint32_t>(p)) != geo.pools[p].block_stride) {
      return Status::Corruption(fmt::format(
          "bundle {}: kind {} holds {} bytes, the pool's block is {}", b.key().ToString(), p,
          b.segment_bytes(static_cast<uint32_t>(p)), geo.pools[p].block_stride));
    }
  }
  BlockHash check;
  const auto seg = b.segment(static_cast<uint32_t>(geo.pools.size()));
  if (seg.size() != sizeof check)
    return Status::Corruption("bundle " + b.key().ToString() + ": no digest check");
  std::memcpy(&check, seg.data(), sizeof check);
  if (!(check == digest.check)) {
    return Status::Corruption("bundle " + b.key().ToString() +
                              ": digest check differs (a hash collision)");
  }
  return Status::OK();
}

Status OffloadedCache::CommitComputed(SequenceId seq, uint64_t num_tokens) {
  std::shared_ptr<SequenceState> st;
  {
    MutexLock lock(mu_);
    auto it = sequences_.find(seq);
    if (it == sequences_.end())
      return Status::NotFound(fmt::format("offloaded cache: no sequence {}", seq));
    st = it->second;
  }
  std::vector<BundlePtr> bundles;
  if (options_.demote_on_commit && st->cache_blocks) {
    // Gather before committing: the commit releases window and snapshot pages that left the
    // sequence's window, and a bundle must hold every kind of its block.
    SPARSEKV_ASSIGN_OR_RETURN(SequenceInfo info, manager_.GetSequenceInfo(seq));
    const uint32_t bt = manager_.geometry().block_tokens;
    const auto first = static_cast<uint32_t>(info.computed_tokens / bt);
    const auto end = static_cast<uint32_t>(std::min<uint64_t>(num_tokens / bt, st->digests.size()));
    if (first < end) {
      std::vector<std::vector<PageId>> tables(manager_.num_pools());
      for (size_t p = 0; p < tables.size(); ++p)
        SPARSEKV_RETURN_IF_ERROR(manager_.GetBlockTable(seq, p, &tables[p]));
      for (uint32_t b = first; b < end; ++b) {
        if (BundlePtr bundle = GatherBlock(seq, b, st->digests[b], tables))
          bundles.push_back(std::move(bundle));
      }
    }
  }
  SPARSEKV_RETURN_IF_ERROR(manager_.CommitComputed(seq, num_tokens));
  if (bundles.empty()) return Status::OK();
  {
    MutexLock lock(shared_->mu);
    ++shared_->in_flight;
    shared_->stats.demoted_blocks += bundles.size();
  }
  auto shared = shared_;
  chain_.DemoteAsync(std::move(bundles), [shared](std::vector<Status> results) {
    uint64_t failed = 0;
    for (const Status& s : results) failed += !s.ok();
    MutexLock lock(shared->mu);
    shared->stats.demote_failures += failed;
    if (--shared->in_flight == 0) shared->idle.notify_all();
  });
  return Status::OK();
}

uint32_t OffloadedCache::RestoreBlocks(SequenceId seq, uint32_t first_block,
                                       std::span<const BlockDigest> digests) {
  std::vector<BundleKey> keys;
  for (const BlockDigest& d : digests) keys.push_back(KeyOf(d));
  std::vector<Result<BundlePtr>> got = chain_.Promote(keys).get();
  uint32_t usable = 0;
  uint64_t rejected = 0;
  for (; usable < got.size(); ++usable) {
    if (!got[usable].ok()) {
      rejected += !got[usable].status().Is(StatusCode::kNotFound);
      break;
    }
    const Status layout = CheckLayout(**got[usable], digests[usable]);
    if (!layout.ok()) {
      spdlog::warn("offloaded cache: not restoring: {}", layout.ToString());
      ++rejected;
      break;
    }
  }
  auto count = [&](uint64_t restored, uint64_t no_room) {
    MutexLock lock(shared_->mu);
    shared_->stats.restored_blocks += restored;
    shared_->stats.restore_rejected += rejected;
    shared_->stats.restore_no_room += no_room;
  };
  if (usable == 0) {
    count(0, 0);
    return 0;
  }
  const uint32_t bt = manager_.geometry().block_tokens;
  const uint64_t upto = uint64_t{first_block + usable} * bt;
  Result<SlotAllocation> alloc = manager_.AllocateSlots(seq, upto);
  if (!alloc.ok()) {
    count(0, 1);
    return 0;  // no room in L1: the L1 prefix stands alone, nothing changed
  }
  const BlockGeometry& geo = manager_.geometry();
  for (const PageCopy& c : alloc->copies) {
    std::memcpy(manager_.pool(c.pool).PageData(c.dst), manager_.pool(c.pool).PageData(c.src),
                geo.pools[c.pool].block_stride);
  }
  for (size_t p = 0; p < geo.pools.size(); ++p) {
    std::vector<PageId> table;
    if (!manager_.GetBlockTable(seq, p, &table).ok()) return 0;
    for (uint32_t i = 0; i < usable; ++i) {
      const std::span<const std::byte> seg = (*got[i])->segment(static_cast<uint32_t>(p));
      std::memcpy(manager_.pool(p).PageData(table[first_block + i]), seg.data(), seg.size());
    }
  }
  // Committed like computed KV: the blocks become the sequence's and findable again.
  const Status s = manager_.CommitComputed(seq, upto);
  if (!s.ok()) {
    spdlog::warn("offloaded cache: committing restored blocks: {}", s.ToString());
    count(0, 0);
    return 0;
  }
  count(usable, 0);
  return usable;
}

Result<OffloadedPrefix> OffloadedCache::AcquirePrefix(SequenceId seq) {
  std::shared_ptr<SequenceState> st;
  {
    MutexLock lock(mu_);
    auto it = sequences_.find(seq);
    if (it == sequences_.end())
      return Status::NotFound(fmt::format("offloaded cache: no sequence {}", seq));
    st = it->second;
  }
  SPARSEKV_ASSIGN_OR_RETURN(PrefixMatch l1, manager_.AcquireCachedPrefix(seq));
  OffloadedPrefix out;
  out.l1_blocks = l1.blocks;
  const uint32_t bt = manager_.geometry().block_tokens;
  // A request computes at least one token: at most (tokens - 1) / bt blocks can hit.
  const uint64_t limit =
      st->tokens == 0 ? 0 : std::min<uint64_t>((st->tokens - 1) / bt, st->digests.size());
  if (st->cache_blocks && l1.blocks < limit) {
    std::span<const BlockDigest> rest(st->digests.data() + l1.blocks, limit - l1.blocks);
    std::vector<BundleKey> keys;
    for (const BlockDigest& d : rest) keys.push_back(KeyOf(d));
    const std::vector<int> where = chain_.Locate(keys);
    size_t present = 0;
    while (present < where.size() && where[present] >= 0) ++present;
    if (present > 0) out.lower_blocks = RestoreBlocks(seq, l1.blocks, rest.first(present));
    // Prefetch what follows, so the next request of this conversation finds it in host DRAM.
    const uint32_t prefetch = options_.prefetch_blocks >= 0
                                  ? static_cast<uint32_t>(options_.prefetch_blocks)
                                  : chain_.options().prefetch_blocks;
    std::vector<BundleKey> next;
    for (size_t i = l1.blocks + out.lower_blocks; i < st->digests.size() && next.size() < prefetch;
         ++i) {
      next.push_back(KeyOf(st->digests[i]));
    }
    if (!next.empty()) chain_.Prefetch(std::move(next));
  }
  out.blocks = out.l1_blocks + out.lower_blocks;
  out.tokens = uint64_t{out.blocks} * bt;
  return out;
}

Result<OffloadedPrefix> OffloadedCache::LookupPrefix(const PrefixQuery& query) {
  SPARSEKV_ASSIGN_OR_RETURN(PrefixMatch l1, manager_.LookupPrefix(query));
  OffloadedPrefix out;
  out.l1_blocks = l1.blocks;
  const uint32_t bt = manager_.geometry().block_tokens;
  std::vector<BlockDigest> digests;
  manager_.hasher().HashFullBlocks(manager_.hasher().Root(query.namespace_salt), query.tokens,
                                   query.extra_keys, &digests);
  uint64_t limit = digests.size();
  if (query.leave_last_token)
    limit = query.tokens.empty() ? 0 : std::min<uint64_t>(limit, (query.tokens.size() - 1) / bt);
  if (l1.blocks < limit) {
    std::vector<BundleKey> keys;
    for (uint64_t i = l1.blocks; i < limit; ++i) keys.push_back(KeyOf(digests[i]));
    out.lower_blocks = static_cast<uint32_t>(chain_.CountPrefix(keys));
  }
  out.blocks = out.l1_blocks + out.lower_blocks;
  out.tokens = uint64_t{out.blocks} * bt;
  return out;
}

}  // namespace sparsekv
