// The engine loop against libsparsekv, smallest form: a V3.2 cache in memory, one request that
// computes its prompt, and a second with the same prompt that takes it from the prefix cache.
// Built and run against an installed sparsekv by the suite (tests/install), and shown whole in
// the manual (docs/guides/library.md), so the two cannot disagree.
#include <sparsekv/cache_manager.h>
#include <sparsekv/model_spec.h>

#include <cstdio>
#include <vector>

using namespace sparsekv;

// One request: look its prompt up, give the tokens to compute pages, "run the model" on them
// (here: write a byte into each new page of every pool), commit, and keep the pages cached.
static Result<uint64_t> Serve(CacheManager& cache, const std::vector<TokenId>& prompt) {
  SPARSEKV_ASSIGN_OR_RETURN(SequenceId seq, cache.CreateSequence());
  SPARSEKV_RETURN_IF_ERROR(cache.AppendTokens(seq, prompt));
  SPARSEKV_ASSIGN_OR_RETURN(PrefixMatch hit, cache.AcquireCachedPrefix(seq));  // tokens already computed
  // Pages for tokens [0, prompt size): the cached blocks have theirs, the rest are new.
  SPARSEKV_ASSIGN_OR_RETURN(SlotAllocation slots, cache.AllocateSlots(seq, prompt.size()));
  for (size_t p = 0; p < cache.num_pools(); ++p) {
    std::vector<PageId> table;  // this sequence's page in pool p for each block
    SPARSEKV_RETURN_IF_ERROR(cache.GetBlockTable(seq, p, &table));
    for (uint32_t b = slots.first_new_block; b < slots.first_new_block + slots.new_blocks; ++b) {
      cache.pool(p).PageData(table[b])[0] = static_cast<std::byte>(b);  // the model's KV goes here
    }
  }
  SPARSEKV_RETURN_IF_ERROR(cache.CommitComputed(seq, prompt.size()));  // [0, size) written: full blocks findable
  SPARSEKV_RETURN_IF_ERROR(cache.Free(seq));                   // their pages stay, cached
  return hit.tokens;
}

int main() {
  Result<ModelSpec> spec = ModelPreset("deepseek-v3.2-exp");  // MLA latent + indexer keys, bf16
  if (!spec.ok()) return 1;
  CacheManagerOptions options;
  options.block_tokens = 64;
  options.capacity_blocks = 64;  // pages per pool
  Result<std::unique_ptr<CacheManager>> cache = CacheManager::Create(*spec, options);
  if (!cache.ok()) {
    std::fprintf(stderr, "%s\n", cache.status().ToString().c_str());
    return 2;
  }
  std::vector<TokenId> prompt(300);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(1000 + i);
  Result<uint64_t> first = Serve(**cache, prompt);
  Result<uint64_t> second = Serve(**cache, prompt);
  if (!first.ok() || !second.ok()) {
    std::fprintf(stderr, "%s\n", (first.ok() ? second.status() : first.status()).ToString().c_str());
    return 3;
  }
  // 300 tokens are four full 64-token blocks and a partial one: the second request finds 256.
  std::printf("first request: %llu cached tokens; second: %llu\n", static_cast<unsigned long long>(*first),
              static_cast<unsigned long long>(*second));
  return *first == 0 && *second == 256 ? 0 : 4;
}
