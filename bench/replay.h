// Trace replay: a Mooncake-format request trace through the real CacheManager.
//
// A trace is JSON lines: {"timestamp", "input_length", "output_length", "hash_ids"}, one hash id
// per `trace_block_tokens` (512) tokens of the prompt, the last block usually partial; equal ids
// mean equal prefixes. Token ids are synthesized from the hash ids (equal ids give equal tokens,
// distinct ids distinct ones), so the replay exercises the same hashing, lookup, allocation,
// registration and eviction code an engine links. Each request is looked up, allocated,
// registered (committed) and freed at once, in file order.
//
// Hints (`lookahead` N): the scheduler is taken to know the next N requests by arrival, as an
// engine knows its waiting queue. When request i arrives, request i+N is hinted (its usable
// prefix: CacheManager::HintDigests); a request's hint is dropped once it has looked up.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/block_hash.h"
#include "sparsekv/eviction_policy.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/status.h"
#include "sparsekv/vllm_kv_events.h"

namespace sparsekv::bench {

struct TraceRequest {
  uint64_t timestamp = 0;
  uint64_t input_length = 0;
  uint64_t output_length = 0;
  std::vector<uint64_t> hash_ids;
};

// Errors name the line and the field: not JSON, a missing or mistyped field, or a hash_ids count
// other than ceil(input_length / trace_block_tokens).
Result<std::vector<TraceRequest>> ParseMooncakeTrace(std::string_view text,
                                                     uint32_t trace_block_tokens = 512);
Result<std::vector<TraceRequest>> LoadMooncakeTrace(const std::string& path,
                                                    uint32_t trace_block_tokens = 512);

// The tokens of trace block `hash_id`, from offset `first` within it: out[i] is token first + i.
// Deterministic; blocks of distinct ids differ in their first two tokens.
void SynthesizeBlockTokens(uint64_t hash_id, uint32_t first, std::span<TokenId> out);

// The default replay model: one layer of one kind (mla_latent, bf16), so a block is one page.
ModelSpec ReplaySingleKindSpec();

// What `on_request` sees of one request.
struct ReplayRequestRecord {
  uint64_t index = 0;  // line of the trace, from 0
  // Digests of the blocks its lookup may hit (the full blocks of all but its last token), as
  // the manager's hasher chains them; BlockDigest::hash is what events publish.
  std::vector<BlockDigest> digests;
  // Events the publisher had accepted before the lookup (VllmKvEventStats::accepted_events):
  // a subscriber's index after that many events predicts the lookup.
  uint64_t events_before = 0;
  uint64_t hit_blocks = 0;  // what the lookup hit
};

struct ReplayOptions {
  // The model whose pools the manager builds. Default: ReplaySingleKindSpec().
  ModelSpec spec = ReplaySingleKindSpec();
  // Tokens per cache block. Default: 512.
  uint32_t block_tokens = 512;
  // Tokens per trace hash id (Mooncake: 512). Default: 512.
  uint32_t trace_block_tokens = 512;
  // Pages per pool; 0 for unlimited (the trace's total block count, so nothing is ever evicted).
  // Default: 0.
  uint64_t capacity_blocks = 0;
  // Prefix hash chain. Default: kXxh3.
  HashMode hash_mode = HashMode::kXxh3;
  // Namespace salt of every request. Default: "".
  std::string namespace_salt;
  // The pools' eviction policy. Default: kDefaultEvictionPolicy.
  EvictionPolicyKind eviction = kDefaultEvictionPolicy;
  // Hint the next `lookahead` requests (0: no hints). Default: 0.
  uint32_t lookahead = 0;
  // CacheManagerOptions::hint_bound. Default: 0.5.
  double hint_bound = 0.5;
  // Called now and then with (requests done, requests); optional. Default: none.
  std::function<void(size_t, size_t)> progress;
  // KV events on vLLM's wire: the manager's events go to this publisher (Attach, medium "GPU"),
  // which must outlive the replay.
  // Default: none (no events).
  VllmKvEventPublisher* kv_events = nullptr;
  // With kv_events: BlockStored carries the blocks' token ids (the manager keeps every prompt's
  // tokens for it). Default: false (hashes and parents only, the manager's default).
  bool kv_event_token_ids = false;
  // Called for every replayed request after its lookup (tests: what a router predicts from the
  // events published before the lookup must equal the hits served). Default: none.
  std::function<void(const ReplayRequestRecord&)> on_request;
};


struct ReplayResult {
  uint64_t requests = 0;          // replayed
  uint64_t skipped_requests = 0;  // input_length 0
  uint64_t failed_requests = 0;   // needed more pages than the capacity holds
  uint64_t blocks = 0;            // sum of ceil(input_length / block_tokens)
  uint64_t hit_blocks = 0;
  uint64_t input_tokens = 0;
  uint64_t capacity_blocks = 0;  // pages per pool used
  uint64_t evicted_blocks = 0;
  uint64_t stored_blocks = 0;
  uint64_t duplicate_blocks = 0;
  uint64_t hints = 0;            // hints given
  uint64_t hint_blocks_cut = 0;  // hinted blocks left unprotected by the bound
  uint64_t kv_events = 0;        // events given to ReplayOptions::kv_events
  double seconds = 0;  // the replay loop: token synthesis, hashing and every cache call
  double cpu_seconds = 0;  // CPU of every thread of the process during the loop (KV events' too)

  double BlockHitRatio() const {
    return blocks ? static_cast<double>(hit_blocks) / static_cast<double>(blocks) : 0;
  }
  // hit_blocks * block_tokens / sum of input_length.
  double TokenHitRatio(uint32_t block_tokens) const;
  double BlocksPerSecond() const { return seconds > 0 ? static_cast<double>(blocks) / seconds : 0; }
  double BlocksPerCpuSecond() const { return cpu_seconds > 0 ? static_cast<double>(blocks) / cpu_seconds : 0; }
};

Result<ReplayResult> RunReplay(std::span<const TraceRequest> trace, const ReplayOptions& options);

// requests, blocks, hit_blocks, block_hit_ratio, token_hit_ratio, seconds, and the rest.
nlohmann::json ReplayResultToJson(const ReplayResult& r, const ReplayOptions& options);

}  // namespace sparsekv::bench
