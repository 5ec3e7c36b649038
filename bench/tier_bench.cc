#include "tier_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "bench_util.h"
#include "sparsekv/bundle.h"
#include "sparsekv/file_system.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/rocksdb_tier.h"
#include "sparsekv/ssd_tier.h"

namespace sparsekv::bench {
namespace {

struct AlignedFree {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, AlignedFree>;

AlignedBuffer AllocAligned(uint64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kDirectIoAlignment, bytes) != 0) return nullptr;
  std::memset(p, 0, bytes);
  return AlignedBuffer(static_cast<std::byte*>(p));
}

BundleKey BenchKey(uint64_t i) {
  BundleKey k;
  k.namespace_id = 1;
  k.hash.hi = 0xbe4c0000 + i;
  k.hash.lo = i * 0x9e3779b97f4a7c15ull;
  return k;
}

// Bundles of exactly `record_bytes`: one segment, pseudo-random bytes.
Result<std::vector<BundlePtr>> MakeBundles(uint64_t count, uint64_t record_bytes) {
  const uint64_t payload = record_bytes - BundleHeaderBytes(1);
  std::vector<BundlePtr> out;
  out.reserve(count);
  uint64_t x = 0x12345678;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t sizes[] = {payload};
    SPARSEKV_ASSIGN_OR_RETURN(
        BundlePtr b, Bundle::MakeWith(BenchKey(i), sizes, [&](uint32_t, std::span<std::byte> d) {
          for (size_t k = 0; k + 8 <= d.size(); k += 8) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            std::memcpy(d.data() + k, &x, 8);
          }
        }));
    out.push_back(std::move(b));
  }
  return out;
}

// Runs `calls` batched calls, two in flight, and waits for all; returns seconds and failures.
template <typename Issue>
double Pipelined(uint64_t calls, Issue issue) {
  const double t0 = NowSeconds();
  std::vector<std::future<void>> inflight;
  std::deque<std::future<void>> q;
  for (uint64_t c = 0; c < calls; ++c) {
    if (q.size() >= 2) {
      q.front().wait();
      q.pop_front();
    }
    q.push_back(issue(c));
  }
  while (!q.empty()) {
    q.front().wait();
    q.pop_front();
  }
  return NowSeconds() - t0;
}

struct TierRun {
  double write_s = 0;
  double read_s = 0;
  uint64_t failures = 0;
  std::string first_error;
};

Result<std::unique_ptr<Tier>> OpenBenchTier(const TierBenchOptions& o, const std::string& path,
                                            uint64_t data_bytes) {
  if (o.tier == "ssd") {
    SsdTierOptions s;
    s.path = path;
    s.capacity_bytes = data_bytes + (64ull << 20);
    s.queue_depth = o.queue_depth;
    s.io_bytes = std::min<uint64_t>(std::max<uint64_t>(o.bundle_bytes, kDirectIoAlignment) +
                                        kDirectIoAlignment - 1,
                                    64ull << 20) /
                 kDirectIoAlignment * kDirectIoAlignment;
    s.max_record_bytes = std::max<uint64_t>(o.bundle_bytes, 1 << 20);
    s.slab_grow_bytes = 256ull << 20;
    s.durability = o.durability;
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<SsdTier> t, SsdTier::Open(s));
    return std::unique_ptr<Tier>(std::move(t));
  }
  if (o.tier == "rocksdb") {
    RocksDbTierOptions r;
    r.path = path;
    r.capacity_bytes = data_bytes + (64ull << 20);
    r.max_record_bytes = std::max<uint64_t>(o.bundle_bytes, 1 << 20);
    r.durability = o.durability;
    r.use_direct_io = true;  // reads must reach the device, as for the SSD tier
    r.worker_threads =
        std::min<uint32_t>(o.queue_depth, 64);  // as many reads in flight as the SSD tier's
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RocksDbTier> t, RocksDbTier::Open(r));
    return std::unique_ptr<Tier>(std::move(t));
  }
  HostTierOptions h;
  h.max_record_bytes = o.bundle_bytes;
  h.capacity_bytes = data_bytes + o.bundle_bytes;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> t, HostTier::Open(h));
  return std::unique_ptr<Tier>(std::move(t));
}

Result<TierRun> RunTier(const TierBenchOptions& o, const std::string& path,
                        const std::vector<BundlePtr>& bundles, uint32_t batch) {
  SPARSEKV_ASSIGN_OR_RETURN(
      std::unique_ptr<Tier> tier,
      OpenBenchTier(o, path, bundles.size() * ((o.bundle_bytes + 4095) & ~uint64_t{4095})));
  TierRun run;
  std::mutex mu;
  auto note = [&](const Status& s) {
    std::lock_guard<std::mutex> l(mu);
    ++run.failures;
    if (run.first_error.empty()) run.first_error = s.ToString();
  };
  const uint64_t calls = (bundles.size() + batch - 1) / batch;
  run.write_s = Pipelined(calls, [&](uint64_t c) {
    std::vector<BundlePtr> part(
        bundles.begin() + c * batch,
        bundles.begin() + std::min<uint64_t>(bundles.size(), (c + 1) * batch));
    auto p = std::make_shared<std::promise<void>>();
    tier->PutAsync(std::move(part), [&, p](std::vector<Status> st) {
      for (const Status& s : st) {
        if (!s.ok()) note(s);
      }
      p->set_value();
    });
    return p->get_future();
  });
  run.read_s = Pipelined(calls, [&](uint64_t c) {
    std::vector<BundleKey> keys;
    for (uint64_t i = c * batch; i < std::min<uint64_t>(bundles.size(), (c + 1) * batch); ++i)
      keys.push_back(BenchKey(i));
    auto p = std::make_shared<std::promise<void>>();
    tier->GetAsync(std::move(keys), [&, p](std::vector<Result<BundlePtr>> got) {
      for (auto& g : got) {
        if (!g.ok()) note(g.status());
      }
      p->set_value();
    });
    return p->get_future();
  });
  return run;
}

// The plain loop: one aligned buffer, a copy of each record into it, pwrite with O_DIRECT;
// then pread each back into it. fdatasync once per batch when the tier syncs.
Result<std::pair<double, double>> RunBaseline(const TierBenchOptions& o, const std::string& path,
                                              const std::vector<BundlePtr>& bundles,
                                              uint32_t batch) {
  FileSystem* fs = FileSystem::Default();
  FileOpenOptions fo;
  fo.create = true;
  fo.direct = true;
  fo.dsync = o.durability == Durability::kDsync;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RandomRWFile> f, fs->OpenRandomRW(path, fo));
  const uint64_t slot =
      (o.bundle_bytes + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
  SPARSEKV_RETURN_IF_ERROR(f->Allocate(0, slot * bundles.size()));
  AlignedBuffer buf = AllocAligned(slot);
  if (!buf) return Status::ResourceExhausted("no memory for the baseline buffer");
  const std::span<std::byte> b(buf.get(), slot);
  double t0 = NowSeconds();
  for (uint64_t i = 0; i < bundles.size(); ++i) {
    std::memcpy(b.data(), bundles[i]->record().data(), bundles[i]->record_bytes());
    SPARSEKV_RETURN_IF_ERROR(f->Write(i * slot, b));
    if (o.durability == Durability::kFdatasync &&
        ((i + 1) % batch == 0 || i + 1 == bundles.size())) {
      SPARSEKV_RETURN_IF_ERROR(f->Sync());
    }
  }
  const double write_s = NowSeconds() - t0;
  t0 = NowSeconds();
  for (uint64_t i = 0; i < bundles.size(); ++i) {
    SPARSEKV_ASSIGN_OR_RETURN(uint64_t n, f->Read(i * slot, b));
    if (n != slot) return Status::IOError(fmt::format("baseline: short read at {}", i * slot));
  }
  const double read_s = NowSeconds() - t0;
  f.reset();
  SPARSEKV_RETURN_IF_ERROR(fs->DeleteFile(path));
  return std::make_pair(write_s, read_s);
}

std::string FioCommand(const TierBenchOptions& o, const std::string& file, const char* rw) {
  return FioJobCommand(file, o.data_bytes, o.bundle_bytes, o.queue_depth, rw);
}

// Bytes per second fio reports for one sequential job.
Result<double> RunFio(const TierBenchOptions& o, const std::string& file, const char* rw) {
  return RunFioJob(FioCommand(o, file, rw), rw);
}

}  // namespace

Result<nlohmann::json> RunTierBench(const TierBenchOptions& o) {
  if (o.tier != "ssd" && o.tier != "rocksdb" && o.tier != "host") {
    return Status::InvalidArgument("--tier must be ssd, rocksdb or host, not '" + o.tier + "'");
  }
  if (o.tier != "host" && o.dir.empty())
    return Status::InvalidArgument("--dir is required for --tier " + o.tier);
  if (o.bundle_bytes < 4096 || o.bundle_bytes > (64ull << 20)) {
    return Status::InvalidArgument(
        fmt::format("--bundle-bytes {} is not in [4096, 64 MiB]", o.bundle_bytes));
  }
  if (o.queue_depth == 0 || o.queue_depth > 4096)
    return Status::InvalidArgument("--queue-depth must be in [1, 4096]");
  if (o.rounds < 1) return Status::InvalidArgument("--rounds must be at least 1");
  const uint64_t count = std::max<uint64_t>(1, o.data_bytes / o.bundle_bytes);
  const uint32_t batch = o.batch ? o.batch : 4 * o.queue_depth;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<ScratchDir> scratch,
                            ScratchDir::Make(o.dir, "tier-bench"));
  const std::string& root = scratch->path();

  SPARSEKV_ASSIGN_OR_RETURN(std::vector<BundlePtr> bundles, MakeBundles(count, o.bundle_bytes));
  const double bytes = static_cast<double>(count * o.bundle_bytes);
  RateSamples tier_w, tier_r, base_w, base_r, fio_w, fio_r;
  std::string fio_note;
  for (int round = 0; round < o.rounds; ++round) {
    const std::string tier_path =
        root.empty() ? std::string() : fmt::format("{}/tier-{}", root, round);
    SPARSEKV_ASSIGN_OR_RETURN(TierRun run, RunTier(o, tier_path, bundles, batch));
    if (run.failures) {
      return Status::IOError(fmt::format("tier bench: {} operations failed; first: {}",
                                         run.failures, run.first_error));
    }
    std::error_code ec;
    if (!tier_path.empty()) std::filesystem::remove_all(tier_path, ec);
    tier_w.rates.push_back(bytes / run.write_s);
    tier_r.rates.push_back(bytes / run.read_s);
    if (o.tier == "host") continue;
    SPARSEKV_ASSIGN_OR_RETURN(auto base, RunBaseline(o, root + "/baseline.dat", bundles, batch));
    base_w.rates.push_back(bytes / base.first);
    base_r.rates.push_back(bytes / base.second);
    if (o.with_fio && fio_note.empty()) {
      const std::string file = root + "/fio.dat";
      Result<double> w = RunFio(o, file, "write");
      Result<double> r = w.ok() ? RunFio(o, file, "read") : w.status();
      std::filesystem::remove(file, ec);
      if (!w.ok() || !r.ok()) {
        fio_note = (w.ok() ? r.status() : w.status()).ToString();
      } else {
        fio_w.rates.push_back(*w);
        fio_r.rates.push_back(*r);
      }
    }
  }

  nlohmann::json j;
  j["tier"] = o.tier;
  j["bundle_bytes"] = o.bundle_bytes;
  j["queue_depth"] = o.queue_depth;
  j["data_bytes"] = count * o.bundle_bytes;
  j["bundles"] = count;
  j["batch"] = batch;
  j["rounds"] = o.rounds;
  j["durability"] = std::string(DurabilityName(o.durability));
  j["write_bytes_per_s"] = tier_w.Median();
  j["read_bytes_per_s"] = tier_r.Median();
  nlohmann::json samples;
  samples["tier_write"] = tier_w.ToJson();
  samples["tier_read"] = tier_r.ToJson();
  if (o.tier != "host") {
    j["baseline_write_bytes_per_s"] = base_w.Median();
    j["baseline_read_bytes_per_s"] = base_r.Median();
    j["write_vs_baseline"] = tier_w.Median() / base_w.Median();
    j["read_vs_baseline"] = tier_r.Median() / base_r.Median();
    samples["baseline_write"] = base_w.ToJson();
    samples["baseline_read"] = base_r.ToJson();
  }
  if (o.with_fio) {
    if (!fio_note.empty()) {
      j["fio_error"] = fio_note;
    } else {
      j["fio_write_bytes_per_s"] = fio_w.Median();
      j["fio_read_bytes_per_s"] = fio_r.Median();
      j["write_vs_fio"] = tier_w.Median() / fio_w.Median();
      j["read_vs_fio"] = tier_r.Median() / fio_r.Median();
      j["fio_command"] = FioCommand(o, "DIR/fio.dat", "write|read");
      samples["fio_write"] = fio_w.ToJson();
      samples["fio_read"] = fio_r.ToJson();
    }
  }
  j["samples"] = samples;
  j["tier_dram_bytes"] = o.tier == "ssd" ? uint64_t{o.queue_depth} * o.bundle_bytes : 0;
  j["note"] =
      "bytes/s of bundle records; tier reads check every XXH3 checksum; O_DIRECT everywhere "
      "(rocksdb: "
      "use_direct_reads), so reads reach the device; baseline = synchronous pwrite/pread of the "
      "same aligned "
      "buffer, fdatasync per batch when the tier syncs; medians of interleaved rounds";
  return j;
}

}  // namespace sparsekv::bench
