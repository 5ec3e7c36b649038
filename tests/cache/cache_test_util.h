// Helpers shared by the cache tests: small models, prompts, and the engine's request cycle.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "sparsekv/cache_manager.h"
#include "sparsekv/kv_events.h"
#include "sparsekv/model_spec.h"

namespace sparsekv::testing {

// One layer, one kind: a block is exactly one page.
inline ModelSpec OneKindSpec() {
  ModelSpec s;
  s.name = "one-kind";
  s.layers.push_back(LayerSpec{{KindSpec{CacheKind::kMlaLatent, StorageFormat::kBf16, 576, 1, 0}}});
  return s;
}

inline std::unique_ptr<CacheManager> MakeCache(const ModelSpec& spec, CacheManagerOptions o) {
  auto c = CacheManager::Create(spec, o);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

inline std::unique_ptr<CacheManager> MakeOneKind(uint32_t capacity, uint32_t block_tokens = 4) {
  CacheManagerOptions o;
  o.block_tokens = block_tokens;
  o.capacity_blocks = capacity;
  o.metadata_only = true;
  return MakeCache(OneKindSpec(), o);
}

// n tokens; prompts with different seeds share no block.
inline std::vector<TokenId> Prompt(size_t n, uint32_t seed) {
  std::vector<TokenId> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = seed * 100003u + static_cast<TokenId>(i);
  return t;
}

inline std::vector<TokenId> Concat(std::vector<TokenId> a, std::span<const TokenId> b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// An engine's prefill: create, append, acquire the cached prefix, allocate, commit. The sequence
// stays live (the caller frees it).
inline SequenceId RunPrompt(CacheManager& cache, std::span<const TokenId> tokens,
                            PrefixMatch* hit = nullptr, const SequenceOptions& options = {}) {
  auto seq = cache.CreateSequence(options);
  EXPECT_TRUE(seq.ok()) << seq.status().ToString();
  EXPECT_TRUE(cache.AppendTokens(*seq, tokens).ok());
  auto m = cache.AcquireCachedPrefix(*seq);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (hit != nullptr && m.ok()) *hit = *m;
  auto slots = cache.AllocateSlots(*seq, tokens.size());
  EXPECT_TRUE(slots.ok()) << slots.status().ToString();
  Status st = cache.CommitComputed(*seq, tokens.size());
  EXPECT_TRUE(st.ok()) << st.ToString();
  return *seq;
}

// The whole request at once, as trace replay does; returns the blocks that hit.
inline uint32_t RunAndFree(CacheManager& cache, std::span<const TokenId> tokens,
                           const SequenceOptions& options = {}) {
  PrefixMatch hit;
  const SequenceId seq = RunPrompt(cache, tokens, &hit, options);
  EXPECT_TRUE(cache.Free(seq).ok());
  return hit.blocks;
}

inline std::vector<PageId> Table(const CacheManager& cache, SequenceId seq, size_t pool = 0) {
  std::vector<PageId> t;
  EXPECT_TRUE(cache.GetBlockTable(seq, pool, &t).ok());
  return t;
}

// Every event, in delivery order.
class EventLog {
 public:
  explicit EventLog(CacheManager& cache) : cache_(cache) {
    id_ = cache.Subscribe([this](const KvEvent& e) {
      std::lock_guard<std::mutex> l(mu_);
      events_.push_back(e);
    });
  }
  ~EventLog() { cache_.Unsubscribe(id_); }
  std::vector<KvEvent> Take() {
    std::lock_guard<std::mutex> l(mu_);
    return std::move(events_);
  }

 private:
  CacheManager& cache_;
  SubscriptionId id_ = 0;
  std::mutex mu_;
  std::vector<KvEvent> events_;
};

}  // namespace sparsekv::testing
