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
constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

// Slots in recency order: an intrusive list, the least recent first. A slot is in one list at
// most (the caller keeps track of which).
class Order {
 public:
  explicit Order(size_t slots) : prev_(slots, kNone), next_(slots, kNone) {}
  void PushBack(uint32_t s) {
    prev_[s] = tail_;
    next_[s] = kNone;
    if (tail_ != kNone) next_[tail_] = s;
    tail_ = s;
    if (head_ == kNone) head_ = s;
    ++size_;
  }
  void Erase(uint32_t s) {
    if (prev_[s] != kNone) next_[prev_[s]] = next_[s];
    if (next_[s] != kNone) prev_[next_[s]] = prev_[s];
    if (head_ == s) head_ = next_[s];
    if (tail_ == s) tail_ = prev_[s];
    prev_[s] = next_[s] = kNone;
    --size_;
  }
  uint32_t Front() const { return head_; }
  uint32_t Next(uint32_t s) const { return next_[s]; }
  size_t size() const { return size_; }

 private:
  std::vector<uint32_t> prev_, next_;
  uint32_t head_ = kNone, tail_ = kNone;
  size_t size_ = 0;
};

// Where a slot is: in none of the lists, cached (LRU: kT1 only; ARC: T1 never hit, T2 hit), or a
// ghost of ARC (B1, B2: evicted recently from T1, T2).
enum Where : uint8_t { kOut = 0, kT1, kT2, kB1, kB2 };

}  // namespace

Result<SimPolicy> ParseSimPolicy(const std::string& name) {
  if (name == "lru") return SimPolicy::kLru;
  if (name == "arc") return SimPolicy::kArc;
  if (name == "belady") return SimPolicy::kBelady;
  return Status::InvalidArgument(fmt::format("unknown policy '{}': lru, arc or belady", name));
}

Result<PrefixSimResult> SimulatePrefixCache(std::span<const TraceRequest> trace, const PrefixSimOptions& o) {
  if (o.block_tokens == 0) return Status::InvalidArgument("prefix simulation: block_tokens must be positive");
  if (!(o.hint_bound >= 0 && o.hint_bound <= 1)) {
    return Status::InvalidArgument("prefix simulation: hint_bound must lie in [0, 1]");
  }
  const uint32_t bt = o.block_tokens;
  PrefixSimResult res;
  // Blocks get dense slots; per request, its blocks' slots.
  std::unordered_map<uint64_t, uint32_t> slot_of;
  std::vector<std::vector<uint32_t>> blocks(trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const uint64_t want = (r.input_length + bt - 1) / bt;
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
  const size_t slots = slot_of.size();
  const uint64_t capacity = o.capacity_blocks ? o.capacity_blocks : std::max<uint64_t>(1, res.blocks);
  auto usable = [&](size_t i) { return trace[i].input_length ? (trace[i].input_length - 1) / bt : 0; };

  // Belady: per request and block, the next request that could hit it (it lies within that
  // request's usable prefix), found walking the trace backwards.
  std::vector<std::vector<uint64_t>> next_use;
  if (o.policy == SimPolicy::kBelady) {
    next_use.resize(trace.size());
    std::vector<uint64_t> seen(slots, kNever);
    for (size_t i = trace.size(); i-- > 0;) {
      next_use[i].resize(blocks[i].size());
      for (size_t j = 0; j < blocks[i].size(); ++j) next_use[i][j] = seen[blocks[i][j]];
      for (size_t j = 0; j < std::min<uint64_t>(usable(i), blocks[i].size()); ++j) seen[blocks[i][j]] = i;
    }
  }

  std::vector<Where> where(slots, kOut);
  std::vector<uint64_t> pinned_by(slots, kNever);  // the request pinning a hit block
  std::vector<uint64_t> key(slots, kNever);        // Belady: next use, as in `by_next`
  std::set<std::pair<uint64_t, uint32_t>> by_next;  // Belady: cached blocks by next use
  Order t1(slots), t2(slots), b1(slots), b2(slots);  // LRU uses t1 alone
  uint64_t arc_p = 0;  // ARC's target size of T1
  uint64_t cached_count = 0;
  auto cached = [&](uint32_t s) { return where[s] == kT1 || where[s] == kT2; };
  auto list = [&](Where w) -> Order& { return w == kT1 ? t1 : w == kT2 ? t2 : w == kB1 ? b1 : b2; };
  auto move = [&](uint32_t s, Where to) {
    if (where[s] != kOut) list(where[s]).Erase(s);
    where[s] = to;
    if (to != kOut) list(to).PushBack(s);
  };

  // Hints: how many of the next `lookahead` requests read each block, and how many cached blocks
  // are protected so.
  std::vector<uint32_t> hinted(o.lookahead ? slots : 0, 0);
  uint64_t protected_cached = 0;
  const uint64_t hint_limit = static_cast<uint64_t>(o.hint_bound * static_cast<double>(capacity));
  auto hint = [&](size_t i, int delta) {
    if (i >= trace.size()) return;
    for (size_t j = 0; j < std::min<uint64_t>(usable(i), blocks[i].size()); ++j) {
      const uint32_t s = blocks[i][j];
      const bool was = hinted[s] > 0;
      hinted[s] = static_cast<uint32_t>(static_cast<int>(hinted[s]) + delta);
      const bool is = hinted[s] > 0;
      if (was != is && cached(s)) protected_cached += is ? 1 : -1;
    }
  };
  if (o.lookahead) {
    for (size_t i = 1; i <= o.lookahead; ++i) hint(i, +1);
  }

  // The oldest slot of `order` that `ok` accepts.
  auto oldest = [&](const Order& order, auto&& ok) {
    for (uint32_t s = order.Front(); s != kNone; s = order.Next(s)) {
      if (ok(s)) return s;
    }
    return kNone;
  };
  auto victim = [&](size_t i, bool honour_hints) -> uint32_t {
    auto ok = [&](uint32_t s) { return pinned_by[s] != i && !(honour_hints && hinted[s] > 0); };
    switch (o.policy) {
      case SimPolicy::kLru:
        return oldest(t1, ok);
      case SimPolicy::kArc: {
        const bool from_t1 = t1.size() > 0 && t1.size() > arc_p;
        uint32_t s = oldest(from_t1 ? t1 : t2, ok);
        return s != kNone ? s : oldest(from_t1 ? t2 : t1, ok);
      }
      case SimPolicy::kBelady:
        for (auto it = by_next.rbegin(); it != by_next.rend(); ++it) {
          if (ok(it->second)) return it->second;
        }
        return kNone;
    }
    return kNone;
  };
  auto evict = [&](uint32_t s) {
    --cached_count;
    ++res.evicted_blocks;
    if (o.lookahead && hinted[s] > 0) --protected_cached;
    switch (o.policy) {
      case SimPolicy::kLru:
        move(s, kOut);
        break;
      case SimPolicy::kArc: {
        Where ghost = where[s] == kT1 ? kB1 : kB2;
        move(s, ghost);
        Order& g = list(ghost);
        if (g.size() > capacity) move(g.Front(), kOut);
        break;
      }
      case SimPolicy::kBelady:
        by_next.erase({key[s], s});
        where[s] = kOut;  // in no list: Belady's order is `by_next`
        break;
    }
  };
  auto admit = [&](uint32_t s) {  // a block newly cached
    ++cached_count;
    if (o.lookahead && hinted[s] > 0) ++protected_cached;
    switch (o.policy) {
      case SimPolicy::kLru:
        move(s, kT1);
        break;
      case SimPolicy::kArc:
        // A ghost hit adapts the split towards the list it was evicted from.
        if (where[s] == kB1) {
          arc_p = std::min<uint64_t>(capacity, arc_p + std::max<uint64_t>(1, b2.size() / std::max<size_t>(1, b1.size())));
          move(s, kT2);
        } else if (where[s] == kB2) {
          const uint64_t d = std::max<uint64_t>(1, b1.size() / std::max<size_t>(1, b2.size()));
          arc_p = arc_p > d ? arc_p - d : 0;
          move(s, kT2);
        } else {
          move(s, kT1);
        }
        break;
      case SimPolicy::kBelady:
        where[s] = kT1;  // "cached"; Belady's order is `by_next`
        key[s] = kNever;
        by_next.insert({key[s], s});
        break;
    }
  };
  // A request done with its blocks (`mine`: hit or cached by it), tail first.
  auto release = [&](size_t i, const std::vector<bool>& mine, uint64_t hit) {
    for (size_t j = mine.size(); j-- > 0;) {
      if (!mine[j]) continue;
      const uint32_t s = blocks[i][j];
      switch (o.policy) {
        case SimPolicy::kLru:
          move(s, kT1);
          break;
        case SimPolicy::kArc:
          move(s, j < hit ? kT2 : where[s]);  // a hit moves a block to T2; else it stays in its list
          break;
        case SimPolicy::kBelady:
          by_next.erase({key[s], s});
          key[s] = next_use[i][j];
          by_next.insert({key[s], s});
          break;
      }
    }
  };

  std::vector<bool> mine;
  const double t0 = NowSeconds();
  for (size_t i = 0; i < trace.size(); ++i) {
    if (o.lookahead && i > 0) {
      hint(i, -1);  // no longer ahead: it is this one
      hint(i + o.lookahead, +1);
    }
    const TraceRequest& r = trace[i];
    if (r.input_length == 0) continue;
    ++res.requests;
    const std::vector<uint32_t>& b = blocks[i];
    const uint64_t use = usable(i);
    const uint64_t full = r.input_length / bt;
    uint64_t hit = 0;
    while (hit < use && hit < b.size() && cached(b[hit])) ++hit;
    if (b.size() > capacity) {  // failed: the hit blocks were acquired and are released again
      ++res.failed_requests;
      mine.assign(hit, true);
      if (o.policy != SimPolicy::kArc) release(i, mine, 0);  // ARC: acquired, not hit
      continue;
    }
    for (uint64_t j = 0; j < hit; ++j) pinned_by[b[j]] = i;
    const uint64_t need = b.size() - hit;
    while (capacity - cached_count < need) {
      const bool honour = o.lookahead > 0 && protected_cached <= hint_limit;
      uint32_t s = victim(i, honour);
      if (s == kNone && honour) s = victim(i, false);
      if (s == kNone) return Status::Internal("prefix simulation: nothing to evict");
      evict(s);
    }
    res.hit_blocks += hit;
    // The full blocks become cached (one already cached past the hit keeps its place; the page
    // allocated for it goes back), the partial block's page is freed.
    mine.assign(full, false);
    for (uint64_t j = 0; j < std::min<uint64_t>(hit, full); ++j) mine[j] = true;
    for (uint64_t j = hit; j < full; ++j) {
      if (cached(b[j])) continue;
      mine[j] = true;
      admit(b[j]);
    }
    release(i, mine, hit);
  }
  res.seconds = NowSeconds() - t0;
  return res;
}

}  // namespace sparsekv::bench
