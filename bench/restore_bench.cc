#include "restore_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "sparsekv/bundle.h"
#include "sparsekv/cache_manager.h"
#include "sparsekv/file_system.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/ssd_tier.h"
#include "sparsekv/storage_format.h"
#include "sparsekv/tier_chain.h"

namespace sparsekv::bench {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint32_t kMaxBlocks = 65536;

uint64_t RoundUp4k(uint64_t n) {
  return (n + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
}

// Anonymous memory advised for transparent huge pages, as the L1 arenas are, every page touched
// before anything is timed.
class TouchedBuffer {
 public:
  static Result<std::unique_ptr<TouchedBuffer>> Make(uint64_t bytes) {
    auto b = std::unique_ptr<TouchedBuffer>(new TouchedBuffer);
    b->bytes_ = std::max<uint64_t>(bytes, 1);
    void* p = mmap(nullptr, b->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return Status::ResourceExhausted(
          fmt::format("restore bench: cannot map {} bytes: {}", bytes, std::strerror(errno)));
    }
    b->data_ = static_cast<std::byte*>(p);
    madvise(p, b->bytes_, MADV_HUGEPAGE);
    std::memset(p, 0, b->bytes_);
    return b;
  }
  ~TouchedBuffer() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  std::byte* data() const { return data_; }

 private:
  TouchedBuffer() = default;
  std::byte* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// CPU seconds (user + system, every thread) and page faults (minor + major) of the process.
struct Usage {
  double cpu_s = 0;
  uint64_t faults = 0;
};

Usage UsageNow() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return {secs(ru.ru_utime) + secs(ru.ru_stime), ProcessPageFaults()};
}

// One timed call: seconds, CPU seconds and page faults.
struct Timed {
  double seconds = 0;
  double cpu_s = 0;
  uint64_t faults = 0;
};

template <typename Body>
Timed Measure(Body body) {
  const Usage u0 = UsageNow();
  const double t0 = NowSeconds();
  body();
  const double t1 = NowSeconds();
  const Usage u1 = UsageNow();
  return {std::max(t1 - t0, 1e-12), u1.cpu_s - u0.cpu_s, u1.faults - u0.faults};
}

// A round's prompt: blocks * block_tokens + 1 deterministic ids, different in every round, so
// no round finds the blocks of another.
std::vector<TokenId> RoundPrompt(uint32_t blocks, uint32_t block_tokens, int round) {
  std::vector<TokenId> t(uint64_t{blocks} * block_tokens + 1);
  for (size_t i = 0; i < t.size(); ++i)
    t[i] = static_cast<TokenId>(uint64_t(round + 1) * 1000003u + i * 7);
  return t;
}

Status BlockTables(const CacheManager& m, SequenceId seq, std::vector<std::vector<PageId>>* out) {
  out->assign(m.num_pools(), {});
  for (size_t p = 0; p < m.num_pools(); ++p)
    SPARSEKV_RETURN_IF_ERROR(m.GetBlockTable(seq, p, &(*out)[p]));
  return Status::OK();
}

// O_DIRECT sequential reads of `bytes` from the start of `path`, 1 MiB at a time, queue depth 1,
// into one 4 KiB-aligned buffer. Returns seconds.
Result<double> PreadFile(const std::string& path, uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    return Status::IOError(
        fmt::format("restore bench: open {} (O_DIRECT): {}", path, std::strerror(errno)));
  }
  void* buf = nullptr;
  if (posix_memalign(&buf, kDirectIoAlignment, kMiB) != 0) {
    ::close(fd);
    return Status::ResourceExhausted("restore bench: no memory for the pread buffer");
  }
  std::memset(buf, 0, kMiB);
  Status st = Status::OK();
  const double t0 = NowSeconds();
  for (uint64_t off = 0; off < bytes;) {
    const uint64_t want = std::min<uint64_t>(kMiB, bytes - off);
    const ssize_t n = ::pread(fd, buf, want, static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      st = Status::IOError(fmt::format("restore bench: pread {} at {}: {}", path, off,
                                       n < 0 ? std::strerror(errno) : "end of file"));
      break;
    }
    off += static_cast<uint64_t>(n);
  }
  const double seconds = NowSeconds() - t0;
  std::free(buf);
  ::close(fd);
  if (!st.ok()) return st;
  return std::max(seconds, 1e-12);
}

// `tiers` stacked under `manager` with one write policy for both the chain and the cache
// (evict_ahead_blocks `ahead`). The cache must go first: it is the second member.
std::pair<std::unique_ptr<TierChain>, std::unique_ptr<OffloadedCache>> ChainUnder(
    CacheManager& manager, std::vector<std::unique_ptr<Tier>> tiers, WritePolicy policy, uint32_t ahead) {
  TierChainOptions co;
  co.write_policy = policy;
  auto chain = std::make_unique<TierChain>(std::move(tiers), co);
  OffloadedCacheOptions oco;
  oco.write_policy = policy;
  oco.evict_ahead_blocks = ahead;
  auto cache = std::make_unique<OffloadedCache>(manager, *chain, oco);
  return {std::move(chain), std::move(cache)};
}

double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Write-back eviction, as a decode or chunked prefill meets it: L1 of `capacity` blocks full of
// one prompt's cached blocks; a second sequence then takes one block at a time, and writes its
// pages and waits out `compute_s` (the engine computing the block: the accelerator's time,
// this thread idle) before taking the next. Each block it takes evicts one of the first
// prompt's into the host tier: copied by the eviction hook inside AllocateSlots (`ahead` 0), or
// evicted ahead of need on the demote thread (`ahead` > 0). Returns the seconds spent in
// AllocateSlots plus those in EvictAhead (both hold the manager's lock, or wait for it), per
// evicted block.
Result<nlohmann::json> MeasureWriteBackEviction(const ModelSpec& spec, uint32_t block_tokens, uint32_t capacity,
                                                uint32_t ahead, double compute_s, const std::byte* pattern,
                                                uint64_t pattern_blocks) {
  CacheManagerOptions mo;
  mo.block_tokens = block_tokens;
  mo.capacity_blocks = capacity;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> manager, CacheManager::Create(spec, mo));
  const size_t pools = manager->num_pools();
  std::vector<uint64_t> stride(pools), offset(pools), segments;
  uint64_t block_bytes = 0;
  for (size_t p = 0; p < pools; ++p) {
    stride[p] = manager->geometry().pools[p].block_stride;
    offset[p] = block_bytes;
    block_bytes += stride[p];
    const PagePool& pool = manager->pool(p);
    for (PageId page = 0; page < pool.capacity(); ++page) std::memset(pool.PageData(page), 0, stride[p]);
  }
  segments = stride;
  segments.push_back(sizeof(BlockDigest{}.check));
  const uint64_t record = RoundUp4k(BundleRecordBytes(segments));
  HostTierOptions h;
  h.capacity_bytes = 3 * uint64_t{capacity} * record / 2;
  h.max_record_bytes = record;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> host, HostTier::Open(h));
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(std::move(host));
  auto [chain, cache] = ChainUnder(*manager, std::move(tiers), WritePolicy::kWriteBack, ahead);

  std::vector<std::vector<PageId>> tables;
  auto write_block = [&](uint32_t b) {
    const std::byte* src = pattern + uint64_t{b % pattern_blocks} * block_bytes;
    for (size_t p = 0; p < pools; ++p) {
      if (b < tables[p].size() && tables[p][b] != kInvalidPage)
        std::memcpy(manager->pool(p).PageData(tables[p][b]), src + offset[p], stride[p]);
    }
  };
  const uint32_t blocks = capacity - 1;
  const uint64_t tokens = uint64_t{blocks} * block_tokens;
  // The first prompt: computed whole, committed, freed: `blocks` cached blocks, one page free.
  std::vector<TokenId> first = RoundPrompt(blocks, block_tokens, 100);
  first.resize(tokens);
  SPARSEKV_ASSIGN_OR_RETURN(SequenceId a, cache->CreateSequence());
  SPARSEKV_RETURN_IF_ERROR(cache->AppendTokens(a, first));
  SPARSEKV_RETURN_IF_ERROR(manager->AllocateSlots(a, tokens).status());
  SPARSEKV_RETURN_IF_ERROR(BlockTables(*manager, a, &tables));
  for (uint32_t b = 0; b < blocks; ++b) write_block(b);
  SPARSEKV_RETURN_IF_ERROR(cache->CommitComputed(a, tokens));
  SPARSEKV_RETURN_IF_ERROR(cache->Free(a));
  cache->WaitIdle();

  // Prompts 101, 102 and 103 each evict the previous one's blocks, one block at a time; only
  // 103 is counted. The first two touch the host tier's memory (1.5 L1s, so the third reuses
  // it: a first touch costs more than the copy on this VM) and the staging buffers.
  double allocate_s = 0, allocate_cpu_s = 0;
  uint64_t evicted = 0;
  OffloadedCacheStats before;
  for (int round : {101, 102, 103}) {
    std::vector<TokenId> prompt = RoundPrompt(blocks, block_tokens, round);
    prompt.resize(tokens);
    SPARSEKV_ASSIGN_OR_RETURN(SequenceId b, cache->CreateSequence());
    SPARSEKV_RETURN_IF_ERROR(cache->AppendTokens(b, prompt));
    SPARSEKV_RETURN_IF_ERROR(cache->AcquirePrefix(b).status());
    before = cache->Stats();
    const uint64_t evicted0 = manager->Stats().evicted_blocks;
    allocate_s = 0;
    allocate_cpu_s = 0;
    for (uint32_t k = 0; k < blocks; ++k) {
      const double t0 = NowSeconds();
      const double c0 = ThreadCpuSeconds();
      Status st = manager->AllocateSlots(b, uint64_t{k + 1} * block_tokens).status();
      allocate_cpu_s += ThreadCpuSeconds() - c0;
      allocate_s += NowSeconds() - t0;
      SPARSEKV_RETURN_IF_ERROR(st);
      SPARSEKV_RETURN_IF_ERROR(BlockTables(*manager, b, &tables));
      write_block(k);
      const double until = t0 + compute_s;
      while (NowSeconds() < until) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    SPARSEKV_RETURN_IF_ERROR(cache->CommitComputed(b, tokens));
    SPARSEKV_RETURN_IF_ERROR(cache->Free(b));
    cache->WaitIdle();
    evicted = manager->Stats().evicted_blocks - evicted0;
  }
  const OffloadedCacheStats st = cache->Stats();
  if (evicted == 0) return Status::Internal("restore bench: the eviction phase evicted nothing");
  if (st.demote_failures != 0 || st.demote_backlog_drops != 0) {
    return Status::IOError(fmt::format("restore bench: eviction phase: {} demote failures, {} backlog drops",
                                       st.demote_failures, st.demote_backlog_drops));
  }
  nlohmann::json j;
  j["evict_ahead_blocks"] = ahead;
  j["compute_seconds_per_block"] = compute_s;
  j["evicted_blocks"] = evicted;
  j["evicted_ahead"] = st.evicted_ahead - before.evicted_ahead;
  j["allocate_seconds"] = allocate_s;
  // The allocating thread's CPU time in AllocateSlots: without the time it was descheduled
  // (the demote and restore threads copy on the other cores) or asleep waiting for the lock.
  j["allocate_cpu_seconds"] = allocate_cpu_s;
  const double ahead_s = st.evict_ahead_seconds - before.evict_ahead_seconds;
  j["evict_ahead_seconds"] = ahead_s;
  j["lock_seconds_per_evicted_block"] = (allocate_s + ahead_s) / static_cast<double>(evicted);
  j["lock_cpu_seconds_per_evicted_block"] = (allocate_cpu_s + ahead_s) / static_cast<double>(evicted);
  return j;
}

}  // namespace

Result<nlohmann::json> RunRestoreBench(const RestoreBenchOptions& o) {
  if (o.tier != "host" && o.tier != "ssd")
    return Status::InvalidArgument("--tier must be host or ssd, not '" + o.tier + "'");
  if (o.tier == "ssd" && o.dir.empty())
    return Status::InvalidArgument("--dir is required for --tier ssd");
  if (o.blocks == 0 || o.blocks > kMaxBlocks) {
    return Status::InvalidArgument(
        fmt::format("--blocks {} is not in [1, {}]", o.blocks, kMaxBlocks));
  }
  if (o.rounds < 1) return Status::InvalidArgument("--rounds must be at least 1");
  if (o.block_tokens == 0) return Status::InvalidArgument("--block-tokens must be positive");
  if (o.with_fio && o.tier != "ssd")
    return Status::InvalidArgument("--with-fio applies to --tier ssd only");
  if (o.eviction_blocks != 0 && (o.eviction_blocks < 4 || o.eviction_blocks > kMaxBlocks)) {
    return Status::InvalidArgument(fmt::format(
        "--eviction-blocks {} is neither 0 (skip the phase) nor in [4, {}]", o.eviction_blocks, kMaxBlocks));
  }
  if (!(o.eviction_compute_us >= 0 && o.eviction_compute_us <= 1e6)) {
    return Status::InvalidArgument(
        fmt::format("--eviction-compute-us {} is not in [0, 1000000]", o.eviction_compute_us));
  }

  ModelSpec spec;
  if (o.spec.has_value()) {
    spec = *o.spec;
  } else {
    SPARSEKV_ASSIGN_OR_RETURN(KvPrecision precision, ParseKvPrecision(o.kv_format));
    SPARSEKV_ASSIGN_OR_RETURN(spec, ModelPreset(o.model, precision));
  }
  const uint32_t n = o.blocks;

  // Everything in `dir` lives under one directory of ours, removed at the end (after the tier,
  // declared below, has closed its files).
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<ScratchDir> scratch,
                            ScratchDir::Make(o.dir, "restore-bench"));
  const std::string& root = scratch->path();

  // L1: pages for the prompt (its last, partial block included) and a little slack.
  CacheManagerOptions mo;
  mo.block_tokens = o.block_tokens;
  mo.capacity_blocks = n + 1 + std::max<uint32_t>(2, n / 16);
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> manager, CacheManager::Create(spec, mo));
  const BlockGeometry& geo = manager->geometry();
  const size_t pools = manager->num_pools();
  std::vector<uint64_t> stride(pools), offset(pools);
  uint64_t block_bytes = 0;
  for (size_t p = 0; p < pools; ++p) {
    stride[p] = geo.pools[p].block_stride;
    offset[p] = block_bytes;
    block_bytes += stride[p];
  }
  if (block_bytes == 0) return Status::InvalidArgument("restore bench: the model's blocks are empty");
  // Fault the L1 arenas in, so that a restore's faults are its own (tier reads, buffers), not the
  // first touch of pages any engine would have touched long before.
  for (size_t p = 0; p < pools; ++p) {
    const PagePool& pool = manager->pool(p);
    for (PageId page = 0; page < pool.capacity(); ++page)
      std::memset(pool.PageData(page), 0, stride[p]);
  }
  std::vector<uint64_t> segments = stride;
  segments.push_back(sizeof(BlockDigest{}.check));  // the bundle's digest check (offloaded_cache.h)
  const uint64_t est_record_bytes = RoundUp4k(BundleRecordBytes(segments));

  // The one tier: N blocks and one spare; the host tier twice that, as a host tier is in
  // practice far larger than one store (a write-through store pins at most half of it while
  // the chain takes its blocks, OffloadedCache::CommitComputed).
  const uint64_t tier_bytes = (uint64_t{n} + 1) * est_record_bytes * (o.tier == "host" ? 2 : 1);
  std::vector<std::unique_ptr<Tier>> tiers;
  if (o.tier == "host") {
    HostTierOptions h;
    h.capacity_bytes = tier_bytes;
    h.max_record_bytes = est_record_bytes;
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> t, HostTier::Open(h));
    tiers.push_back(std::move(t));
  }
  // SSD with fio: fio's best read of a file as large as the restore's records first, so that the
  // tier reads in its block size with at least its bytes in flight.
  std::string fio_note;
  const std::string fio_file = root + "/fio.dat";
  const uint64_t fio_bytes = std::max<uint64_t>(kMiB, uint64_t{n} * est_record_bytes / kMiB * kMiB);
  std::optional<FioBest> fio_best;
  if (o.tier == "ssd" && o.with_fio) {
    Result<FioBest> best = FindFioBestRead(fio_file, fio_bytes, o.fio_block_bytes, o.fio_depth);
    if (best.ok()) {
      fio_best = *best;
    } else {
      fio_note = best.status().ToString();
    }
  }
  uint64_t tier_io_bytes = SsdTierOptions{}.io_bytes;
  uint32_t tier_depth = SsdTierOptions{}.queue_depth;
  if (fio_best) {
    tier_io_bytes = std::clamp<uint64_t>(fio_best->block_bytes, kDirectIoAlignment, 64 * kMiB);
    tier_depth = static_cast<uint32_t>(std::clamp<uint64_t>(
        std::max<uint64_t>(fio_best->depth, (16 * kMiB + tier_io_bytes - 1) / tier_io_bytes), 1, 256));
  }
  if (o.tier != "host") {
    SsdTierOptions s;
    s.path = root + "/ssd";
    s.io_bytes = tier_io_bytes;
    s.queue_depth = tier_depth;
    s.capacity_bytes = tier_bytes;
    s.max_record_bytes = std::max<uint64_t>(s.max_record_bytes, est_record_bytes);
    s.durability = o.durability;
    if (o.ssd_read_arena_bytes != 0) s.read_arena_bytes = o.ssd_read_arena_bytes;
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<SsdTier> t, SsdTier::Open(s));
    tiers.push_back(std::move(t));
  }
  auto [chain, cache] = ChainUnder(*manager, std::move(tiers), WritePolicy::kWriteThrough, 0);
  const OffloadedCacheOptions oco;  // its namespace names the bundles
  // Destroyed in reverse: the cache, the chain (closing the tier's files), the manager, then
  // `scratch` removes the directory.

  // The bytes every round stores: pseudo-random, block after block, each block its pools' pages
  // in pool order. Also memcpy's source.
  const uint64_t total = uint64_t{n} * block_bytes;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<TouchedBuffer> pattern, TouchedBuffer::Make(total));
  // memcpy's destination: a ring of at most 512 MiB, reused (a whole copy of a long prefix
  // would not fit beside it and L1).
  const uint64_t copy_ring = std::min<uint64_t>(total, 512 * kMiB);
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<TouchedBuffer> copy, TouchedBuffer::Make(copy_ring));
  {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    std::byte* d = pattern->data();
    uint64_t i = 0;
    for (; i + 8 <= total; i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(d + i, &x, 8);
    }
    for (; i < total; ++i) d[i] = std::byte(MixBits(i) & 0xff);
  }

  const double gb = static_cast<double>(total) / 1e9;
  RateSamples store_r, restore_r, memcpy_r, pread_r;
  std::vector<double> fio_rates;
  RateSamples restore_faults, store_faults, restore_cpu, store_cpu;
  uint64_t record_bytes = est_record_bytes;  // until the tier has held a round
  bool record_measured = false;
  uint64_t pread_bytes = 0;
  std::string tier_file;  // the tier's data file, once a round has stored into it
  auto run_fio = [&] {
    if (!fio_best || !fio_note.empty()) return;
    std::string cmd = FioJobCommand(fio_file, fio_bytes, fio_best->block_bytes, fio_best->depth, "read");
    if (o.fio_on_tier_file && !tier_file.empty() && pread_bytes != 0) {
      cmd = FioJobCommand(tier_file, std::max<uint64_t>(kMiB, RoundUp4k(pread_bytes) / kMiB * kMiB),
                          fio_best->block_bytes, fio_best->depth, "read") +
            " --readonly";
    }
    Result<double> r = RunFioJob(cmd, "read");
    if (r.ok()) {
      fio_rates.push_back(*r);
    } else {
      fio_note = r.status().ToString();
    }
  };
  std::vector<std::vector<PageId>> tables;
  uint64_t checked_pages = 0;
  // Round -1 (with warmup_round) is run in full and not counted: the tier's memory and files
  // are first touched there, not in the first measured store.
  for (int round = o.warmup_round ? -1 : 0; round < o.rounds; ++round) {
    const bool counted = round >= 0;
    const std::vector<TokenId> prompt = RoundPrompt(n, o.block_tokens, round);
    std::vector<BlockDigest> digests;
    manager->hasher().HashFullBlocks(manager->hasher().Root(""), prompt, "", &digests);
    if (digests.size() < n) return Status::Internal("restore bench: fewer digests than blocks");
    std::vector<BundleKey> keys;
    for (uint32_t b = 0; b < n; ++b) keys.push_back(BundleKey{oco.namespace_id, digests[b].hash});

    // 1. store: the engine's pages are written (untimed), then committed and demoted (timed).
    SPARSEKV_ASSIGN_OR_RETURN(SequenceId seq, cache->CreateSequence());
    SPARSEKV_RETURN_IF_ERROR(cache->AppendTokens(seq, prompt));
    SPARSEKV_ASSIGN_OR_RETURN(OffloadedPrefix first, cache->AcquirePrefix(seq));
    if (first.blocks != 0) {
      return Status::Internal(
          fmt::format("restore bench: round {}'s prompt was already cached ({} blocks)", round,
                      first.blocks));
    }
    SPARSEKV_RETURN_IF_ERROR(manager->AllocateSlots(seq, prompt.size()).status());
    SPARSEKV_RETURN_IF_ERROR(BlockTables(*manager, seq, &tables));
    for (size_t p = 0; p < pools; ++p) {
      if (tables[p].size() < n) return Status::Internal("restore bench: short block table");
      for (uint32_t b = 0; b < n; ++b) {
        if (tables[p][b] == kInvalidPage) continue;
        std::memcpy(manager->pool(p).PageData(tables[p][b]),
                    pattern->data() + uint64_t{b} * block_bytes + offset[p], stride[p]);
      }
    }
    const OffloadedCacheStats s0 = cache->Stats();
    Status commit = Status::OK();
    const Timed store = Measure([&] {
      commit = cache->CommitComputed(seq, prompt.size());
      cache->WaitIdle();
    });
    SPARSEKV_RETURN_IF_ERROR(commit);
    const OffloadedCacheStats s1 = cache->Stats();
    if (s1.demoted_blocks - s0.demoted_blocks != n || s1.demote_failures != s0.demote_failures) {
      return Status::IOError(fmt::format(
          "restore bench: the {} tier kept {} of {} blocks ({} demote failures); first tier "
          "stats: {} put failures, {} evictions, {} io errors",
          o.tier, s1.demoted_blocks - s0.demoted_blocks - (s1.demote_failures - s0.demote_failures),
          n, s1.demote_failures - s0.demote_failures, chain->tier(0).Stats().put_failures,
          chain->tier(0).Stats().evictions, chain->tier(0).Stats().io_errors));
    }
    if (!record_measured) {
      const TierStats ts = chain->tier(0).Stats();
      if (ts.items > 0) record_bytes = ts.bytes / ts.items;
      record_measured = true;
    }
    if (counted) {
      store_r.rates.push_back(static_cast<double>(total) / store.seconds);
      store_faults.rates.push_back(static_cast<double>(store.faults) / n);
      store_cpu.rates.push_back(store.cpu_s / gb);
    }

    // 2. restore: L1 forgets the blocks (their pages overwritten first, so that stale bytes
    // cannot pass the check), then a new sequence with the same prompt takes them from the tier.
    for (size_t p = 0; p < pools; ++p) {
      for (uint32_t b = 0; b < n; ++b) {
        if (tables[p][b] != kInvalidPage)
          std::memset(manager->pool(p).PageData(tables[p][b]), 0x5a, stride[p]);
      }
    }
    SPARSEKV_RETURN_IF_ERROR(cache->Free(seq));
    SPARSEKV_RETURN_IF_ERROR(manager->Reset());
    SPARSEKV_ASSIGN_OR_RETURN(seq, cache->CreateSequence());
    SPARSEKV_RETURN_IF_ERROR(cache->AppendTokens(seq, prompt));
    const uint64_t read0 = chain->tier(0).Stats().bytes_read;
    if (o.tier == "ssd" && tier_file.empty()) {
      Result<SsdRecordLocation> loc = static_cast<SsdTier&>(chain->tier(0)).Locate(keys[0]);
      if (loc.ok()) tier_file = loc->file;
    }
    if (counted) run_fio();  // fio, restore, fio, restore, ..., fio
    Result<OffloadedPrefix> hit = Status::Internal("not run");
    const Timed restore = Measure([&] { hit = cache->AcquirePrefix(seq); });
    SPARSEKV_RETURN_IF_ERROR(hit.status());
    cache->WaitIdle();
    if (hit->l1_blocks != 0 || hit->lower_blocks != n) {
      const OffloadedCacheStats cs = cache->Stats();
      return Status::Internal(fmt::format(
          "restore bench: restored {} of {} blocks ({} found in L1; {} rejected, {} without room)",
          hit->lower_blocks, n, hit->l1_blocks, cs.restore_rejected, cs.restore_no_room));
    }
    if (pread_bytes == 0) pread_bytes = chain->tier(0).Stats().bytes_read - read0;
    // Every page the restored sequence holds (a sliding-window or snapshot pool keeps only the
    // last blocks' pages: the others are kInvalidPage).
    SPARSEKV_RETURN_IF_ERROR(BlockTables(*manager, seq, &tables));
    for (size_t p = 0; p < pools; ++p) {
      for (uint32_t b = 0; b < n && b < tables[p].size(); ++b) {
        if (tables[p][b] == kInvalidPage) continue;
        ++checked_pages;
        if (std::memcmp(manager->pool(p).PageData(tables[p][b]),
                        pattern->data() + uint64_t{b} * block_bytes + offset[p], stride[p]) != 0) {
          return Status::Corruption(fmt::format(
              "restore bench: block {} of pool {} ({}) differs after the restore", b, p,
              CacheKindName(geo.pools[p].spec.kind)));
        }
      }
    }
    if (checked_pages == 0) return Status::Internal("restore bench: no restored page to check");
    if (counted) {
      restore_r.rates.push_back(static_cast<double>(total) / restore.seconds);
      restore_faults.rates.push_back(static_cast<double>(restore.faults) / n);
      restore_cpu.rates.push_back(restore.cpu_s / gb);
    }
    SPARSEKV_RETURN_IF_ERROR(cache->Free(seq));
    SPARSEKV_RETURN_IF_ERROR(manager->Reset());

    // 3. memcpy of the same bytes, one thread, between prefaulted buffers.
    const Timed mc = Measure([&] {
      for (uint64_t at = 0; at < total; at += copy_ring)
        std::memcpy(copy->data(), pattern->data() + at, std::min(copy_ring, total - at));
    });
    DoNotOptimize(copy->data()[copy_ring - 1]);
    if (counted) memcpy_r.rates.push_back(static_cast<double>(total) / mc.seconds);

    // 4. ssd: the tier's data file read back plainly, and fio.
    if (o.tier == "ssd" && counted) {
      auto& ssd = static_cast<SsdTier&>(chain->tier(0));
      SPARSEKV_ASSIGN_OR_RETURN(SsdRecordLocation loc, ssd.Locate(keys[0]));
      std::error_code ec;
      const uint64_t file_bytes = std::filesystem::file_size(loc.file, ec);
      if (ec) {
        return Status::IOError(
            fmt::format("restore bench: size of {}: {}", loc.file, ec.message()));
      }
      const uint64_t want =
          std::min(file_bytes, RoundUp4k(pread_bytes ? pread_bytes : uint64_t{n} * record_bytes)) /
          kDirectIoAlignment * kDirectIoAlignment;
      if (want == 0) return Status::Internal("restore bench: the tier's data file is empty");
      SPARSEKV_ASSIGN_OR_RETURN(double secs, PreadFile(loc.file, want));
      pread_r.rates.push_back(static_cast<double>(want) / secs);
    }

    // The next round's blocks must find room: this round's leave the tier.
    std::vector<Status> erased = chain->Erase(keys).get();
    for (const Status& s : erased) SPARSEKV_RETURN_IF_ERROR(s);
  }
  if (o.fio_on_tier_file) {
    // The closing run reads the last round's bytes, stored again (they were erased).
    SequenceId seq = 0;
    const std::vector<TokenId> prompt = RoundPrompt(n, o.block_tokens, o.rounds);
    SPARSEKV_ASSIGN_OR_RETURN(seq, cache->CreateSequence());
    SPARSEKV_RETURN_IF_ERROR(cache->AppendTokens(seq, prompt));
    SPARSEKV_RETURN_IF_ERROR(cache->AcquirePrefix(seq).status());
    SPARSEKV_RETURN_IF_ERROR(manager->AllocateSlots(seq, prompt.size()).status());
    SPARSEKV_RETURN_IF_ERROR(cache->CommitComputed(seq, prompt.size()));
    cache->WaitIdle();
    SPARSEKV_RETURN_IF_ERROR(cache->Free(seq));
    SPARSEKV_RETURN_IF_ERROR(manager->Reset());
  }
  run_fio();  // the closing fio run
  if (o.with_fio) {
    std::error_code ec;
    std::filesystem::remove(fio_file, ec);
  }

  // Write-back eviction (host tier), with and without evicting ahead: the time under the
  // manager's lock per evicted block against a memcpy of one block.
  nlohmann::json eviction;
  if (o.eviction_blocks > 0) {
    const double memcpy_block_s = static_cast<double>(block_bytes) / memcpy_r.Median();
    for (uint32_t ahead : {0u, OffloadedCacheOptions{}.evict_ahead_blocks}) {
      SPARSEKV_ASSIGN_OR_RETURN(nlohmann::json e,
                                MeasureWriteBackEviction(spec, o.block_tokens, o.eviction_blocks, ahead,
                                                         o.eviction_compute_us * 1e-6, pattern->data(), n));
      e["lock_time_vs_memcpy"] = e["lock_seconds_per_evicted_block"].get<double>() / memcpy_block_s;
      e["lock_cpu_time_vs_memcpy"] = e["lock_cpu_seconds_per_evicted_block"].get<double>() / memcpy_block_s;
      eviction[ahead == 0 ? "hook" : "evict_ahead"] = e;
    }
    eviction["memcpy_seconds_per_block"] = memcpy_block_s;
    eviction["l1_blocks"] = o.eviction_blocks;
  }

  nlohmann::json j;
  j["model"] = spec.name;
  j["kv_format"] = o.spec.has_value() && o.kv_format.empty() ? "spec" : o.kv_format;
  j["block_tokens"] = o.block_tokens;
  j["blocks"] = n;
  j["pools"] = pools;
  j["block_bytes"] = block_bytes;
  j["record_bytes"] = record_bytes;
  j["data_bytes"] = total;
  j["tier"] = o.tier;
  j["rounds"] = o.rounds;
  j["warmup_round"] = o.warmup_round;
  j["write_policy"] = "write-through";
  j["checked_pages"] = checked_pages;  // restored pages compared with what was stored, every round
  j["store_bytes_per_s"] = store_r.Median();
  j["restore_bytes_per_s"] = restore_r.Median();
  j["memcpy_bytes_per_s"] = memcpy_r.Median();
  j["restore_vs_memcpy"] = restore_r.Median() / memcpy_r.Median();
  j["restore_time_vs_memcpy"] = memcpy_r.Median() / restore_r.Median();
  j["store_time_vs_memcpy"] = memcpy_r.Median() / store_r.Median();
  j["faults_per_block"] = restore_faults.Median();
  j["store_faults_per_block"] = store_faults.Median();
  j["restore_cpu_s_per_gb"] = restore_cpu.Median();
  j["store_cpu_s_per_gb"] = store_cpu.Median();
  nlohmann::json samples;
  samples["store"] = store_r.ToJson();
  samples["restore"] = restore_r.ToJson();
  samples["memcpy"] = memcpy_r.ToJson();
  samples["faults_per_block"] = restore_faults.ToJson();
  if (o.tier == "ssd") {
    j["durability"] = std::string(DurabilityName(o.durability));
    j["read_arena_bytes"] =
        o.ssd_read_arena_bytes ? o.ssd_read_arena_bytes : SsdTierOptions{}.read_arena_bytes;
    j["pread_bytes"] = pread_bytes;
    j["pread_bytes_per_s"] = pread_r.Median();
    j["restore_vs_pread"] = restore_r.Median() / pread_r.Median();
    samples["pread"] = pread_r.ToJson();
  } else {
    j["pread_bytes_per_s"] = nullptr;
  }
  if (o.tier == "ssd") {
    const SsdTierDetails d = static_cast<SsdTier&>(chain->tier(0)).Details();
    j["tier_io_bytes"] = tier_io_bytes;
    j["tier_queue_depth"] = tier_depth;
    j["tier_read_groups"] = d.read_groups;
    j["tier_coalesced_records"] = d.coalesced_records;
  }
  if (o.with_fio) {
    if (!fio_note.empty()) {
      j["fio_error"] = fio_note;
    } else {
      j["fio_best_bs"] = fio_best->block_bytes;
      j["fio_best_iodepth"] = fio_best->depth;
      j["fio_swept"] = fio_best->swept;
      j["fio_sweep"] = fio_best->sweep;
      RateSamples fio_r;
      fio_r.rates = fio_rates;
      j["fio_read_bytes_per_s"] = fio_r.Median();
      const nlohmann::json ratios = InterleavedFioRatios(restore_r.rates, fio_rates);
      j["restore_vs_fio"] = ratios;
      j["restore_vs_fio_best"] =
          ratios.contains("median_vs_fio_around") ? ratios["median_vs_fio_around"] : ratios["median_vs_fio_before"];
      j["fio_command"] = o.fio_on_tier_file
                             ? FioJobCommand("DIR/ssd/data.dat", RoundUp4k(pread_bytes) / kMiB * kMiB,
                                             fio_best->block_bytes, fio_best->depth, "read") + " --readonly"
                             : FioJobCommand("DIR/fio.dat", fio_bytes, fio_best->block_bytes, fio_best->depth, "read");
      j["fio_on_tier_file"] = o.fio_on_tier_file;
      samples["fio_read"] = fio_r.ToJson();
    }
  }
  j["samples"] = samples;
  if (!eviction.is_null()) {
    j["write_back_eviction"] = eviction;
    j["evict_lock_time_vs_memcpy"] = eviction["evict_ahead"]["lock_time_vs_memcpy"];
  }
  j["note"] =
      "rates are blocks * block_bytes per second (pread and fio: bytes read); store = "
      "CommitComputed + WaitIdle (write-through: gather, checksum, tier put); restore = "
      "AcquirePrefix after manager.Reset() (tier read, check, copy into fresh L1 pages, commit), "
      "checked byte for byte outside the timing; memcpy = one thread between prefaulted buffers; "
      "pread = O_DIRECT, 1 MiB, queue depth 1 over the tier's data file; faults and CPU are the "
      "whole process's (every thread), from getrusage; medians of interleaved rounds";
  return j;
}

}  // namespace sparsekv::bench
