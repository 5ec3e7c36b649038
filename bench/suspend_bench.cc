#include "suspend_bench.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>

#include "bench_util.h"
#include "progress.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/request_log.h"
#include "sparsekv/ssd_tier.h"

namespace sparsekv::bench {
namespace {

constexpr uint32_t kBlockTokens = 128;
constexpr uint64_t kMiB = 1ull << 20;

uint64_t MemAvailable() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoull(line.substr(13)) * 1024;
  }
  return 0;
}

std::vector<TokenId> Tokens(uint64_t n, uint64_t seed) {
  std::vector<TokenId> t(n);
  for (uint64_t i = 0; i < n; ++i) t[i] = static_cast<TokenId>(MixBits(seed * 1000003 + i) % 50000);
  return t;
}

// Window and compressor-state pages a sequence holds at once: those of the block being computed
// and the one before (the rest are released as they leave the window, and a resume from history
// records allocates only the tail's).
constexpr uint32_t kBoundaryBlocks = 4;

Result<std::unique_ptr<CacheManager>> Manager(const ModelSpec& spec, uint32_t blocks) {
  CacheManagerOptions mo;
  mo.block_tokens = kBlockTokens;
  mo.capacity_blocks = blocks;
  mo.window_capacity_blocks = std::min(blocks, kBoundaryBlocks);
  mo.state_capacity_blocks = std::min(blocks, kBoundaryBlocks);
  mo.huge_pages = true;
  return CacheManager::Create(spec, mo);
}

// Computes tokens [from, to) of `seq` the cheap way, a block at a time as an engine does (so the
// window and state pages leave the sequence as they fall behind): every new page filled with a
// pattern, then `commit`.
Status Fill(CacheManager& m, SequenceId seq, uint64_t from, uint64_t to,
            const std::function<Status(SequenceId, uint64_t)>& commit) {
  std::vector<PageId> table;
  for (uint64_t t = from; t < to;) {
    const uint64_t next = std::min(to, (t / kBlockTokens + 1) * kBlockTokens);
    SPARSEKV_ASSIGN_OR_RETURN(SlotAllocation a, m.AllocateSlots(seq, next));
    (void)a;
    const uint64_t b = t / kBlockTokens;
    for (size_t p = 0; p < m.num_pools(); ++p) {
      SPARSEKV_RETURN_IF_ERROR(m.GetBlockTable(seq, p, &table));
      if (b >= table.size() || table[b] == kInvalidPage) continue;
      std::memset(m.pool(p).PageData(table[b]), static_cast<int>((b * 31 + p) & 0xff), m.geometry().pools[p].block_stride);
    }
    SPARSEKV_RETURN_IF_ERROR(commit(seq, next));
    t = next;
  }
  return Status::OK();
}

// memcpy of every page of the sequence's blocks into a reused 512 MiB destination: the bytes
// a suspend or resume moves, at memory speed. Returns bytes per second.
double MemcpyRate(const CacheManager& m, SequenceId seq, uint32_t blocks) {
  static std::vector<std::byte> dst;
  const uint64_t ring = 512 * kMiB;
  if (dst.size() != ring) {
    dst.assign(ring, std::byte{0});
  }
  std::vector<std::vector<PageId>> tables(m.num_pools());
  for (size_t p = 0; p < tables.size(); ++p) (void)m.GetBlockTable(seq, p, &tables[p]);
  uint64_t at = 0, bytes = 0;
  const double t0 = NowSeconds();
  for (uint32_t b = 0; b < blocks; ++b) {
    for (size_t p = 0; p < tables.size(); ++p) {
      if (b >= tables[p].size() || tables[p][b] == kInvalidPage) continue;
      const uint64_t n = m.geometry().pools[p].block_stride;
      if (at + n > ring) at = 0;
      std::memcpy(dst.data() + at, m.pool(p).PageData(tables[p][b]), n);
      at += n;
      bytes += n;
    }
  }
  DoNotOptimize(dst[at / 2]);
  return static_cast<double>(bytes) / (NowSeconds() - t0);
}

// Record bytes of one block: whole, or (history) its full-history kinds only, as Suspend writes
// V4's blocks.
uint64_t BlockRecordBytes(const CacheManager& m, bool history = false) {
  std::vector<uint64_t> sizes;
  for (const auto& p : m.geometry().pools)
    sizes.push_back(history && !IsFullHistoryKind(p.spec.kind) ? 0 : p.block_stride);
  sizes.push_back(16);
  return BundleRecordBytes(sizes);
}

// Bytes of one block's full-history pools: what a sequence's blocks cost in L1 and in the tiers.
uint64_t HistoryBytesPerBlock(const BlockGeometry& geo) {
  uint64_t n = 0;
  for (const PoolGeometry& g : geo.pools) n += IsFullHistoryKind(g.spec.kind) ? g.block_stride : 0;
  return n;
}

// The SSD tier's I/O: blocks of `io_bytes`, `depth` deep (0: the defaults for the record size).
struct SsdIo {
  uint64_t io_bytes = 0;
  uint32_t depth = 0;
};

Result<std::unique_ptr<TierChain>> Chain(bool ssd, const std::string& dir, uint64_t bytes, bool populate = true,
                                         uint64_t record_bytes = 1ull << 20, SsdIo io = {}) {
  std::vector<std::unique_ptr<Tier>> tiers;
  if (!ssd) {
    HostTierOptions h;
    h.capacity_bytes = (bytes + 64 * kMiB) / 4096 * 4096;
    h.huge_pages = true;
    h.populate = populate;  // a serving tier is warm: its pages were zeroed long ago
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> t, HostTier::Open(h));
    tiers.push_back(std::move(t));
  } else {
    SsdTierOptions d;
    d.path = dir;
    d.capacity_bytes = bytes + 256 * kMiB;
    d.durability = Durability::kFdatasync;
    // As many bytes in flight as fio's baseline (1 MiB I/Os, 16 deep): a V4 history record is
    // 0.5 MB, one I/O each.
    d.queue_depth = static_cast<uint32_t>(std::clamp<uint64_t>(16 * kMiB / std::max<uint64_t>(record_bytes, 1), 16, 64));
    // Matched to fio's best: I/Os of its block size, at least its bytes in flight (and 16 MiB).
    if (io.io_bytes != 0) d.io_bytes = io.io_bytes;
    if (io.depth != 0) d.queue_depth = io.depth;
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<SsdTier> t, SsdTier::Open(d));
    tiers.push_back(std::move(t));
  }
  TierChainOptions co;
  co.write_policy = WritePolicy::kWriteThrough;
  return std::make_unique<TierChain>(std::move(tiers), co);
}

// Part 1 for one model and tier.
Result<nlohmann::json> SuspendResume(const std::string& name, const ModelSpec& spec, uint64_t tokens, bool ssd,
                                     const std::string& dir, bool with_fio, bool cold_host, const SuspendBenchOptions& o) {
  const uint64_t state = tokens - 5;  // five tokens short of the last block's end: a tail
  const auto blocks = static_cast<uint32_t>((tokens + kBlockTokens - 1) / kBlockTokens);
  const std::vector<TokenId> ids = Tokens(tokens, 1);
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> m, Manager(spec, blocks + 2));
  const uint64_t record = BlockRecordBytes(*m, /*history=*/true);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
  const uint64_t tail = BlockRecordBytes(*m) * 2;  // at most a block's pages and a window page more
  // SSD: fio first, on a file of the sequence's size: its write rate, then its best read (a sweep
  // unless given), whose block size and depth the tier then uses.
  const std::string fio_file = dir + "/fio.dat";
  const uint64_t fio_bytes = std::max<uint64_t>(kMiB, uint64_t{blocks} * record / kMiB * kMiB);
  nlohmann::json fio_j;
  SsdIo io;
  std::optional<FioBest> fio_best;
  if (ssd && with_fio) {
    Result<double> w = RunFioJob(FioJobCommand(fio_file, fio_bytes, kMiB, 16, "write"), "write");
    Result<FioBest> best = w.ok() ? FindFioBestRead(fio_file, fio_bytes, o.fio_block_bytes, o.fio_depth) : w.status();
    if (!best.ok()) {
      fio_j["fio_error"] = best.status().ToString();
    } else {
      fio_j["fio_write_bytes_per_s"] = *w;
      fio_j["fio_best_bs"] = best->block_bytes;
      fio_j["fio_best_iodepth"] = best->depth;
      fio_j["fio_swept"] = best->swept;
      fio_j["fio_sweep"] = best->sweep;
      fio_best = *best;
      io.io_bytes = std::clamp<uint64_t>(best->block_bytes, 4096, 64 * kMiB);
      io.depth = static_cast<uint32_t>(std::clamp<uint64_t>(
          std::max<uint64_t>(best->depth, (16 * kMiB + io.io_bytes - 1) / io.io_bytes), 1, 256));
    }
  }
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<TierChain> chain,
                            Chain(ssd, dir, uint64_t{blocks} * (record + 4096) + tail, !cold_host, record, io));
  OffloadedCacheOptions co;
  co.write_policy = WritePolicy::kWriteBack;  // nothing reaches the tier before the suspend
  co.evict_ahead_blocks = 0;
  // V4's window and state pages leave L1 as the sequence grows; whole demotes of those blocks
  // (15.6 MB each) are prefix caching's business, not a suspend's.
  co.demote_on_boundary_eviction = false;
  nlohmann::json j;
  j["model"] = name;
  j["tier"] = ssd ? "ssd" : "host";
  if (!ssd) j["host_tier_populated"] = !cold_host;
  j["tokens"] = tokens;
  j["state_tokens"] = state;
  SuspendInfo info;
  double memcpy_before = 0;
  {
    OffloadedCache cache(*m, *chain, co);
    SPARSEKV_ASSIGN_OR_RETURN(SequenceId seq, cache.CreateSequence());
    SPARSEKV_RETURN_IF_ERROR(cache.AppendTokens(seq, std::span<const TokenId>(ids).first(state + 1)));
    SPARSEKV_RETURN_IF_ERROR(
        Fill(*m, seq, 0, state, [&](SequenceId q, uint64_t n) { return cache.CommitComputed(q, n); }));
    memcpy_before = MemcpyRate(*m, seq, blocks);
    const double t0 = NowSeconds();
    SPARSEKV_ASSIGN_OR_RETURN(info, cache.Suspend(seq));
    const double secs = NowSeconds() - t0;
    j["suspend_seconds"] = secs;
    j["suspend_bytes"] = info.written_bytes;
    j["suspend_bytes_per_s"] = static_cast<double>(info.written_bytes) / secs;
    j["tail_bytes"] = info.tail_bytes;
    j["history_blocks"] = info.history_blocks;
  }
  // Resumes, each into another L1, warm as a serving engine's is (its pages touched). SSD with
  // fio: fio, resume, fio, resume, ..., fio, so that each resume has fio runs on both sides.
  const int rounds = ssd && fio_best ? std::max(1, o.rounds) : 1;
  std::vector<double> resume_rates, fio_rates;
  double memcpy_after = 0;
  const std::string fio_cmd =
      fio_best ? FioJobCommand(fio_file, fio_bytes, fio_best->block_bytes, fio_best->depth, "read") : "";
  auto run_fio = [&]() -> Status {
    SPARSEKV_ASSIGN_OR_RETURN(double r, RunFioJob(fio_cmd, "read"));
    fio_rates.push_back(r);
    return Status::OK();
  };
  Status fio_status;
  for (int round = 0; round < rounds; ++round) {
    if (fio_best && fio_status.ok()) fio_status = run_fio();
    m.reset();
    SPARSEKV_ASSIGN_OR_RETURN(m, Manager(spec, blocks + 2));
    for (size_t p = 0; p < m->num_pools(); ++p) {
      std::memset(m->pool(p).arena_base(), 0, uint64_t{m->pool(p).capacity()} * m->geometry().pools[p].block_stride);
    }
    OffloadedCache cache(*m, *chain, co);
    const double t0 = NowSeconds();
    SPARSEKV_ASSIGN_OR_RETURN(ResumeInfo r, cache.Resume({}, std::span<const TokenId>(ids).first(state + 1), state));
    const double secs = NowSeconds() - t0;
    if (r.restored_tokens != state) {
      return Status::Internal(fmt::format("bench suspend: {} resumed {} of {} tokens: {}", name, r.restored_tokens,
                                          state, r.lost));
    }
    resume_rates.push_back(static_cast<double>(info.written_bytes) / secs);
    if (round == 0) memcpy_after = MemcpyRate(*m, r.seq, blocks);
    SPARSEKV_RETURN_IF_ERROR(cache.Free(r.seq));
  }
  if (fio_best && fio_status.ok()) fio_status = run_fio();
  {
    std::vector<double> sorted = resume_rates;
    std::sort(sorted.begin(), sorted.end());
    j["resume_bytes_per_s"] = sorted[sorted.size() / 2];  // the median
    j["resume_seconds"] = static_cast<double>(info.written_bytes) / j["resume_bytes_per_s"].get<double>();
    j["resume_rounds_bytes_per_s"] = resume_rates;
    const double mc = std::max(memcpy_before, memcpy_after);
    j["memcpy_bytes_per_s"] = {memcpy_before, memcpy_after};
    if (!ssd) {
      j["suspend_vs_memcpy"] = j["suspend_bytes_per_s"].get<double>() / mc;
      j["resume_vs_memcpy"] = j["resume_bytes_per_s"].get<double>() / mc;
    }
  }
  if (ssd) {
    const SsdTierDetails d = static_cast<SsdTier&>(chain->tier(0)).Details();
    j["tier_io_bytes"] = io.io_bytes ? io.io_bytes : SsdTierOptions{}.io_bytes;
    j["tier_read_groups"] = d.read_groups;
    j["tier_coalesced_records"] = d.coalesced_records;
  }
  if (ssd && with_fio) {
    for (auto& [k, v] : fio_j.items()) j[k] = v;
    if (!fio_status.ok()) {
      j["fio_error"] = fio_status.ToString();
    } else if (fio_best) {
      j["tier_queue_depth"] = io.depth;
      const nlohmann::json ratios = InterleavedFioRatios(resume_rates, fio_rates);
      j["resume_vs_fio"] = ratios;
      std::vector<double> sorted = fio_rates;
      std::sort(sorted.begin(), sorted.end());
      j["fio_read_bytes_per_s"] = sorted[sorted.size() / 2];
      j["resume_vs_fio_read"] = ratios.contains("median_vs_fio_around") ? ratios["median_vs_fio_around"]
                                                                          : ratios["median_vs_fio_before"];
      j["suspend_vs_fio_write"] = j["suspend_bytes_per_s"].get<double>() / j["fio_write_bytes_per_s"].get<double>();
      j["fio_command"] = FioJobCommand("DIR/fio.dat", fio_bytes, fio_best->block_bytes, fio_best->depth, "read");
    }
    std::filesystem::remove(fio_file, ec);
  }
  chain.reset();
  std::filesystem::remove_all(dir, ec);
  return j;
}

// Part 2: a conversation suspended after every turn.
Result<nlohmann::json> Conversation(const ModelSpec& spec, uint32_t turns, uint32_t turn_tokens, const std::string& dir,
                                    WritePolicy policy) {
  const uint64_t total = uint64_t{turns} * turn_tokens + 1;
  const auto blocks = static_cast<uint32_t>(total / kBlockTokens + 2);
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> m, Manager(spec, blocks + 2));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
  const uint64_t record = BlockRecordBytes(*m);
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<TierChain> chain, Chain(true, dir, uint64_t{blocks + turns} * (record + 8192) * 2));
  // Write-back: the blocks reach the tier through Suspend alone (L1 holds the conversation), as
  // history records. Write-through: every block is stored whole as it fills, a prefix hit at
  // each of its edges, and Suspend adds the tails.
  OffloadedCacheOptions co;
  co.write_policy = policy;
  co.evict_ahead_blocks = 0;
  co.demote_on_boundary_eviction = false;
  OffloadedCache cache(*m, *chain, co);
  const std::vector<TokenId> ids = Tokens(total, 2);
  // A whole snapshot's least: the full-history kinds of every token, one window, one state.
  uint64_t history_per_block = 0, boundary_pages = 0;
  for (const PoolGeometry& g : m->geometry().pools) {
    if (g.spec.kind == CacheKind::kSwaWindow || g.spec.kind == CacheKind::kCompressorState) {
      boundary_pages += g.block_stride;
    } else {
      history_per_block += g.block_stride;
    }
  }
  uint64_t snapshots = 0, written = 0;
  std::optional<BlockHash> previous;
  uint64_t state = 0;
  for (uint32_t turn = 0; turn < turns; ++turn) {
    const uint64_t upto = uint64_t{turn + 1} * turn_tokens;
    SPARSEKV_ASSIGN_OR_RETURN(ResumeInfo r, cache.Resume({}, std::span<const TokenId>(ids).first(upto + 1), state));
    if (r.recompute_tokens != 0) return Status::Internal("bench suspend: a turn resumed short: " + r.lost);
    SPARSEKV_RETURN_IF_ERROR(
        Fill(*m, r.seq, state, upto, [&](SequenceId q, uint64_t n) { return cache.CommitComputed(q, n); }));
    SPARSEKV_ASSIGN_OR_RETURN(SuspendInfo s, cache.Suspend(r.seq));
    if (previous) SPARSEKV_RETURN_IF_ERROR(cache.DropSuspension(*previous));
    previous = s.tail;
    state = upto;
    written += s.written_bytes;
    snapshots += (upto + kBlockTokens - 1) / kBlockTokens * history_per_block + boundary_pages;
  }
  cache.WaitIdle();
  const TierStats ts = chain->tier(0).Stats();
  uint64_t on_disk = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir, ec)) {
    struct stat st{};
    if (f.is_regular_file() && ::stat(f.path().c_str(), &st) == 0) on_disk += uint64_t(st.st_blocks) * 512;
  }
  nlohmann::json j;
  j["write_policy"] = policy == WritePolicy::kWriteBack ? "write-back" : "write-through";
  j["turns"] = turns;
  j["turn_tokens"] = turn_tokens;
  j["tier_bytes"] = ts.bytes;
  j["tier_items"] = ts.items;
  j["disk_bytes_allocated"] = on_disk;
  j["whole_snapshots_bytes"] = snapshots;
  j["ratio_vs_whole_snapshots"] = static_cast<double>(ts.bytes) / static_cast<double>(snapshots);
  j["block_record_bytes"] = record;
  j["history_record_bytes"] = BlockRecordBytes(*m, /*history=*/true);
  j["boundary_bytes_per_block"] = boundary_pages;
  j["history_bytes_per_block"] = history_per_block;
  return j;
}

// Part 3: request log appends at a given concurrency.
Result<nlohmann::json> LogRate(const std::string& dir, uint32_t concurrency, double seconds) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  RequestLogOptions lo;
  lo.path = dir;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RequestLog> log, RequestLog::Open(lo));
  std::mutex mu;
  std::condition_variable cv;
  uint64_t outstanding = 0;
  Status failure;
  std::vector<double> latencies;
  latencies.reserve(1 << 20);
  const double end = NowSeconds() + seconds;
  std::vector<uint64_t> next(concurrency, 0);
  std::function<void(uint32_t)> issue = [&](uint32_t r) {
    const int32_t tok = static_cast<int32_t>(next[r] % 50000);
    const double t0 = NowSeconds();
    log->AppendAsync(r, next[r], std::span<const int32_t>(&tok, 1), [&, r, t0](Status st) {
      const double now = NowSeconds();
      bool again = false;
      {
        std::lock_guard l(mu);
        if (!st.ok() && failure.ok()) failure = st;
        latencies.push_back(now - t0);
        ++next[r];
        again = st.ok() && now < end;
        if (!again) --outstanding;
      }
      if (again) {
        issue(r);
      } else {
        cv.notify_all();
      }
    });
  };
  const double t0 = NowSeconds();
  {
    std::lock_guard l(mu);
    outstanding = concurrency;
  }
  for (uint32_t r = 0; r < concurrency; ++r) issue(r);
  std::unique_lock l(mu);
  cv.wait(l, [&] { return outstanding == 0; });
  const double secs = NowSeconds() - t0;
  if (!failure.ok()) return failure;
  const RequestLogStats st = log->Stats();
  nlohmann::json j;
  j["concurrency"] = concurrency;
  j["appends"] = latencies.size();
  j["appends_per_s"] = static_cast<double>(latencies.size()) / secs;
  j["syncs"] = st.syncs;
  j["appends_per_sync"] = st.syncs ? static_cast<double>(st.appends) / static_cast<double>(st.syncs) : 0.0;
  j["p50_ms"] = QuantileInPlace(latencies, 0.5) * 1e3;
  j["p99_ms"] = QuantileInPlace(latencies, 0.99) * 1e3;
  l.unlock();
  log.reset();
  std::filesystem::remove_all(dir, ec);
  return j;
}

}  // namespace

Result<nlohmann::json> RunSuspendBench(const SuspendBenchOptions& o) {
  if (o.dir.empty()) return Status::InvalidArgument("bench suspend: --dir is required");
  if (o.v32_tokens < kBlockTokens || o.v4_tokens < kBlockTokens)
    return Status::InvalidArgument(fmt::format("bench suspend: sequences of at least {} tokens", kBlockTokens));
  if (o.turns == 0 || o.turn_tokens == 0) return Status::InvalidArgument("bench suspend: --turns and --turn-tokens must be positive");
  if (o.rounds < 1 || o.rounds > 100) return Status::InvalidArgument("bench suspend: --rounds must be from 1 to 100");
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<ScratchDir> scratch, ScratchDir::Make(o.dir, "suspend"));
  const std::string root = scratch->path();
  const uint64_t budget = o.max_bytes ? o.max_bytes : MemAvailable() / 10 * 6;
  nlohmann::json out;
  out["max_bytes"] = budget;
  nlohmann::json runs = nlohmann::json::array();
  struct Model {
    std::string name;
    uint64_t tokens;
  };
  for (const Model& mdl : {Model{"deepseek-v3.2-exp", o.v32_tokens}, Model{"deepseek-v4-flash", o.v4_tokens}}) {
    SPARSEKV_ASSIGN_OR_RETURN(ModelSpec spec, ModelPreset(mdl.name, KvPrecision::kFp8));
    SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry geo, ComputeBlockGeometry(spec, kBlockTokens));
    // A suspended sequence's blocks hold their full-history kinds (its window and state: a few
    // blocks' worth in L1, one tail in the tier).
    const uint64_t per_block = HistoryBytesPerBlock(geo) + 4096;
    // L1 and the host tier hold the sequence at once (the SSD run: L1 and the tier's staging).
    const uint64_t fits = budget / 2 / per_block * kBlockTokens;
    uint64_t tokens = mdl.tokens;
    nlohmann::json cut;
    if (tokens > fits) {
      cut = {{"asked_tokens", tokens}, {"bytes_asked", (tokens + kBlockTokens - 1) / kBlockTokens * per_block}};
      tokens = std::max<uint64_t>(kBlockTokens, fits);
    }
    for (bool ssd : {false, true}) {
      if ((ssd && !o.ssd) || (!ssd && !o.host)) continue;
      ProgressNote(fmt::format("{} tokens of {}, {} tier", tokens, mdl.name, ssd ? "SSD" : "host"));
      SPARSEKV_ASSIGN_OR_RETURN(nlohmann::json j, SuspendResume(mdl.name, spec, tokens, ssd, root + "/seq", o.with_fio, o.cold_host_tier, o));
      j["bytes_per_block"] = per_block;
      if (!cut.is_null()) j["cut_to_fit_memory"] = cut;
      runs.push_back(j);
    }
  }
  out["sequences"] = runs;
  {
    ProgressNote(fmt::format("a conversation of {} turns", o.turns));
    SPARSEKV_ASSIGN_OR_RETURN(ModelSpec spec, ModelPreset("deepseek-v4-flash", KvPrecision::kFp8));
    SPARSEKV_ASSIGN_OR_RETURN(out["conversation"],
                              Conversation(spec, o.turns, o.turn_tokens, root + "/conversation", WritePolicy::kWriteBack));
    SPARSEKV_ASSIGN_OR_RETURN(out["conversation_write_through"],
                              Conversation(spec, o.turns, o.turn_tokens, root + "/conversation", WritePolicy::kWriteThrough));
  }
  nlohmann::json logs = nlohmann::json::array();
  for (uint32_t c : o.concurrency) {
    ProgressNote(fmt::format("request log, {} requests appending", c));
    SPARSEKV_ASSIGN_OR_RETURN(nlohmann::json j, LogRate(root + "/log", c, o.log_seconds));
    logs.push_back(j);
  }
  out["log"] = logs;
  if (o.with_fio) {
    const std::string cmd = fmt::format(
        "fio --name=sync --filename={}/fio_sync.dat --rw=write --bs=4k --size=64m --ioengine=sync --fdatasync=1 "
        "--runtime={} --time_based --output-format=json",
        root, std::max(1.0, o.log_seconds));
    Result<double> r = RunFioJob(cmd, "write");
    if (r.ok()) {
      out["fio_fdatasync_writes_per_s"] = *r / 4096;
      for (auto& j : out["log"]) j["vs_fio_fdatasync_writes"] = j["appends_per_s"].get<double>() / (*r / 4096);
      out["fio_fdatasync_command"] = "fio --name=sync --filename=DIR/fio_sync.dat --rw=write --bs=4k --size=64m "
                                     "--ioengine=sync --fdatasync=1 --time_based --output-format=json";
    } else {
      out["fio_error"] = r.status().ToString();
    }
  }
  return out;
}

}  // namespace sparsekv::bench
