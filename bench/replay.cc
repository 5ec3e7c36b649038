#include "replay.h"

#include <fmt/format.h>

#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>

#include "bench_util.h"
#include "sparsekv/cache_manager.h"

namespace sparsekv::bench {
namespace {

Result<uint64_t> GetCount(const nlohmann::json& obj, const char* key, size_t line) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    return Status::InvalidArgument(fmt::format(
        "trace line {}: \"{}\" is missing; expected a non-negative integer", line, key));
  }
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0)) {
    return Status::InvalidArgument(fmt::format(
        "trace line {}: \"{}\" is {}; expected a non-negative integer", line, key, it->dump()));
  }
  return it->get<uint64_t>();
}

// splitmix64's finalizer: a bijection, so distinct ids get distinct streams.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace

Result<std::vector<TraceRequest>> ParseMooncakeTrace(std::string_view text,
                                                     uint32_t trace_block_tokens) {
  if (trace_block_tokens == 0)
    return Status::InvalidArgument("trace_block_tokens is 0; expected a positive count");
  std::vector<TraceRequest> out;
  size_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return Status::InvalidArgument(fmt::format("trace line {}: not a JSON object", line_no));
    }
    TraceRequest r;
    SPARSEKV_ASSIGN_OR_RETURN(r.input_length, GetCount(j, "input_length", line_no));
    auto ts = j.find("timestamp");
    if (ts != j.end()) {
      SPARSEKV_ASSIGN_OR_RETURN(r.timestamp, GetCount(j, "timestamp", line_no));
    }
    auto ol = j.find("output_length");
    if (ol != j.end()) {
      SPARSEKV_ASSIGN_OR_RETURN(r.output_length, GetCount(j, "output_length", line_no));
    }
    auto ids = j.find("hash_ids");
    if (ids == j.end() || !ids->is_array()) {
      return Status::InvalidArgument(fmt::format(
          "trace line {}: \"hash_ids\" is missing or not an array; expected one id per {} tokens",
          line_no, trace_block_tokens));
    }
    r.hash_ids.reserve(ids->size());
    for (const auto& id : *ids) {
      if (!id.is_number_unsigned() && !(id.is_number_integer() && id.get<int64_t>() >= 0)) {
        return Status::InvalidArgument(fmt::format(
            "trace line {}: hash id {} is not a non-negative integer", line_no, id.dump()));
      }
      r.hash_ids.push_back(id.get<uint64_t>());
    }
    const uint64_t want = (r.input_length + trace_block_tokens - 1) / trace_block_tokens;
    if (r.hash_ids.size() != want) {
      return Status::InvalidArgument(
          fmt::format("trace line {}: {} hash ids for input_length {}; expected ceil({}/{}) = {} "
                      "(one per {}-token block)",
                      line_no, r.hash_ids.size(), r.input_length, r.input_length,
                      trace_block_tokens, want, trace_block_tokens));
    }
    out.push_back(std::move(r));
  }
  return out;
}

Result<std::vector<TraceRequest>> LoadMooncakeTrace(const std::string& path,
                                                    uint32_t trace_block_tokens) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError(fmt::format("cannot open trace file {}", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::IOError(fmt::format("cannot read trace file {}", path));
  auto r = ParseMooncakeTrace(ss.str(), trace_block_tokens);
  if (!r.ok()) return r.status().WithContext(path);
  return r;
}

void SynthesizeBlockTokens(uint64_t hash_id, uint32_t first, std::span<TokenId> out) {
  // Tokens 0 and 1 spell the id, so distinct ids never give equal blocks; the rest follow a cheap
  // arithmetic stream, two vectors of four lanes at a time (synthesis must not dominate the
  // replay's time: it writes as many bytes as the hashing reads).
  using Lanes = uint32_t __attribute__((vector_size(16)));
  constexpr uint32_t kStep = 0x9e3779b9u;
  const uint32_t base = static_cast<uint32_t>(Mix(hash_id));
  auto at = [&](size_t i) { return base + static_cast<uint32_t>(first + i) * kStep; };
  Lanes lo = {at(0), at(1), at(2), at(3)};
  Lanes hi = {at(4), at(5), at(6), at(7)};
  const Lanes stride = Lanes{} + 8 * kStep;
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    std::memcpy(out.data() + i, &lo, sizeof(lo));
    std::memcpy(out.data() + i + 4, &hi, sizeof(hi));
    lo += stride;
    hi += stride;
  }
  for (; i < out.size(); ++i) out[i] = at(i);
  if (first == 0 && !out.empty()) out[0] = static_cast<uint32_t>(hash_id);
  if (first <= 1 && out.size() > 1 - first) out[1 - first] = static_cast<uint32_t>(hash_id >> 32);
}

ModelSpec ReplaySingleKindSpec() {
  ModelSpec s;
  s.name = "single-kind";
  s.layers.push_back(LayerSpec{{KindSpec{CacheKind::kMlaLatent, StorageFormat::kBf16, 576, 1, 0}}});
  return s;
}

double ReplayResult::TokenHitRatio(uint32_t block_tokens) const {
  return input_tokens
             ? static_cast<double>(hit_blocks) * block_tokens / static_cast<double>(input_tokens)
             : 0;
}

Result<ReplayResult> RunReplay(std::span<const TraceRequest> trace, const ReplayOptions& options) {
  if (options.block_tokens == 0 || options.trace_block_tokens == 0) {
    return Status::InvalidArgument("replay: block_tokens and trace_block_tokens must be positive");
  }
  ReplayResult res;
  for (const TraceRequest& r : trace) {
    res.blocks += (r.input_length + options.block_tokens - 1) / options.block_tokens;
    res.input_tokens += r.input_length;
    const uint64_t want =
        (r.input_length + options.trace_block_tokens - 1) / options.trace_block_tokens;
    if (r.hash_ids.size() != want) {
      return Status::InvalidArgument(
          fmt::format("replay: a request of {} tokens has {} hash ids; expected {}", r.input_length,
                      r.hash_ids.size(), want));
    }
  }
  // Unlimited: every block of the trace at once is more than can ever be live.
  const uint64_t capacity =
      options.capacity_blocks ? options.capacity_blocks : std::max<uint64_t>(1, res.blocks);
  if (capacity >= UINT32_MAX) {
    return Status::InvalidArgument(
        fmt::format("replay: capacity of {} blocks is too large", capacity));
  }
  res.capacity_blocks = capacity;

  CacheManagerOptions mo;
  mo.block_tokens = options.block_tokens;
  mo.capacity_blocks = static_cast<uint32_t>(capacity);
  mo.metadata_only = true;  // capacity is not bounded by memory
  mo.hash_mode = options.hash_mode;
  mo.eviction = options.eviction;
  mo.hint_bound = options.hint_bound;
  mo.max_hints = std::max<uint32_t>(mo.max_hints, options.lookahead + 1);
  mo.event_token_ids = options.kv_events != nullptr && options.kv_event_token_ids;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> cache,
                            CacheManager::Create(options.spec, mo));
  const uint64_t events_at_start = options.kv_events ? options.kv_events->Stats().accepted_events : 0;
  SubscriptionId subscription = 0;
  if (options.kv_events) subscription = options.kv_events->Attach(*cache, "GPU");
  ReplayRequestRecord record;
  std::vector<TokenId> record_tokens;

  SequenceOptions so;
  so.namespace_salt = options.namespace_salt;
  std::vector<TokenId> chunk(64 * 1024 / sizeof(TokenId));

  // Hints: request j's usable prefix (what its lookup may hit), hashed as the engine's scheduler
  // would, and hinted while j waits in the window of the next `lookahead` requests.
  std::vector<HintId> hint_of(options.lookahead ? trace.size() : 0, 0);
  std::vector<TokenId> hint_tokens;
  std::vector<BlockDigest> hint_digests;
  const BlockDigest root = cache->hasher().Root(options.namespace_salt);
  HintOptions hint_options;
  hint_options.ttl = std::chrono::hours(24 * 365);  // dropped by the replay, never expired
  auto hint = [&](size_t j) -> Status {
    if (j >= trace.size() || trace[j].input_length == 0) return Status::OK();
    const TraceRequest& r = trace[j];
    const uint64_t usable = (r.input_length - 1) / options.block_tokens * options.block_tokens;
    if (usable == 0) return Status::OK();
    hint_tokens.resize(usable);
    for (uint64_t pos = 0; pos < usable;) {
      const uint64_t b = pos / options.trace_block_tokens;
      const uint64_t stop = std::min<uint64_t>(usable, (b + 1) * options.trace_block_tokens);
      SynthesizeBlockTokens(r.hash_ids[b], static_cast<uint32_t>(pos % options.trace_block_tokens),
                            std::span<TokenId>(hint_tokens.data() + pos, stop - pos));
      pos = stop;
    }
    hint_digests.clear();
    cache->hasher().HashFullBlocks(root, hint_tokens, "", &hint_digests);
    SPARSEKV_ASSIGN_OR_RETURN(HintInfo h, cache->HintDigests(hint_digests, hint_options));
    hint_of[j] = h.id;
    ++res.hints;
    return Status::OK();
  };
  for (size_t j = 1; j <= options.lookahead; ++j) SPARSEKV_RETURN_IF_ERROR(hint(j));
  const size_t progress_every = std::max<size_t>(1, trace.size() / 200);
  const double t0 = NowSeconds();
  const double cpu0 = ProcessCpuSeconds();
  for (size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    if (options.progress && i % progress_every == 0) options.progress(i, trace.size());
    if (options.lookahead != 0 && i > 0) SPARSEKV_RETURN_IF_ERROR(hint(i + options.lookahead));
    if (r.input_length == 0) {
      ++res.skipped_requests;
      continue;
    }
    ++res.requests;
    SPARSEKV_ASSIGN_OR_RETURN(SequenceId seq, cache->CreateSequence(so));
    // The prompt goes in by chunks that stay in the L2 cache between synthesis and hashing: a
    // whole long prompt (up to half a megabyte here) would be written to memory and read back.
    for (uint64_t begin = 0; begin < r.input_length; begin += chunk.size()) {
      const uint64_t end = std::min<uint64_t>(begin + chunk.size(), r.input_length);
      for (uint64_t pos = begin; pos < end;) {
        const uint64_t b = pos / options.trace_block_tokens;
        const uint32_t offset = static_cast<uint32_t>(pos % options.trace_block_tokens);
        const uint64_t stop = std::min<uint64_t>(end, (b + 1) * options.trace_block_tokens);
        SynthesizeBlockTokens(r.hash_ids[b], offset,
                              std::span<TokenId>(chunk.data() + (pos - begin), stop - pos));
        pos = stop;
      }
      SPARSEKV_RETURN_IF_ERROR(
          cache->AppendTokens(seq, std::span<const TokenId>(chunk.data(), end - begin)));
    }
    if (options.on_request) {
      // The usable prefix's digests (as `hint` hashes them) and the events published so far.
      record.index = i;
      record.digests.clear();
      const uint64_t usable = (r.input_length - 1) / options.block_tokens * options.block_tokens;
      record_tokens.resize(usable);
      for (uint64_t pos = 0; pos < usable;) {
        const uint64_t b = pos / options.trace_block_tokens;
        const uint64_t stop = std::min<uint64_t>(usable, (b + 1) * options.trace_block_tokens);
        SynthesizeBlockTokens(r.hash_ids[b], static_cast<uint32_t>(pos % options.trace_block_tokens),
                              std::span<TokenId>(record_tokens.data() + pos, stop - pos));
        pos = stop;
      }
      if (usable > 0) cache->hasher().HashFullBlocks(root, record_tokens, "", &record.digests);
      record.events_before = options.kv_events ? options.kv_events->Stats().accepted_events : 0;
    }
    SPARSEKV_ASSIGN_OR_RETURN(PrefixMatch hit, cache->AcquireCachedPrefix(seq));
    if (options.on_request) {
      record.hit_blocks = hit.blocks;
      options.on_request(record);
    }
    if (options.lookahead != 0 && hint_of[i] != 0) SPARSEKV_RETURN_IF_ERROR(cache->DropHint(hint_of[i]));
    auto slots = cache->AllocateSlots(seq, r.input_length);
    if (!slots.ok()) {
      if (!slots.status().Is(StatusCode::kResourceExhausted)) return slots.status();
      // A prompt longer than the whole cache: served without caching, as an engine would reject
      // or chunk it; it counts no hit.
      ++res.failed_requests;
      SPARSEKV_RETURN_IF_ERROR(cache->Free(seq));
      continue;
    }
    res.hit_blocks += hit.blocks;
    SPARSEKV_RETURN_IF_ERROR(cache->CommitComputed(seq, r.input_length));
    SPARSEKV_RETURN_IF_ERROR(cache->Free(seq));
  }
  res.seconds = NowSeconds() - t0;
  if (options.kv_events) options.kv_events->Flush();  // the publisher's work for this replay counted
  res.cpu_seconds = ProcessCpuSeconds() - cpu0;
  if (options.kv_events) {
    cache->Unsubscribe(subscription);
    res.kv_events = options.kv_events->Stats().accepted_events - events_at_start;
  }
  if (options.progress) options.progress(trace.size(), trace.size());
  const CacheStats st = cache->Stats();
  if (st.internal_errors != 0) {
    return Status::Internal(
        fmt::format("replay: the cache manager counted {} internal errors, the first: {}",
                    st.internal_errors, st.first_internal_error));
  }
  res.evicted_blocks = st.evicted_blocks;
  res.stored_blocks = st.stored_blocks;
  res.duplicate_blocks = st.duplicate_blocks;
  res.hint_blocks_cut = st.hint_blocks_cut;
  return res;
}

nlohmann::json ReplayResultToJson(const ReplayResult& r, const ReplayOptions& options) {
  nlohmann::json j;
  j["requests"] = r.requests;
  j["blocks"] = r.blocks;
  j["hit_blocks"] = r.hit_blocks;
  j["block_hit_ratio"] = r.BlockHitRatio();
  j["token_hit_ratio"] = r.TokenHitRatio(options.block_tokens);
  j["seconds"] = r.seconds;
  j["blocks_per_s"] = r.BlocksPerSecond();
  j["cpu_seconds"] = r.cpu_seconds;
  j["input_tokens"] = r.input_tokens;
  j["skipped_requests"] = r.skipped_requests;
  j["failed_requests"] = r.failed_requests;
  j["capacity_blocks"] = r.capacity_blocks;
  j["unlimited"] = options.capacity_blocks == 0;
  j["policy"] = EvictionPolicyName(options.eviction);
  j["lookahead"] = options.lookahead;
  j["hints"] = r.hints;
  j["hint_blocks_cut"] = r.hint_blocks_cut;
  j["block_tokens"] = options.block_tokens;
  j["trace_block_tokens"] = options.trace_block_tokens;
  j["model"] = options.spec.name;
  j["hash_mode"] = std::string(HashModeName(options.hash_mode));
  j["evicted_blocks"] = r.evicted_blocks;
  j["stored_blocks"] = r.stored_blocks;
  j["duplicate_blocks"] = r.duplicate_blocks;
  if (options.kv_events) j["kv_events"] = r.kv_events;
  return j;
}

}  // namespace sparsekv::bench
