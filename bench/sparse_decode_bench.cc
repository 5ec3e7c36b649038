#include "sparse_decode_bench.h"

#include "bench_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <unistd.h>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "sparsekv/bf16.h"
#include "sparsekv/block_geometry.h"
#include "sparsekv/codec.h"
#include "sparsekv/cpu_features.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/lightning_indexer.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/sparse_mla.h"
#include "sparsekv/sparse_offload.h"
#include "sparsekv/ssd_tier.h"
#include "server/server.h"
#include "server/tiered_store.h"

namespace sparsekv::bench {
namespace {

double Median(std::vector<double> v) { return RateSamples{std::move(v)}.Median(); }

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using Arena = std::unique_ptr<std::byte, FreeDeleter>;

Arena AllocArena(uint64_t bytes) {
  Arena a(static_cast<std::byte*>(std::aligned_alloc(64, (bytes + 63) & ~uint64_t{63})));
  if (a) std::memset(a.get(), 0, bytes);
  return a;
}

// Pages of one format filled with N(0, 1) rows through the codec.
Status Fill(std::byte* base, uint64_t stride, uint32_t pages, StorageFormat format, uint32_t dims, uint32_t entries,
            std::mt19937& rng) {
  SPARSEKV_ASSIGN_OR_RETURN(PageCodec codec, PageCodec::Create(format, dims, entries));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> rows(uint64_t{entries} * dims);
  for (uint32_t p = 0; p < pages; ++p) {
    for (float& x : rows) x = normal(rng);
    SPARSEKV_RETURN_IF_ERROR(codec.WriteTokens(base + p * stride, 0, RowsView::Fp32(rows.data(), entries, dims)));
  }
  return Status::OK();
}

double Overlap(std::vector<int32_t> a, std::vector<int32_t> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  std::vector<int32_t> both;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
  return static_cast<double>(both.size()) / static_cast<double>(std::max<size_t>(1, a.size()));
}

// The indexer query's drift: a step of relative size `b` in a random direction, at the same norm.
void Drift(std::vector<float>& q, double b, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double n0 = 0, n1 = 0;
  for (float x : q) n0 += double{x} * x;
  const double scale = b * std::sqrt(n0 / static_cast<double>(q.size()));
  for (float& x : q) x += static_cast<float>(scale * normal(rng));
  for (float x : q) n1 += double{x} * x;
  const float k = static_cast<float>(std::sqrt(n0 / n1));
  for (float& x : q) x *= k;
}

}  // namespace

Result<nlohmann::json> RunSparseDecodeBench(const SparseDecodeBenchOptions& o) {
  if (o.tier != "host" && o.tier != "ssd" && o.tier != "daemon" && o.tier != "daemon-ssd") {
    return Status::InvalidArgument(
        fmt::format("bench sparse-decode: --tier must be host, ssd, daemon or daemon-ssd (got {})", o.tier));
  }
  if ((o.tier == "ssd" || o.tier == "daemon-ssd") && o.dir.empty()) {
    return Status::InvalidArgument(fmt::format("bench sparse-decode: --tier {} needs --dir", o.tier));
  }
  if (!(o.l1_fraction > 0 && o.l1_fraction <= 1) || !(o.overlap > 0 && o.overlap < 1) || o.steps == 0 ||
      o.layers == 0 || o.threads == 0) {
    return Status::InvalidArgument(
        "bench sparse-decode: --l1-fraction in (0, 1], --overlap in (0, 1), --steps, --layers and --threads at "
        "least 1");
  }
  SPARSEKV_ASSIGN_OR_RETURN(KvPrecision precision, ParseKvPrecision(o.precision));
  SPARSEKV_ASSIGN_OR_RETURN(ModelSpec spec, ModelPreset(o.model, precision));
  SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry geo, ComputeBlockGeometry(spec));
  // The first layer with a sparse cache: V3.2's latent, else V4's CSA entries.
  int sparse_pool = -1, key_pool = -1, window_pool = -1;
  for (uint32_t l = 0; l < spec.layers.size() && sparse_pool < 0; ++l) {
    for (CacheKind k : {CacheKind::kMlaLatent, CacheKind::kCsaCompressed}) {
      if (geo.PoolIndex(l, k) >= 0) {
        sparse_pool = geo.PoolIndex(l, k);
        key_pool = geo.PoolIndex(l, CacheKind::kIndexerKey);
        window_pool = geo.PoolIndex(l, CacheKind::kSwaWindow);
        break;
      }
    }
  }
  if (sparse_pool < 0 || key_pool < 0 || spec.indexer_topk == 0) {
    return Status::InvalidArgument(fmt::format("bench sparse-decode: {} has no indexed sparse cache", o.model));
  }
  const PoolGeometry& sp = geo.pools[sparse_pool];
  const PoolGeometry& kp = geo.pools[key_pool];
  const uint32_t block_tokens = geo.block_tokens;
  if (o.context == 0 || o.context % block_tokens != 0 || o.context / block_tokens > (1u << 20)) {
    return Status::InvalidArgument(
        fmt::format("bench sparse-decode: --context must be a positive multiple of {} tokens", block_tokens));
  }
  const uint32_t blocks = static_cast<uint32_t>(o.context / block_tokens);
  const uint32_t E = sp.entries_per_block;
  const uint64_t entries = uint64_t{blocks} * E;
  const uint32_t top_k = spec.indexer_topk, heads = spec.attention_heads, idx_heads = spec.indexer_heads;
  const uint32_t dims = sp.spec.dims, key_dims = kp.spec.dims;
  if (entries < top_k) {
    return Status::InvalidArgument(
        fmt::format("bench sparse-decode: {} entries of context, fewer than top-k {}", entries, top_k));
  }
  const uint32_t L = o.layers;
  std::mt19937 rng(o.seed);

  // The sparse cache: resident pages (logical block b at physical table[b]) and sparse records
  // in the host tier.
  SparseRecordLayout layout;
  layout.format = sp.spec.format;
  layout.dims = dims;
  layout.entries = E;
  layout.layers = L;
  layout.page_stride = sp.layer_stride;
  const uint64_t block_stride = layout.pages_bytes();
  Arena pool = AllocArena(block_stride * blocks);
  if (!pool) return Status::ResourceExhausted("bench sparse-decode: no memory for the resident cache");
  SPARSEKV_RETURN_IF_ERROR(Fill(pool.get(), layout.page_stride, blocks * L, layout.format, dims, E, rng));
  std::vector<uint32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0u);
  std::shuffle(table.begin(), table.end(), rng);
  const uint64_t record = kSparseSectorBytes + layout.sectors_bytes();
  std::unique_ptr<HostTier> host;
  if (o.tier == "host") {
    HostTierOptions ho;
    ho.capacity_bytes = record * (blocks + 2);
    SPARSEKV_ASSIGN_OR_RETURN(host, HostTier::Open(ho));
  }
  std::unique_ptr<SsdTier> ssd;
  std::string ssd_path;
  const bool daemon = o.tier == "daemon" || o.tier == "daemon-ssd";
  if (o.tier == "ssd" || daemon) {
    ssd_path = (std::filesystem::path(o.dir.empty() ? std::filesystem::temp_directory_path().string() : o.dir) /
                fmt::format("sparse-decode-{}", ::getpid()))
                   .string();
    std::filesystem::remove_all(ssd_path);
  }
  if (o.tier == "ssd") {
    SsdTierOptions so;
    so.path = ssd_path;
    so.capacity_bytes = record * (blocks + 64);
    so.durability = Durability::kNone;
    SPARSEKV_ASSIGN_OR_RETURN(ssd, SsdTier::Open(so));
  }
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
  } remove_dir{ssd_path};
  // --tier daemon: sparsekvd in this process, over a Unix socket, with the values in its host
  // tier; daemon-ssd: a host tier of an eighth of them over an SSD tier in --dir.
  std::unique_ptr<server::TieredStore> store;
  std::unique_ptr<server::Server> server;
  std::unique_ptr<Client> client;
  std::vector<WireBlockHash> wire_keys;
  if (daemon) {
    std::filesystem::create_directories(ssd_path);
    server::TieredStoreOptions so;
    const uint64_t value_record = 64 + kSparseValuePadBytes + layout.sectors_bytes();
    so.offload.host.capacity_bytes =
        o.tier == "daemon" ? (value_record + 4096) * (blocks + 2) : std::max<uint64_t>(value_record * (blocks / 8 + 2), 4 << 20);
    so.offload.host.max_record_bytes = std::max<uint64_t>(value_record, 1 << 20);
    if (o.tier == "daemon-ssd") {
      so.offload.ssd_enabled = true;
      so.offload.ssd.path = ssd_path + "/ssd";
      so.offload.ssd.capacity_bytes = (value_record + 4096) * (blocks + 64);
      so.offload.ssd.durability = Durability::kNone;
    }
    SPARSEKV_ASSIGN_OR_RETURN(store, server::TieredStore::Open(so));
    server::ServerOptions sv;
    sv.tcp_listen = "";
    sv.metrics_listen = "";
    sv.unix_path = ssd_path + "/d.sock";
    sv.namespaces = {{"bench", "bench"}};
    SPARSEKV_ASSIGN_OR_RETURN(server, server::Server::Start(sv, store.get()));
    ClientOptions co;
    co.address = "unix:" + sv.unix_path;
    co.namespace_name = "bench";
    co.token = "bench";
    co.shared_memory = false;
    SPARSEKV_ASSIGN_OR_RETURN(client, Client::Connect(co));
  }
  std::vector<BundleKey> keys;
  for (uint32_t b = 0; b < blocks; ++b) {
    keys.push_back({1, BlockHash{uint64_t{b} * 0x9e3779b97f4a7c15ull + 7, b}});
    const std::span<const std::byte> pages{pool.get() + uint64_t{table[b]} * block_stride, block_stride};
    if (client) {
      WireBlockHash h{};
      std::memcpy(h.data(), &keys.back().hash.lo, 8);
      std::memcpy(h.data() + 8, &keys.back().hash.hi, 8);
      wire_keys.push_back(h);
      SPARSEKV_ASSIGN_OR_RETURN(std::vector<std::byte> value, MakeSparseValue(layout, h, pages));
      const BundleRef ref{h, value};
      SPARSEKV_ASSIGN_OR_RETURN(std::vector<Status> put, client->Put(std::span<const BundleRef>(&ref, 1)));
      SPARSEKV_RETURN_IF_ERROR(put[0]);
    } else if (ssd) {
      SPARSEKV_ASSIGN_OR_RETURN(BundlePtr rec, MakeSparseRecord(keys.back(), layout, pages, b + 1));
      SPARSEKV_RETURN_IF_ERROR(ssd->Put({rec}).get()[0]);
    } else {
      SPARSEKV_RETURN_IF_ERROR(StoreSparseRecord(*host, keys.back(), layout, pages, b + 1));
    }
  }
  auto resident_view = [&](uint32_t l) {
    PagedCacheView v;
    v.base = pool.get() + uint64_t{l} * layout.page_stride;
    v.block_stride = block_stride;
    v.num_blocks = blocks;
    v.block_entries = E;
    v.dims = dims;
    v.format = layout.format;
    return v;
  };
  // Indexer keys, resident in both paths, one arena per layer.
  const uint32_t KE = kp.entries_per_block;
  const uint64_t key_page = kp.layer_stride;
  std::vector<Arena> key_arenas;
  std::vector<uint32_t> key_table(blocks), identity(blocks);
  std::iota(key_table.begin(), key_table.end(), 0u);
  std::shuffle(key_table.begin(), key_table.end(), rng);
  std::iota(identity.begin(), identity.end(), 0u);
  for (uint32_t l = 0; l < L; ++l) {
    key_arenas.push_back(AllocArena(key_page * blocks));
    if (!key_arenas.back()) return Status::ResourceExhausted("bench sparse-decode: no memory for the keys");
    SPARSEKV_RETURN_IF_ERROR(Fill(key_arenas.back().get(), key_page, blocks, kp.spec.format, key_dims, KE, rng));
  }
  auto key_view = [&](uint32_t l) {
    PagedCacheView v;
    v.base = key_arenas[l].get();
    v.block_stride = key_page;
    v.num_blocks = blocks;
    v.block_entries = KE;
    v.dims = key_dims;
    v.format = kp.spec.format;
    return v;
  };
  // V4: the sliding window, resident in both paths, read whole each step.
  Arena window;
  PagedCacheView window_view;
  std::vector<int32_t> window_idx;
  uint64_t window_bytes = 0;
  if (window_pool >= 0) {
    const PoolGeometry& wp = geo.pools[window_pool];
    window_bytes = wp.layer_stride;
    window = AllocArena(window_bytes);
    SPARSEKV_RETURN_IF_ERROR(Fill(window.get(), window_bytes, 1, wp.spec.format, wp.spec.dims, wp.entries_per_block, rng));
    window_view = {window.get(), window_bytes, 1, wp.entries_per_block, wp.spec.dims, wp.spec.format};
    for (uint32_t e = 0; e < wp.entries_per_block; ++e) window_idx.push_back(static_cast<int32_t>(e));
  }

  LightningIndexerOptions io;
  io.top_k = top_k;
  io.threads = o.threads;
  SPARSEKV_ASSIGN_OR_RETURN(auto indexer, LightningIndexer::Create(io));
  // --prefetch P: the sparse path's indexer ranks P more, the next-ranked entries to prefetch;
  // the resident path keeps its own top-k run (timed on its own), whose selection must match.
  std::unique_ptr<LightningIndexer> ranker;
  if (o.prefetch > 0) {
    LightningIndexerOptions ro = io;
    ro.top_k = top_k + o.prefetch;
    SPARSEKV_ASSIGN_OR_RETURN(ranker, LightningIndexer::Create(ro));
  }
  SparseMlaOptions mo;
  mo.threads = o.threads;
  SPARSEKV_ASSIGN_OR_RETURN(auto mla, SparseMla::Create(mo));
  const uint32_t capacity =
      std::max<uint32_t>(top_k, static_cast<uint32_t>(std::ceil(o.l1_fraction * static_cast<double>(entries))));
  std::vector<std::unique_ptr<SparseWorkingSet>> ws;
  for (uint32_t l = 0; l < L; ++l) {
    SparseWorkingSetOptions wo;
    wo.format = layout.format;
    wo.dims = dims;
    wo.capacity_entries = capacity;
    SPARSEKV_ASSIGN_OR_RETURN(auto w, SparseWorkingSet::Create(wo));
    ws.push_back(std::move(w));
  }
  std::unique_ptr<HostEntryFetcher> host_fetch;
  std::unique_ptr<SsdEntryFetcher> ssd_fetch;
  std::unique_ptr<DaemonEntryFetcher> daemon_fetch;
  if (client) {
    daemon_fetch = std::make_unique<DaemonEntryFetcher>(*client, layout, wire_keys);
  } else if (ssd) {
    ssd_fetch = std::make_unique<SsdEntryFetcher>(*ssd, layout, keys);
  } else {
    host_fetch = std::make_unique<HostEntryFetcher>(*host, layout, keys);
  }
  auto fetch = [&](uint32_t l, std::span<const SparseWorkingSet::Miss> m, SparseWorkingSet& w) {
    return daemon_fetch ? daemon_fetch->Fetch(l, m, w)
           : ssd_fetch  ? ssd_fetch->Fetch(l, m, w)
                        : host_fetch->Fetch(l, m, w);
  };
  auto fetched = [&] {
    return daemon_fetch ? daemon_fetch->bytes_fetched()
           : ssd_fetch  ? ssd_fetch->bytes_fetched()
                        : host_fetch->bytes_fetched();
  };
  // --prefetch: a second fetcher of the same kind, run on AsyncEntryFetcher's thread.
  std::unique_ptr<HostEntryFetcher> host_prefetch;
  std::unique_ptr<SsdEntryFetcher> ssd_prefetch;
  std::unique_ptr<DaemonEntryFetcher> daemon_prefetch;
  std::atomic<uint64_t> prefetch_ns{0};  // before `async`, whose thread adds to it until it goes
  std::unique_ptr<AsyncEntryFetcher> async;
  if (o.prefetch > 0) {
    if (client) {
      daemon_prefetch = std::make_unique<DaemonEntryFetcher>(*client, layout, wire_keys);
    } else if (ssd) {
      ssd_prefetch = std::make_unique<SsdEntryFetcher>(*ssd, layout, keys);
    } else {
      host_prefetch = std::make_unique<HostEntryFetcher>(*host, layout, keys);
    }
    async = std::make_unique<AsyncEntryFetcher>(
        [&](uint32_t l, std::span<const SparseWorkingSet::Miss> m, SparseWorkingSet& w) {
          const double t = NowSeconds();
          Status st = daemon_prefetch ? daemon_prefetch->Fetch(l, m, w)
                      : ssd_prefetch  ? ssd_prefetch->Fetch(l, m, w)
                                      : host_prefetch->Fetch(l, m, w);
          prefetch_ns += static_cast<uint64_t>((NowSeconds() - t) * 1e9);
          return st;
        });
  }
  auto prefetched_bytes = [&]() -> uint64_t {
    return daemon_prefetch ? daemon_prefetch->bytes_fetched()
           : ssd_prefetch  ? ssd_prefetch->bytes_fetched()
           : host_prefetch ? host_prefetch->bytes_fetched()
                           : 0;
  };
  uint64_t daemon_ssd_read0 = 0, requests0 = 0, requested0 = 0, prefetched0 = 0, prefetch_ns0 = 0;
  auto daemon_ssd_read = [&]() -> uint64_t {
    return o.tier == "daemon-ssd" ? store->chain().tier(1).Stats().bytes_read : 0;
  };

  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> qi(L, std::vector<float>(uint64_t{idx_heads} * key_dims));
  std::vector<std::vector<float>> weights(L, std::vector<float>(idx_heads));
  for (uint32_t l = 0; l < L; ++l) {
    for (float& x : qi[l]) x = normal(rng);
    for (float& w : weights[l]) w = std::fabs(normal(rng)) + 0.1f;
  }
  const uint64_t position = o.context - 1;
  std::vector<int32_t> logical(top_k), physical(top_k), resident(top_k);
  auto select = [&](uint32_t l, std::vector<int32_t>& out, LightningIndexer* by = nullptr,
                    float* logits = nullptr) -> Status {
    IndexerSequence is{key_table, identity, E};
    IndexerBatch ib;
    ib.q = qi[l].data();
    ib.q_type = RowType::kFp32;
    ib.weights = weights[l].data();
    ib.tokens = 1;
    ib.heads = idx_heads;
    ib.sequences = std::span<const IndexerSequence>(&is, 1);
    ib.positions = &position;
    ib.key_ratio = kp.spec.ratio;
    IndexerOutput iout;
    iout.indices = out.data();
    iout.top_logits = logits;
    return (by != nullptr ? by : indexer.get())->Run(key_view(l), ib, iout);
  };
  // The ranked run split: the top-k (ascending, as the indexer writes a selection) and the rest,
  // best first. Ties go to the lower entry.
  std::vector<int32_t> ranked(top_k + o.prefetch), chosen(top_k), next_ranked;
  std::vector<float> ranked_logits(ranked.size());
  std::vector<uint32_t> order(ranked.size());
  auto split_ranked = [&] {
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      if (ranked_logits[a] != ranked_logits[b]) return ranked_logits[a] > ranked_logits[b];
      return ranked[a] < ranked[b];
    });
    for (uint32_t i = 0; i < top_k; ++i) chosen[i] = ranked[order[i]];
    std::sort(chosen.begin(), chosen.end());
    next_ranked.clear();
    for (size_t i = top_k; i < order.size(); ++i) next_ranked.push_back(ranked[order[i]]);
  };
  uint64_t selection_mismatches = 0;

  // The drift that gives the target overlap: bisection on its size, a few steps of layer 0 each.
  double lo = 1e-4, hi = 4.0;
  {
    const std::vector<float> q0 = qi[0];
    std::vector<int32_t> prev(top_k), cur(top_k);
    for (int it = 0; it < 12; ++it) {
      const double b = std::sqrt(lo * hi);
      qi[0] = q0;
      std::mt19937 crng(o.seed + 1000 + it);
      SPARSEKV_RETURN_IF_ERROR(select(0, prev));
      double sum = 0;
      for (int s = 0; s < 4; ++s) {
        Drift(qi[0], b, crng);
        SPARSEKV_RETURN_IF_ERROR(select(0, cur));
        sum += Overlap(prev, cur);
        prev.swap(cur);
      }
      if (sum / 4 > o.overlap) {
        lo = b;
      } else {
        hi = b;
      }
    }
    qi[0] = q0;
  }
  const double drift = std::sqrt(lo * hi);

  // The steps. Step 0 fills the working sets and is not counted.
  std::vector<std::vector<int32_t>> last(L);
  std::vector<float> out_a(uint64_t{heads} * 512), lse_a(heads), out_b(out_a.size()), lse_b(heads);
  std::vector<SparseWorkingSet::Miss> misses;
  std::vector<double> step_s, resident_s, idx_s, rank_s, fetch_s, mla_ws_s, mla_res_s;
  double overlap_sum = 0;
  uint64_t overlap_n = 0, hits0 = 0, misses0 = 0, bytes0 = 0, sectors0 = 0;
  bool identical = true;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dims));
  for (uint32_t step = 0; step <= o.steps; ++step) {
    if (step == 1) {
      // The fills of step 0 finish first: their counters are read below.
      if (async) {
        for (const auto& w : ws) (void)async->Wait(*w);
      }
      for (const auto& w : ws) {
        hits0 += w->hits();
        misses0 += w->misses();
      }
      bytes0 = fetched();
      sectors0 = ssd_fetch ? ssd_fetch->sectors_read() : 0;
      daemon_ssd_read0 = daemon_ssd_read();
      prefetched0 = prefetched_bytes();
      prefetch_ns0 = prefetch_ns.load();
      if (daemon_fetch) {
        requests0 = daemon_fetch->requests();
        requested0 = daemon_fetch->bytes_requested();
      }
    }
    double t_idx = 0, t_rank = 0, t_fetch = 0, t_ws = 0, t_res = 0;
    for (uint32_t l = 0; l < L; ++l) {
      Drift(qi[l], drift, rng);
      double t0 = NowSeconds();
      SPARSEKV_RETURN_IF_ERROR(select(l, logical));
      t_idx += NowSeconds() - t0;
      if (ranker) {
        t0 = NowSeconds();
        SPARSEKV_RETURN_IF_ERROR(select(l, ranked, ranker.get(), ranked_logits.data()));
        split_ranked();
        t_rank += NowSeconds() - t0;
        if (chosen != logical) ++selection_mismatches;
      }
      if (!last[l].empty() && step > 0) {
        overlap_sum += Overlap(last[l], logical);
        ++overlap_n;
      }
      last[l] = logical;
      std::vector<uint16_t> q(uint64_t{heads} * dims);
      for (auto& x : q) x = Bf16FromFloat(normal(rng));
      SparseMlaBatch mb;
      mb.q = q.data();
      mb.tokens = 1;
      mb.heads = heads;
      mb.softmax_scale = scale;
      if (window) {
        SparseMlaSource w;
        w.view = window_view;
        w.indices = window_idx.data();
        w.top_k = static_cast<uint32_t>(window_idx.size());
        mb.extra = w;
      }
      auto run_resident = [&]() -> Status {
        const double t = NowSeconds();
        for (uint32_t i = 0; i < top_k; ++i) {
          resident[i] = logical[i] < 0 ? -1 : PhysicalIndex(table, E, static_cast<uint64_t>(logical[i]));
        }
        mb.main = SparseMlaSource{};
        mb.main.view = resident_view(l);
        mb.main.indices = resident.data();
        mb.main.top_k = top_k;
        Status st = mla->Run(mb, {out_a.data(), lse_a.data()});
        t_res += NowSeconds() - t;
        return st;
      };
      auto run_sparse = [&]() -> Status {
        double t = NowSeconds();
        if (async) (void)async->Wait(*ws[l]);  // a failed prefetch is fetched below, on demand
        SPARSEKV_RETURN_IF_ERROR(ws[l]->Map(ranker ? chosen : logical, physical, &misses));
        SPARSEKV_RETURN_IF_ERROR(fetch(l, misses, *ws[l]));
        if (async) {
          // The next-ranked entries are brought while the kernel runs.
          std::vector<SparseWorkingSet::Miss> ahead;
          ws[l]->Prefetch(next_ranked, &ahead);
          async->Start(l, std::move(ahead), *ws[l]);
        }
        t_fetch += NowSeconds() - t;
        t = NowSeconds();
        mb.main = SparseMlaSource{};
        mb.main.view = ws[l]->view();
        mb.main.indices = physical.data();
        mb.main.top_k = top_k;
        Status st = mla->Run(mb, {out_b.data(), lse_b.data()});
        t_ws += NowSeconds() - t;
        return st;
      };
      // Alternate which goes first, so that neither always finds the query in the cache.
      if ((step + l) % 2 == 0) {
        SPARSEKV_RETURN_IF_ERROR(run_resident());
        SPARSEKV_RETURN_IF_ERROR(run_sparse());
      } else {
        SPARSEKV_RETURN_IF_ERROR(run_sparse());
        SPARSEKV_RETURN_IF_ERROR(run_resident());
      }
      if (std::memcmp(out_a.data(), out_b.data(), out_a.size() * 4) != 0 ||
          std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * 4) != 0) {
        identical = false;
      }
    }
    if (step == 0) continue;
    idx_s.push_back(t_idx);
    fetch_s.push_back(t_fetch);
    mla_ws_s.push_back(t_ws);
    mla_res_s.push_back(t_res);
    step_s.push_back((ranker ? t_rank : t_idx) + t_fetch + t_ws);
    resident_s.push_back(t_idx + t_res);
    if (ranker) rank_s.push_back(t_rank);
  }
  if (async) {
    for (const auto& w : ws) (void)async->Wait(*w);
  }
  const uint64_t prefetched_total = prefetched_bytes() - prefetched0;
  const double prefetch_busy = (prefetch_ns.load() - prefetch_ns0) / 1e9;
  uint64_t hits = 0, miss = 0, ahead = 0, ahead_used = 0;
  uint64_t ws_memory = 0;
  for (const auto& w : ws) {
    hits += w->hits();
    miss += w->misses();
    ws_memory += w->memory_bytes();
    ahead += w->prefetched();
    ahead_used += w->prefetch_used();
  }
  hits -= hits0;
  miss -= misses0;

  const uint64_t daemon_ssd_bytes = daemon_ssd_read() - daemon_ssd_read0;
  // Restoring the same context whole from the tier: every record read (from the SSD tier: in
  // batches of 128, whole records, checked) and unpacked into pages written once before, each
  // entry checked. From the daemon: GETs of 16 values (checked by the daemon and by the client).
  Arena dest = AllocArena(block_stride * blocks);
  if (!dest) return Status::ResourceExhausted("bench sparse-decode: no memory for the restore");
  std::vector<double> restore;
  for (int r = 0; r < 3; ++r) {
    const double t = NowSeconds();
    std::vector<Result<BundlePtr>> batch;
    if (client) {
      for (uint32_t b = 0; b < blocks; b += 16) {
        std::vector<WireBlockHash> some(wire_keys.begin() + b, wire_keys.begin() + std::min<uint32_t>(blocks, b + 16));
        SPARSEKV_ASSIGN_OR_RETURN(std::vector<GetResult> got, client->Get(some));
        for (size_t i = 0; i < got.size(); ++i) {
          SPARSEKV_RETURN_IF_ERROR(got[i].status);
          const std::span<const std::byte> value(got[i].bytes);
          if (value.size() != kSparseValuePadBytes + layout.sectors_bytes()) {
            return Status::Corruption("bench sparse-decode: a value of another size came back");
          }
          SPARSEKV_RETURN_IF_ERROR(UnpackSparseRecord(layout, SparseValueKey(wire_keys[b + i]),
                                                      value.subspan(kSparseValuePadBytes),
                                                      {dest.get() + uint64_t{b + i} * block_stride, block_stride}));
        }
      }
      restore.push_back(NowSeconds() - t);
      continue;
    }
    for (uint32_t b = 0; b < blocks; ++b) {
      if (ssd && b % 128 == 0) {
        std::vector<BundleKey> some(keys.begin() + b, keys.begin() + std::min<uint32_t>(blocks, b + 128));
        batch = ssd->Get(std::move(some)).get();
      }
      SPARSEKV_ASSIGN_OR_RETURN(BundlePtr rec,
                                ssd ? std::move(batch[b % 128]) : host->GetPinned(keys[b], /*check=*/false));
      SPARSEKV_RETURN_IF_ERROR(
          UnpackSparseRecord(layout, keys[b], rec->segment(1), {dest.get() + uint64_t{b} * block_stride, block_stride}));
    }
    restore.push_back(NowSeconds() - t);
  }

  // L1 bytes per token of context, per layer: the resident layout keeps the sparse cache's
  // pages and the keys; the sparse one the keys, the working set (arena, slot state, index).
  const double tokens = static_cast<double>(o.context);
  const double key_bytes = static_cast<double>(key_page) * blocks;
  const double window_per_layer = static_cast<double>(window_bytes);
  const double resident_l1 = (static_cast<double>(layout.page_stride) * blocks + key_bytes + window_per_layer) / tokens;
  const double sparse_l1 = (static_cast<double>(ws_memory) / L + key_bytes + window_per_layer) / tokens;

  nlohmann::json j;
  j["model"] = o.model;
  j["precision"] = o.precision;
  j["format"] = std::string(StorageFormatName(layout.format));
  j["tier"] = o.tier;
  j["context"] = o.context;
  j["layers"] = L;
  j["steps"] = o.steps;
  j["top_k"] = top_k;
  j["heads"] = heads;
  j["indexer_heads"] = idx_heads;
  j["sparse_entries"] = entries;
  j["l1_fraction"] = o.l1_fraction;
  j["working_set_entries"] = capacity;
  j["target_overlap"] = o.overlap;
  j["drift"] = drift;
  j["measured_overlap"] = overlap_n ? overlap_sum / static_cast<double>(overlap_n) : 0.0;
  j["bytes_fetched_per_step"] = static_cast<double>(fetched() - bytes0) / o.steps;
  if (daemon_fetch) {
    j["requests_per_step"] = static_cast<double>(daemon_fetch->requests() - requests0) / o.steps;
    j["bytes_requested_per_step"] = static_cast<double>(daemon_fetch->bytes_requested() - requested0) / o.steps;
  }
  if (o.tier == "daemon-ssd") j["daemon_ssd_bytes_read_per_step"] = static_cast<double>(daemon_ssd_bytes) / o.steps;
  if (daemon_fetch) j["entry_bytes"] = layout.entry_bytes();
  if (ssd_fetch) {
    j["sectors_read_per_step"] = static_cast<double>(ssd_fetch->sectors_read() - sectors0) / o.steps;
    j["entry_bytes"] = layout.entry_bytes();
  }
  j["prefetch"] = o.prefetch;
  if (async) {
    j["bytes_prefetched_per_step"] = static_cast<double>(prefetched_total) / o.steps;
    j["prefetch_thread_seconds_per_step"] = prefetch_busy / o.steps;
    j["prefetch_used_ratio"] = ahead ? static_cast<double>(ahead_used) / static_cast<double>(ahead) : 0.0;
    j["ranked_indexer_seconds"] = Median(rank_s);
    j["selection_mismatches"] = selection_mismatches;
  }
  j["working_set_hit_ratio"] = hits + miss ? static_cast<double>(hits) / static_cast<double>(hits + miss) : 0.0;
  j["step_seconds"] = Median(step_s);
  j["resident_step_seconds"] = Median(resident_s);
  j["step_vs_resident"] = Median(step_s) / Median(resident_s);
  j["indexer_seconds"] = Median(idx_s);
  j["fetch_seconds"] = Median(fetch_s);
  j["mla_working_set_seconds"] = Median(mla_ws_s);
  j["mla_resident_seconds"] = Median(mla_res_s);
  j["full_restore_seconds"] = Median(restore);
  j["full_restore_vs_step"] = Median(restore) / Median(step_s);
  j["l1_bytes_per_token"] = sparse_l1;
  j["resident_l1_bytes_per_token"] = resident_l1;
  j["l1_vs_resident"] = sparse_l1 / resident_l1;
  j["outputs_identical"] = identical;
  j["simd_path"] = std::string(SimdPathName(ActiveSimdPath()));
  j["threads"] = o.threads;
  return j;
}

}  // namespace sparsekv::bench
