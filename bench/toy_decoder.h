// ToyDecoder: a deterministic stand-in for a DeepSeek model's decode step over a CacheManager
// sequence, so that suspend/resume and offload can be checked bit for bit without weights.
//
// Step(t) does for token t what the model does to the cache, in every layer and pool of the
// geometry, and reads back what the model reads:
//   - writes the token's row of every per-token kind (MLA latent, V3.2's indexer keys, V4's
//     sliding window) through the pool's codec at entry t % block_tokens;
//   - zeroes the compressor state pages at t = 0, and writes row t % state_rows of both tensors of every compressor state page (the running
//     state, fp32), and when t closes a group of `ratio` tokens, emits the compressed entry
//     (CSA, HCA, V4's indexer keys) from the state page: a fixed-order sum over its rows;
//   - before writing, reads in place what the layers read of the past: per kind (first layer),
//     the last entry, one drawn from the history (the window: from its live rows) and the
//     oldest live one, and every value of the compressor states; the token's rows are drawn
//     from (seed, t, token id, what was read), as a model's KV depends on its input and the
//     cache only;
//   - after writing, reads the new entries and runs SparseMla over a selection of the main
//     cache (the latent, or V4's window plus its CSA entries).
// Its result (the "logits") is a digest of everything read, so one differing byte anywhere the
// model reads changes every digest after it. NextToken turns a digest into the next token.
//
// The caller allocates slots for token t and performs the listed page copies (CacheManager::
// AllocateSlots) before Step, and commits after it, as an engine does.
// Thread safety: one decoder per thread (it owns scratch and a SparseMla).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "sparsekv/cache_manager.h"
#include "sparsekv/codec.h"
#include "sparsekv/sparse_mla.h"
#include "sparsekv/status.h"

namespace sparsekv::bench {

class ToyDecoder {
 public:
  static Result<std::unique_ptr<ToyDecoder>> Create(const CacheManager& manager, uint64_t seed);

  // Computes token `t` (its id `token`) of `seq`. Errors: a table without a page where the step
  // must write or read.
  Result<uint64_t> Step(SequenceId seq, uint64_t t, TokenId token);

  // Computes tokens [from, to) of `seq` again, with their ids from `tokens` (appended already),
  // as Run does per step; a step whose next token differs from tokens[t + 1] (where given) is
  // counted in `*mismatches`, and each step's digest goes to `digests` when given.
  Status Replay(CacheManager& manager, SequenceId seq, std::span<const TokenId> tokens, uint64_t from,
                uint64_t to, const std::function<Status(SequenceId, uint64_t)>& commit, uint64_t* mismatches,
                std::vector<uint64_t>* digests = nullptr);

  static TokenId NextToken(uint64_t digest) { return static_cast<TokenId>(digest % 50000); }

  // Decodes `count` tokens of `seq` as an engine does: `tokens` holds every token so far, all
  // appended to the sequence and all but the last computed. Per step: AllocateSlots and the page copies, Step, `commit`, then the
  // next token (NextToken) appended through `append` and pushed onto `tokens`. `digests`, when
  // given, gets each step's digest.
  using CommitFn = std::function<Status(SequenceId, uint64_t)>;
  using AppendFn = std::function<Status(SequenceId, std::span<const TokenId>)>;
  Status Run(CacheManager& manager, SequenceId seq, uint64_t count, std::vector<TokenId>* tokens,
             std::vector<uint64_t>* digests, const AppendFn& append, const CommitFn& commit);

 private:
  struct Pool {
    uint32_t index = 0;
    PoolGeometry geo;
    std::optional<PageCodec> codec;  // per-entry kinds
    int state_pool = -1;             // compressed kinds: the same layer's compressor state pool
  };
  // AllocateSlots for token t and the page copies it lists, as an engine does before a step.
  static Status Prepare(CacheManager& manager, SequenceId seq, uint64_t t);
  ToyDecoder(const CacheManager& manager, uint64_t seed) : manager_(manager), seed_(seed) {}
  const CacheManager& manager_;
  uint64_t seed_;
  std::vector<Pool> pools_;
  std::unique_ptr<SparseMla> mla_;
  int main_pool_ = -1;   // SparseMla's main cache
  int extra_pool_ = -1;  // V4: the CSA entries
  std::vector<std::vector<PageId>> tables_;
  std::vector<float> row_, acc_;
};

}  // namespace sparsekv::bench
