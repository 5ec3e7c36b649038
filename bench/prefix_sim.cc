#include "prefix_sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <set>
#include <unordered_map>
#include <vector>

#include "bench_util.h"

namespace sparsekv::bench {
namespace {

constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

// Cached blocks in LRU order: an intrusive list over slots, the least recently released first.
class LruOrder {
 public:
  void Touch(uint32_t s) {  // to the most recent end
    if (s >= prev_.size()) {
      prev_.resize(s + 1, kNone);
      next_.resize(s + 1, kNone);
      linked_.resize(s + 1, false);
    }
    Unlink(s);
    prev_[s] = tail_;
    next_[s] = kNone;
    if (tail_ != kNone) next_[tail_] = s;
    tail_ = s;
    if (head_ == kNone) head_ = s;
    linked_[s] = true;
  }
  void Unlink(uint32_t s) {
    if (s >= linked_.size() || !linked_[s]) return;
    if (prev_[s] != kNone) next_[prev_[s]] = next_[s];
    if (next_[s] != kNone) prev_[next_[s]] = prev_[s];
    if (head_ == s) head_ = next_[s];
    if (tail_ == s) tail_ = prev_[s];
    linked_[s] = false;
  }
  // The least recent slot for which `skip` is false.
  template <typename Skip>
  uint32_t Oldest(Skip&& skip) const {
    for (uint32_t s = head_; s != kNone; s = next_[s]) {
      if (!skip(s)) return s;
    }
    return kNone;
  }
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

 private:
  std::vector<uint32_t> prev_, next_;
  std::vector<bool> linked_;
  uint32_t head_ = kNone, tail_ = kNone;
};

}  // namespace

Result<PrefixSimResult> SimulatePrefixCache(std::span<const TraceRequest> trace, uint64_t capacity_blocks,
                                            SimPolicy policy, uint32_t block_tokens) {
  if (block_tokens == 0) return Status::InvalidArgument("prefix simulation: block_tokens must be positive");
  PrefixSimResult res;
  // Blocks get dense slots; per request, its blocks' slots.
  std::unordered_map<uint64_t, uint32_t> slot_of;
  std::vector<std::vector<uint32_t>> blocks(trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const uint64_t want = (r.input_length + block_tokens - 1) / block_tokens;
    if (r.hash_ids.size() != want) {
      return Status::InvalidArgument(fmt::format("prefix simulation: request {} of {} tokens has {} hash ids; expected {}",
                                                 i, r.input_length, r.hash_ids.size(), want));
    }
    res.blocks += want;
    blocks[i].reserve(want);
    // A block is its prefix: the chain of the hash ids up to it.
    uint64_t h = 0x12345;
    for (uint64_t j = 0; j < r.hash_ids.size(); ++j) {
      h = MixBits((h ^ r.hash_ids[j]) * 0x100000001b3ull + j);
      auto [it, fresh] = slot_of.try_emplace(h, static_cast<uint32_t>(slot_of.size()));
      blocks[i].push_back(it->second);
    }
  }
  const uint64_t capacity = capacity_blocks ? capacity_blocks : std::max<uint64_t>(1, res.blocks);
  // Belady: per request and block, the next request that could hit it (it lies within that
  // request's first (L - 1) / block_tokens blocks), found walking the trace backwards.
  std::vector<std::vector<uint64_t>> next_use;
  if (policy == SimPolicy::kBelady) {
    next_use.resize(trace.size());
    std::vector<uint64_t> seen(slot_of.size(), kNever);
    for (size_t i = trace.size(); i-- > 0;) {
      const uint64_t usable = trace[i].input_length ? (trace[i].input_length - 1) / block_tokens : 0;
      next_use[i].resize(blocks[i].size());
      for (size_t j = 0; j < blocks[i].size(); ++j) next_use[i][j] = seen[blocks[i][j]];
      for (size_t j = 0; j < std::min<uint64_t>(usable, blocks[i].size()); ++j) seen[blocks[i][j]] = i;
    }
  }
  std::vector<bool> cached(slot_of.size(), false);
  std::vector<uint64_t> pinned_by(slot_of.size(), kNever);  // the request pinning a hit block
  std::vector<uint64_t> key(slot_of.size(), kNever);        // Belady: next use, as in `by_next`
  std::set<std::pair<uint64_t, uint32_t>> by_next;          // Belady: cached blocks by next use
  LruOrder lru;
  uint64_t cached_count = 0;
  auto uncache = [&](uint32_t s) {
    cached[s] = false;
    --cached_count;
    ++res.evicted_blocks;
    if (policy == SimPolicy::kLru) {
      lru.Unlink(s);
    } else {
      by_next.erase({key[s], s});
    }
  };
  // A request done with its blocks: LRU releases them tail first (the head ends most recent);
  // Belady files each under its next use after this request.
  auto release = [&](size_t i, size_t count) {
    for (size_t j = count; j-- > 0;) {
      const uint32_t s = blocks[i][j];
      if (!cached[s]) continue;
      if (policy == SimPolicy::kLru) {
        lru.Touch(s);
      } else {
        by_next.erase({key[s], s});
        key[s] = next_use[i][j];
        by_next.insert({key[s], s});
      }
    }
  };
  std::vector<bool> mine;  // per full block of the request: hit, or cached by it
  const double t0 = NowSeconds();
  for (size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    if (r.input_length == 0) continue;
    ++res.requests;
    const std::vector<uint32_t>& b = blocks[i];
    const uint64_t usable = (r.input_length - 1) / block_tokens;
    const uint64_t full = r.input_length / block_tokens;
    uint64_t hit = 0;
    while (hit < usable && hit < b.size() && cached[b[hit]]) ++hit;
    if (b.size() > capacity) {  // failed: the hit blocks were acquired and are released again
      ++res.failed_requests;
      release(i, hit);
      continue;
    }
    for (uint64_t j = 0; j < hit; ++j) pinned_by[b[j]] = i;
    const uint64_t need = b.size() - hit;
    while (capacity - cached_count < need) {
      uint32_t victim = LruOrder::kNone;
      if (policy == SimPolicy::kLru) {
        victim = lru.Oldest([&](uint32_t s) { return pinned_by[s] == i; });
      } else {
        for (auto it = by_next.rbegin(); it != by_next.rend(); ++it) {
          if (pinned_by[it->second] != i) {
            victim = it->second;
            break;
          }
        }
      }
      if (victim == LruOrder::kNone) return Status::Internal("prefix simulation: nothing to evict");
      uncache(victim);
    }
    res.hit_blocks += hit;
    // The full blocks become cached (one already cached past the hit keeps its place; the page
    // allocated for it goes back), the partial block's page is freed.
    mine.assign(full, false);
    for (uint64_t j = 0; j < std::min<uint64_t>(hit, full); ++j) mine[j] = true;
    for (uint64_t j = hit; j < full; ++j) {
      const uint32_t s = b[j];
      if (cached[s]) continue;
      mine[j] = true;
      cached[s] = true;
      ++cached_count;
      if (policy == SimPolicy::kBelady) {
        key[s] = kNever;
        by_next.insert({key[s], s});
      }
    }
    // Released: the hit blocks and the new ones (the duplicates were not this request's).
    if (policy == SimPolicy::kLru) {
      for (uint64_t j = full; j-- > 0;) {
        if (mine[j]) lru.Touch(b[j]);
      }
    } else {
      release(i, full);
    }
  }
  res.seconds = NowSeconds() - t0;
  return res;
}

}  // namespace sparsekv::bench
