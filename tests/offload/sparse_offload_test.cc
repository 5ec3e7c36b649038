// Sparse-aware offload (issue 18): the working set's mapping and replacement against a model,
// decode steps read from a host-tier working set bit-identical to reading the whole cache
// (V3.2's latent formats and V4's CSA cache with its resident window), and damaged or missing
// records refused entry by entry.
#include "sparsekv/sparse_offload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <list>
#include <numeric>
#include <random>
#include <unordered_map>
#include <tuple>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include "sparsekv/bf16.h"
#include "sparsekv/codec.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/lightning_indexer.h"
#include "sparsekv/sparse_mla.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/ssd_tier.h"
#include "sparsekv/tier_chain.h"
#include "server/server.h"
#include "server/tiered_store.h"
#include "tests/attention/test_cache.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

SparseWorkingSetOptions Options(StorageFormat format, uint32_t dims, uint32_t capacity) {
  SparseWorkingSetOptions o;
  o.format = format;
  o.dims = dims;
  o.capacity_entries = capacity;
  return o;
}

SparseMlaSource Source(const PagedCacheView& view, const int32_t* indices, uint32_t top_k) {
  SparseMlaSource s;
  s.view = view;
  s.indices = indices;
  s.top_k = top_k;
  return s;
}

// One token's selection by the indexer over `keys`, for a sequence at `position`.
Status Select(LightningIndexer& indexer, const PagedCacheView& keys, const IndexerSequence& is, const float* q,
              const float* weights, uint32_t heads, uint64_t position, uint32_t key_ratio, int32_t* out) {
  IndexerBatch ib;
  ib.q = q;
  ib.q_type = RowType::kFp32;
  ib.weights = weights;
  ib.tokens = 1;
  ib.heads = heads;
  ib.sequences = std::span<const IndexerSequence>(&is, 1);
  ib.positions = &position;
  ib.key_ratio = key_ratio;
  IndexerOutput iout;
  iout.indices = out;
  return indexer.Run(keys, ib, iout);
}

BundleKey Key(uint64_t block) { return {7, BlockHash{block * 0x9e3779b97f4a7c15ull + 1, block}}; }

// Writes a pattern naming `entry` into slot `slot` of the working set (what a fetch brings).
void Stamp(SparseWorkingSet& ws, uint32_t slot, uint64_t entry) {
  const PagedCacheView v = ws.view();
  const EntryRanges r = EntryByteRanges(v.format, v.dims, v.block_entries, ws.SlotInPage(slot));
  std::memcpy(ws.SlotPage(slot) + r.offset[0], &entry, sizeof(entry));
}
uint64_t Stamped(const SparseWorkingSet& ws, int32_t index) {
  const PagedCacheView v = ws.view();
  const uint32_t page = static_cast<uint32_t>(index) / v.block_entries;
  const EntryRanges r = EntryByteRanges(v.format, v.dims, v.block_entries, static_cast<uint32_t>(index) % v.block_entries);
  uint64_t e;
  std::memcpy(&e, v.Page(page) + r.offset[0], sizeof(e));
  return e;
}

// Against a plain LRU model: the same misses in the same order, the same hits, and every index
// Map gives reads back the entry it was asked for, over 3,000 selections that drift. A
// selection's misses never push out what the same selection names.
TEST(SparseWorkingSet, MapsLikeAnLruAndEveryIndexReadsItsEntry) {
  SparseWorkingSetOptions o;
  o.format = StorageFormat::kFp8DsMla;
  o.dims = 576;
  o.capacity_entries = 100;
  o.page_entries = 16;
  auto ws = SparseWorkingSet::Create(o);
  ASSERT_TRUE(ws.ok()) << ws.status().ToString();
  std::list<uint64_t> lru;  // front: most recent
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where;
  std::mt19937 rng(5);
  std::vector<int32_t> sel, phys;
  std::vector<SparseWorkingSet::Miss> misses;
  uint64_t model_hits = 0;
  int32_t center = 300;
  for (int call = 0; call < 3000; ++call) {
    center = std::clamp<int32_t>(center + static_cast<int32_t>(rng() % 21) - 10, 0, 999);
    sel.clear();
    const size_t n = 1 + rng() % 100;
    for (size_t i = 0; i < n; ++i) {
      sel.push_back(rng() % 8 == 0 ? -1 : std::clamp<int32_t>(center + static_cast<int32_t>(rng() % 120) - 60, 0, 999));
    }
    phys.assign(sel.size(), 7);
    ASSERT_TRUE((*ws)->Map(sel, phys, &misses).ok());
    // The model: what is held moves to the front (a hit the first time it is named); then the
    // first appearances of what is not held are misses, in order, each taking the place of
    // the least recently used.
    std::vector<uint64_t> want_misses;
    std::vector<uint64_t> seen;
    for (int32_t e : sel) {
      if (e < 0 || !where.count(e)) continue;
      if (std::find(seen.begin(), seen.end(), e) == seen.end()) ++model_hits;
      seen.push_back(static_cast<uint64_t>(e));
      lru.erase(where[e]);
      lru.push_front(static_cast<uint64_t>(e));
      where[e] = lru.begin();
    }
    for (int32_t e : sel) {
      if (e < 0 || where.count(e)) continue;
      want_misses.push_back(static_cast<uint64_t>(e));
      if (lru.size() == 100) {
        where.erase(lru.back());
        lru.pop_back();
      }
      lru.push_front(static_cast<uint64_t>(e));
      where[e] = lru.begin();
    }
    ASSERT_EQ(misses.size(), want_misses.size()) << "call " << call;
    for (size_t i = 0; i < misses.size(); ++i) {
      ASSERT_EQ(misses[i].entry, want_misses[i]) << "call " << call;
      Stamp(**ws, misses[i].slot, misses[i].entry);
    }
    for (size_t i = 0; i < sel.size(); ++i) {
      if (sel[i] < 0) {
        ASSERT_EQ(phys[i], -1);
      } else {
        ASSERT_GE(phys[i], 0);
        ASSERT_EQ(Stamped(**ws, phys[i]), static_cast<uint64_t>(sel[i])) << "call " << call << " position " << i;
      }
    }
    ASSERT_EQ((*ws)->held(), lru.size());
  }
  EXPECT_EQ((*ws)->hits(), model_hits);
  EXPECT_GT(model_hits, 0u);
}

TEST(SparseWorkingSet, RefusesWhatCannotBeMappedAndChangesNothing) {
  SparseWorkingSetOptions o;
  o.format = StorageFormat::kC8Mla;
  o.dims = 576;
  o.capacity_entries = 8;
  o.max_entries = 1000;
  auto ws = SparseWorkingSet::Create(o);
  ASSERT_TRUE(ws.ok());
  std::vector<int32_t> first = {1, 2, 3}, phys(3);
  std::vector<SparseWorkingSet::Miss> misses;
  ASSERT_TRUE((*ws)->Map(first, phys, &misses).ok());
  ASSERT_EQ(misses.size(), 3u);
  std::vector<int32_t> nine = {10, 11, 12, 13, 14, 15, 16, 17, 18}, phys9(9);
  Status st = (*ws)->Map(nine, phys9, &misses);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  std::vector<int32_t> far = {1000}, bad = {-2}, phys1(1);
  EXPECT_EQ((*ws)->Map(far, phys1, &misses).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*ws)->Map(bad, phys1, &misses).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*ws)->Map(first, phys1, &misses).code(), StatusCode::kInvalidArgument);
  // Nine names of which eight are distinct fit.
  std::vector<int32_t> dup = {10, 11, 12, 13, 14, 15, 16, 17, 10};
  EXPECT_TRUE((*ws)->Map(dup, phys9, &misses).ok());
  EXPECT_EQ(misses.size(), 8u);
  EXPECT_EQ(phys9[0], phys9[8]);
  // What the refused calls named was never held; the first three were, until the last call.
  EXPECT_EQ((*ws)->held(), 8u);
  SparseWorkingSetOptions bad_format = o;
  bad_format.format = StorageFormat::kIdxFp8;
  EXPECT_FALSE(SparseWorkingSet::Create(bad_format).ok());
}

// Prefetch takes free slots, then the least recently used, never a slot the last Map named
// (the kernel may be reading those meanwhile); it stops when only those are left; what it
// brought is a hit when a Map names it, and counted as used.
TEST(SparseWorkingSet, PrefetchNeverTakesWhatTheLastMapNamed) {
  SparseWorkingSetOptions o = Options(StorageFormat::kFp8DsMla, 576, 10);
  o.page_entries = 4;
  auto ws = SparseWorkingSet::Create(o);
  ASSERT_TRUE(ws.ok());
  std::vector<SparseWorkingSet::Miss> misses, ahead;
  // Before any Map: free slots only, each entry once, the unnamable skipped.
  (*ws)->Prefetch(std::vector<int32_t>{5, 5, -1, 6, 1 << 30}, &ahead);
  ASSERT_EQ(ahead.size(), 2u);
  EXPECT_EQ(ahead[0].entry, 5u);
  EXPECT_EQ(ahead[1].entry, 6u);
  std::vector<int32_t> sel = {1, 2, 3, 4, 5, 6}, phys(6);
  ASSERT_TRUE((*ws)->Map(sel, phys, &misses).ok());
  EXPECT_EQ(misses.size(), 4u) << "5 and 6 were prefetched";
  EXPECT_EQ((*ws)->hits(), 2u);
  EXPECT_EQ((*ws)->prefetch_used(), 2u);
  std::vector<uint32_t> named(phys.begin(), phys.end());
  // 4 free slots, then nothing else: all 6 held slots were named by the last Map.
  (*ws)->Prefetch(std::vector<int32_t>{20, 21, 22, 23, 24, 25, 26}, &ahead);
  ASSERT_EQ(ahead.size(), 4u);
  for (const auto& a : ahead) {
    EXPECT_EQ(std::count(named.begin(), named.end(), a.slot), 0) << "slot " << a.slot << " was named by the Map";
  }
  // A Map naming some of them: hits; then a Prefetch may take the rest (not named now), and
  // the entries of the last Map that the Map before named but this one did not.
  std::vector<int32_t> sel2 = {1, 20, 21}, phys2(3);
  ASSERT_TRUE((*ws)->Map(sel2, phys2, &misses).ok());
  EXPECT_TRUE(misses.empty());
  EXPECT_EQ((*ws)->prefetch_used(), 4u);
  (*ws)->Prefetch(std::vector<int32_t>{30, 31, 32, 33, 34, 35, 36, 37, 38}, &ahead);
  EXPECT_EQ(ahead.size(), 7u) << "10 slots, 3 named by the last Map";
  for (const auto& a : ahead) {
    EXPECT_EQ(std::count(phys2.begin(), phys2.end(), static_cast<int32_t>(a.slot)), 0);
  }
  EXPECT_EQ((*ws)->prefetched(), 2u + 4u + 7u);
  // Forget gives prefetched slots back; a later Map names their entries as misses.
  (*ws)->Forget(ahead);
  EXPECT_EQ((*ws)->held(), 3u);
  std::vector<int32_t> sel3 = {30}, phys3(1);
  ASSERT_TRUE((*ws)->Map(sel3, phys3, &misses).ok());
  EXPECT_EQ(misses.size(), 1u);
}

// Packing keeps every entry and only the entries: unpacked pages equal the pages packed, for
// each format the kernel reads; each entry fills one sector with room for its checksum; a
// record read under another key, or with one flipped bit, is refused.
TEST(SparseRecord, PacksEveryEntryIntoOneSectorAndBindsItToItsKey) {
  struct Shape {
    StorageFormat format;
    uint32_t dims, entries, per_sector, sectors;
  };
  for (const Shape& c : {Shape{StorageFormat::kFp8DsMla, 576, 128, 6, 22}, Shape{StorageFormat::kC8Mla, 576, 128, 6, 22},
                         Shape{StorageFormat::kBf16, 576, 128, 3, 43}, Shape{StorageFormat::kFp8V4, 512, 32, 6, 6}}) {
    SparseRecordLayout layout;
    layout.format = c.format;
    layout.dims = c.dims;
    layout.entries = c.entries;
    layout.layers = 3;
    layout.page_stride = (FormatPageBytes(c.format, c.dims, c.entries) + 63) / 64 * 64 + 64;
    ASSERT_TRUE(layout.Validate().ok());
    EXPECT_EQ(layout.entries_per_sector(), c.per_sector) << StorageFormatName(c.format);
    EXPECT_EQ(layout.sectors_per_layer(), c.sectors) << StorageFormatName(c.format);
    EXPECT_EQ(SparseRecordLayout::PadBytes() + BundleHeaderBytes(2), kSparseSectorBytes);
    for (uint32_t l = 0; l < layout.layers; ++l) {
      for (uint32_t s = 0; s < layout.entries; ++s) {
        const auto at = layout.Locate(l, s);
        ASSERT_EQ(at.sector % kSparseSectorBytes, 0u);
        ASSERT_LE(at.data + layout.entry_bytes(), at.checksum - (s % c.per_sector) * 8);
        ASSERT_LE(at.checksum + 8, kSparseSectorBytes);
      }
    }
    std::vector<std::byte> pages(layout.pages_bytes()), sectors(layout.sectors_bytes()), back(pages.size());
    std::mt19937 rng(3);
    auto codec = PageCodec::Create(c.format, c.dims, c.entries);
    ASSERT_TRUE(codec.ok());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> rows(uint64_t{c.entries} * c.dims);
    for (uint32_t l = 0; l < layout.layers; ++l) {
      for (float& x : rows) x = normal(rng);
      ASSERT_TRUE(codec->WriteTokens(pages.data() + l * layout.page_stride, 0, RowsView::Fp32(rows.data(), c.entries, c.dims)).ok());
    }
    ASSERT_TRUE(PackSparseRecord(layout, Key(1), pages, sectors).ok());
    ASSERT_TRUE(UnpackSparseRecord(layout, Key(1), sectors, back).ok());
    for (uint32_t l = 0; l < layout.layers; ++l) {
      const uint64_t page = FormatPageBytes(c.format, c.dims, c.entries);
      EXPECT_EQ(std::memcmp(back.data() + l * layout.page_stride, pages.data() + l * layout.page_stride, page), 0)
          << StorageFormatName(c.format) << " layer " << l;
    }
    EXPECT_EQ(UnpackSparseRecord(layout, Key(2), sectors, back).code(), StatusCode::kCorruption);
    const auto at = layout.Locate(2, c.entries - 1);
    sectors[at.sector + at.data + layout.entry_bytes() - 1] ^= std::byte{1};
    Status st = UnpackSparseRecord(layout, Key(1), sectors, back);
    EXPECT_EQ(st.code(), StatusCode::kCorruption);
    EXPECT_NE(st.ToString().find(fmt::format("entry {} of layer 2", c.entries - 1)), std::string::npos) << st.ToString();
    EXPECT_FALSE(PackSparseRecord(layout, Key(1), std::span<const std::byte>(pages).first(10), sectors).ok());
  }
}

// One sequence's caches for the decode test: the sparse cache as resident pool pages (block b
// at physical page table[b]) and as sparse records in a host tier; the indexer keys resident.
struct Sequence {
  SparseRecordLayout layout;
  std::vector<std::byte> pool;  // resident: physical block p at p * block_stride
  uint64_t block_stride = 0;
  std::vector<uint32_t> table;  // logical block -> physical block
  std::vector<attention::testing::TestCache> keys;  // per layer
  std::unique_ptr<HostTier> host;
  std::unique_ptr<testing::TempDir> dir;
  std::unique_ptr<SsdTier> ssd;  // when asked for: the same records on the SSD tier
  std::vector<BundleKey> blocks;
  // When asked for: an in-process sparsekvd holding the same entries as sparse values.
  std::unique_ptr<server::TieredStore> store;
  std::unique_ptr<server::Server> server;
  std::unique_ptr<Client> client;
  std::vector<WireBlockHash> wire_blocks;

  PagedCacheView ResidentView(uint32_t layer) const {
    PagedCacheView v;
    v.base = pool.data() + uint64_t{layer} * layout.page_stride;
    v.block_stride = block_stride;
    v.num_blocks = static_cast<uint32_t>(table.size());
    v.block_entries = layout.entries;
    v.dims = layout.dims;
    v.format = layout.format;
    return v;
  }
};

enum class Daemon { kNone, kHost, kOverSsd };

WireBlockHash WireKey(uint64_t block) {
  WireBlockHash h{};
  const BundleKey k = Key(block);
  std::memcpy(h.data(), &k.hash.lo, 8);
  std::memcpy(h.data() + 8, &k.hash.hi, 8);
  return h;
}

// A daemon in this process over a Unix socket: its host tier alone, or a host tier of 256 KiB
// over an SSD tier, so that most values are read from the SSD tier.
void StartDaemon(Sequence& s, Daemon daemon) {
  if (!s.dir) s.dir = std::make_unique<testing::TempDir>("sparse_daemon");
  server::TieredStoreOptions so;
  so.offload.host.capacity_bytes = daemon == Daemon::kOverSsd ? (256ull << 10) : (64ull << 20);
  so.offload.host.max_record_bytes = 256ull << 10;
  so.offload.host.huge_pages = false;
  if (daemon == Daemon::kOverSsd) {
    so.offload.ssd_enabled = true;
    so.offload.ssd.path = s.dir->path() + "/daemon_ssd";
    so.offload.ssd.capacity_bytes = 256ull << 20;
    so.offload.ssd.read_arena_bytes = 16ull << 20;
    so.offload.ssd.slab_grow_bytes = 16ull << 20;
    so.offload.ssd.durability = Durability::kNone;
  }
  auto store = server::TieredStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  s.store = std::move(*store);
  server::ServerOptions opts;
  opts.tcp_listen = "";
  opts.metrics_listen = "";
  opts.unix_path = s.dir->path() + "/d.sock";
  opts.namespaces = {{"sparse", "sparse-token"}};
  auto srv = server::Server::Start(opts, s.store.get());
  ASSERT_TRUE(srv.ok()) << srv.status().ToString();
  s.server = std::move(*srv);
  ClientOptions co;
  co.address = "unix:" + opts.unix_path;
  co.namespace_name = "sparse";
  co.token = "sparse-token";
  co.shared_memory = false;
  auto c = Client::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  s.client = std::move(*c);
}

Sequence MakeSequence(StorageFormat format, uint32_t dims, uint32_t entries, uint32_t layers, uint32_t blocks,
                      uint32_t key_entries, uint32_t seed, bool ssd = false, Daemon daemon = Daemon::kNone) {
  Sequence s;
  if (daemon != Daemon::kNone) {
    StartDaemon(s, daemon);
    EXPECT_NE(s.client, nullptr);
  }
  if (ssd) {
    s.dir = std::make_unique<testing::TempDir>("sparse");
    SsdTierOptions so;
    so.path = s.dir->path();
    so.capacity_bytes = 256ull << 20;
    so.slab_grow_bytes = 16 << 20;
    so.read_arena_bytes = 16 << 20;
    so.durability = Durability::kNone;
    auto t = SsdTier::Open(so);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (t.ok()) s.ssd = std::move(*t);
  }
  s.layout.format = format;
  s.layout.dims = dims;
  s.layout.entries = entries;
  s.layout.layers = layers;
  s.layout.page_stride = (FormatPageBytes(format, dims, entries) + 63) / 64 * 64;
  s.block_stride = s.layout.pages_bytes();
  s.pool.assign(s.block_stride * blocks, std::byte{0});
  s.table.resize(blocks);
  std::iota(s.table.begin(), s.table.end(), 0u);
  std::mt19937 rng(seed);
  std::shuffle(s.table.begin(), s.table.end(), rng);
  auto codec = PageCodec::Create(format, dims, entries);
  EXPECT_TRUE(codec.ok());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> rows(uint64_t{entries} * dims);
  HostTierOptions ho;
  ho.capacity_bytes = (s.layout.sectors_bytes() + 8192) * blocks + (1 << 20);
  ho.huge_pages = false;
  auto host = HostTier::Open(ho);
  EXPECT_TRUE(host.ok()) << host.status().ToString();
  s.host = std::move(*host);
  for (uint32_t b = 0; b < blocks; ++b) {
    std::byte* block = s.pool.data() + uint64_t{s.table[b]} * s.block_stride;
    for (uint32_t l = 0; l < layers; ++l) {
      for (float& x : rows) x = normal(rng);
      EXPECT_TRUE(codec->WriteTokens(block + l * s.layout.page_stride, 0, RowsView::Fp32(rows.data(), entries, dims)).ok());
    }
    s.blocks.push_back(Key(b));
    Status st = StoreSparseRecord(*s.host, Key(b), s.layout, {block, s.block_stride}, b + 1);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (s.ssd) {
      auto rec = MakeSparseRecord(Key(b), s.layout, {block, s.block_stride}, b + 1);
      EXPECT_TRUE(rec.ok()) << rec.status().ToString();
      if (rec.ok()) {
        EXPECT_TRUE(s.ssd->Put({*rec}).get()[0].ok());
      }
    }
    if (s.client) {
      s.wire_blocks.push_back(WireKey(b));
      auto value = MakeSparseValue(s.layout, WireKey(b), {block, s.block_stride});
      EXPECT_TRUE(value.ok()) << value.status().ToString();
      const BundleRef ref{WireKey(b), *value};
      auto put = s.client->Put(std::span<const BundleRef>(&ref, 1));
      EXPECT_TRUE(put.ok() && (*put)[0].ok());
    }
  }
  for (uint32_t l = 0; l < layers; ++l) {
    s.keys.push_back(attention::testing::MakeCache(StorageFormat::kIdxFp8, 128, key_entries, blocks, blocks, seed + 10 + l));
  }
  return s;
}

struct DecodeCase {
  const char* name;
  StorageFormat format;
  uint32_t dims;
  uint32_t entries;    // sparse cache entries per block
  uint32_t key_ratio;  // tokens per entry (V4 CSA: 4)
  uint32_t top_k;
  bool window;         // V4: a resident sliding-window source as `extra`
  bool ssd = false;    // the working set filled from the SSD tier, not the host tier
  Daemon daemon = Daemon::kNone;  // ... or from sparsekvd, with GET_RANGES
  // Each step also prefetches, on AsyncEntryFetcher's thread while the kernel reads the working
  // set, the entries after each selected one (a stand-in for the indexer's next-ranked).
  bool prefetch = false;
};

class SparseDecode : public ::testing::TestWithParam<DecodeCase> {};

// 256 decode steps over two layers: the indexer picks the top-k of the resident keys, a query
// drifting so that consecutive selections overlap; the kernel reads once the resident cache
// and once the working set filled from the host tier. Every output and LSE must be the same
// bits. The working set is the top-k exactly, so each step replaces what the last one named
// and did not name again.
TEST_P(SparseDecode, BitIdenticalToTheResidentCacheOver256Steps) {
  const DecodeCase c = GetParam();
  constexpr uint32_t kLayers = 2, kBlocks = 24, kHeads = 16, kIdxHeads = 8, kSteps = 256;
  Sequence seq =
      MakeSequence(c.format, c.dims, c.entries, kLayers, kBlocks, c.entries, 100 + c.entries, c.ssd, c.daemon);
  ASSERT_TRUE(!c.ssd || seq.ssd);
  ASSERT_TRUE(c.daemon == Daemon::kNone || seq.client);
  const uint64_t context_entries = uint64_t{kBlocks} * c.entries;
  ASSERT_GE(context_entries, c.top_k);
  LightningIndexerOptions io;
  io.top_k = c.top_k;
  auto indexer = LightningIndexer::Create(io);
  auto mla = SparseMla::Create(SparseMlaOptions{});
  ASSERT_TRUE(indexer.ok() && mla.ok());
  std::vector<std::unique_ptr<SparseWorkingSet>> ws;
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto w = SparseWorkingSet::Create(Options(c.format, c.dims, c.prefetch ? 2 * c.top_k : c.top_k));
    ASSERT_TRUE(w.ok());
    ws.push_back(std::move(*w));
  }
  HostEntryFetcher host_fetch(*seq.host, seq.layout, seq.blocks);
  std::unique_ptr<SsdEntryFetcher> ssd_fetch;
  if (c.ssd) ssd_fetch = std::make_unique<SsdEntryFetcher>(*seq.ssd, seq.layout, seq.blocks);
  std::unique_ptr<DaemonEntryFetcher> daemon_fetch;
  if (seq.client) daemon_fetch = std::make_unique<DaemonEntryFetcher>(*seq.client, seq.layout, seq.wire_blocks);
  // The prefetch's own fetcher (fetchers are used by one thread at a time), on its own thread.
  std::unique_ptr<HostEntryFetcher> host_ahead;
  std::unique_ptr<SsdEntryFetcher> ssd_ahead;
  std::unique_ptr<AsyncEntryFetcher> async;
  if (c.prefetch) {
    if (c.ssd) {
      ssd_ahead = std::make_unique<SsdEntryFetcher>(*seq.ssd, seq.layout, seq.blocks);
    } else {
      host_ahead = std::make_unique<HostEntryFetcher>(*seq.host, seq.layout, seq.blocks);
    }
    async = std::make_unique<AsyncEntryFetcher>(
        [&](uint32_t l, std::span<const SparseWorkingSet::Miss> m, SparseWorkingSet& w) {
          return ssd_ahead ? ssd_ahead->Fetch(l, m, w) : host_ahead->Fetch(l, m, w);
        });
  }
  uint64_t daemon_ssd_read0 = 0;
  if (c.daemon == Daemon::kOverSsd) {
    // Most values went down to the daemon's SSD tier, and stay there: GET_RANGES does not
    // bring them up.
    std::vector<WireBlockHash> all = seq.wire_blocks;
    auto lk = seq.client->Lookup(all);
    ASSERT_TRUE(lk.ok());
    EXPECT_GT(std::count(lk->tiers.begin(), lk->tiers.end(), BlockTier::kSsd), kBlocks / 2);
    daemon_ssd_read0 = seq.store->chain().tier(1).Stats().bytes_read;
  }
  // V4's window: 128 resident entries, all read each step.
  attention::testing::TestCache window;
  std::vector<int32_t> window_idx;
  if (c.window) {
    window = attention::testing::MakeCache(StorageFormat::kFp8V4, 512, 128, 1, 1, 77);
    for (uint32_t e = 0; e < 128; ++e) window_idx.push_back(window.Index(e));
  }
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> qi(kIdxHeads * 128), drift(qi.size()), weights(kIdxHeads);
  for (float& x : qi) x = normal(rng);
  for (float& w : weights) w = std::fabs(normal(rng)) + 0.1f;
  std::vector<uint32_t> key_table(kBlocks), identity(kBlocks);
  std::iota(identity.begin(), identity.end(), 0u);
  std::vector<int32_t> logical(c.top_k), physical(c.top_k), resident(c.top_k);
  std::vector<float> out_a(kHeads * 512), lse_a(kHeads), out_b(kHeads * 512), lse_b(kHeads);
  std::vector<SparseWorkingSet::Miss> misses;
  double overlap_sum = 0;
  std::vector<std::vector<int32_t>> last(kLayers);
  uint64_t hits0 = 0, misses0 = 0;
  for (uint32_t step = 0; step < kSteps; ++step) {
    if (step == 1) {
      for (const auto& w : ws) {
        hits0 += w->hits();
        misses0 += w->misses();
      }
    }
    for (float& x : drift) x = normal(rng);
    for (size_t i = 0; i < qi.size(); ++i) qi[i] = 0.99f * qi[i] + 0.12f * drift[i];
    for (uint32_t l = 0; l < kLayers; ++l) {
      const auto& keys = seq.keys[l];
      IndexerSequence is{keys.table, identity, c.entries};
      ASSERT_TRUE(Select(**indexer, keys.view, is, qi.data(), weights.data(), kIdxHeads,
                         context_entries * c.key_ratio - 1, c.key_ratio, logical.data())
                      .ok());
      if (!last[l].empty()) {
        std::vector<int32_t> a = last[l], b = logical;
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        std::vector<int32_t> both;
        std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
        overlap_sum += static_cast<double>(both.size()) / c.top_k;
      }
      last[l] = logical;
      for (uint32_t i = 0; i < c.top_k; ++i) {
        resident[i] = logical[i] < 0 ? -1 : PhysicalIndex(seq.table, c.entries, static_cast<uint64_t>(logical[i]));
      }
      if (async) {
        ASSERT_TRUE(async->Wait(*ws[l]).ok());
      }
      ASSERT_TRUE(ws[l]->Map(logical, physical, &misses).ok());
      Status st = daemon_fetch ? daemon_fetch->Fetch(l, misses, *ws[l])
                  : c.ssd      ? ssd_fetch->Fetch(l, misses, *ws[l])
                               : host_fetch.Fetch(l, misses, *ws[l]);
      ASSERT_TRUE(st.ok()) << st.ToString();
      if (async) {
        std::vector<int32_t> next;
        for (int32_t e : logical) {
          if (e >= 0 && static_cast<uint64_t>(e) + 1 < context_entries) next.push_back(e + 1);
        }
        std::vector<SparseWorkingSet::Miss> ahead;
        ws[l]->Prefetch(next, &ahead);
        async->Start(l, std::move(ahead), *ws[l]);  // filled while the kernel reads below
      }
      const auto q = attention::testing::RandomBf16(uint64_t{kHeads} * c.dims, step * 31 + l);
      SparseMlaBatch mb;
      mb.q = q.data();
      mb.tokens = 1;
      mb.heads = kHeads;
      mb.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.dims));
      mb.main = Source(seq.ResidentView(l), resident.data(), c.top_k);
      if (c.window) mb.extra = Source(window.view, window_idx.data(), 128);
      ASSERT_TRUE((*mla)->Run(mb, {out_a.data(), lse_a.data()}).ok());
      mb.main = Source(ws[l]->view(), physical.data(), c.top_k);
      ASSERT_TRUE((*mla)->Run(mb, {out_b.data(), lse_b.data()}).ok());
      ASSERT_EQ(std::memcmp(out_a.data(), out_b.data(), out_a.size() * 4), 0) << "step " << step << " layer " << l;
      ASSERT_EQ(std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * 4), 0) << "step " << step << " layer " << l;
    }
  }
  const double overlap = overlap_sum / ((kSteps - 1) * kLayers);
  // The drift keeps most of a selection from one step to the next, and replaces some of it.
  std::printf("%s: mean overlap of consecutive selections %.3f\n", c.name, overlap);
  EXPECT_GT(overlap, 0.5) << c.name;
  EXPECT_LT(overlap, 0.999) << c.name;
  // With room for exactly top-k, a step fetches just what the last one did not select.
  uint64_t hit_count = 0, miss_count = 0;
  for (const auto& w : ws) {
    hit_count += w->hits();
    miss_count += w->misses();
  }
  const double hit_ratio =
      static_cast<double>(hit_count - hits0) / static_cast<double>(hit_count - hits0 + miss_count - misses0);
  if (c.prefetch) {
    // Prefetched entries that a later selection named count as hits.
    uint64_t used = 0;
    for (const auto& w : ws) used += w->prefetch_used();
    EXPECT_GT(used, 0u) << c.name;
    EXPECT_GE(hit_ratio, overlap) << c.name;
  } else {
    EXPECT_NEAR(hit_ratio, overlap, 1e-9) << c.name;
  }
  EXPECT_GT(daemon_fetch ? daemon_fetch->bytes_fetched()
            : c.ssd      ? ssd_fetch->bytes_fetched()
                         : host_fetch.bytes_fetched(),
            0u);
  if (c.ssd) {
    // One sector per entry at most, and fewer when entries share one.
    EXPECT_LE(ssd_fetch->sectors_read() * seq.layout.entry_bytes(), ssd_fetch->bytes_fetched());
  }
  if (daemon_fetch) {
    // Over the socket: each entry and its checksum, nothing more.
    EXPECT_EQ(daemon_fetch->bytes_requested(), daemon_fetch->bytes_fetched() / seq.layout.entry_bytes() *
                                                    (seq.layout.entry_bytes() + 8));
  }
  if (c.daemon == Daemon::kOverSsd) {
    // The daemon read sectors, not records: at most one 4 KiB sector per entry it served.
    const uint64_t read = seq.store->chain().tier(1).Stats().bytes_read - daemon_ssd_read0;
    EXPECT_GT(read, 0u);
    EXPECT_LE(read, daemon_fetch->bytes_fetched() / seq.layout.entry_bytes() * kSparseSectorBytes);
    std::printf("%s: the daemon's SSD tier read %.2f MB for %.2f MB of entries\n", c.name, read / 1e6,
                daemon_fetch->bytes_fetched() / 1e6);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Presets, SparseDecode,
    ::testing::Values(DecodeCase{"v32_fp8", StorageFormat::kFp8DsMla, 576, 128, 1, 256, false},
                      DecodeCase{"v32_c8", StorageFormat::kC8Mla, 576, 128, 1, 256, false},
                      DecodeCase{"v4_csa", StorageFormat::kFp8V4, 512, 32, 4, 128, true},
                      DecodeCase{"v32_fp8_ssd", StorageFormat::kFp8DsMla, 576, 128, 1, 256, false, true},
                      DecodeCase{"v4_csa_ssd", StorageFormat::kFp8V4, 512, 32, 4, 128, true, true},
                      DecodeCase{"v32_fp8_daemon", StorageFormat::kFp8DsMla, 576, 128, 1, 256, false, false,
                                 Daemon::kHost},
                      DecodeCase{"v32_fp8_daemon_ssd", StorageFormat::kFp8DsMla, 576, 128, 1, 256, false, false,
                                 Daemon::kOverSsd},
                      DecodeCase{"v4_csa_daemon_ssd", StorageFormat::kFp8V4, 512, 32, 4, 128, true, false,
                                 Daemon::kOverSsd},
                      DecodeCase{"v32_fp8_prefetch", StorageFormat::kFp8DsMla, 576, 128, 1, 256, false, false,
                                 Daemon::kNone, true},
                      DecodeCase{"v4_csa_ssd_prefetch", StorageFormat::kFp8V4, 512, 32, 4, 128, true, true,
                                 Daemon::kNone, true}),
    [](const auto& info) { return std::string(info.param.name); });

// A record damaged in host memory is refused for the entry that was damaged, and that entry is
// not held afterwards (the next selection names it as a miss again); a record gone from the
// tier is NotFound, never an error of the kernel.
TEST(HostEntryFetcher, ADamagedOrMissingRecordIsRefusedEntryByEntry) {
  Sequence seq = MakeSequence(StorageFormat::kFp8DsMla, 576, 128, 2, 4, 128, 3);
  auto ws = SparseWorkingSet::Create(Options(StorageFormat::kFp8DsMla, 576, 64));
  ASSERT_TRUE(ws.ok());
  HostEntryFetcher fetch(*seq.host, seq.layout, seq.blocks);
  // Damage entry 5 of block 1 (logical entry 133), layer 1, in the tier's own memory.
  {
    auto rec = seq.host->GetPinned(Key(1), /*check=*/false);
    ASSERT_TRUE(rec.ok());
    const SparseRecordLayout::Place at = seq.layout.Locate(1, 5);
    auto* sectors = const_cast<std::byte*>((*rec)->segment(1).data());
    sectors[at.sector + at.data + 100] ^= std::byte{0x40};
  }
  std::vector<int32_t> sel = {3, 133, 200}, phys(3);
  std::vector<SparseWorkingSet::Miss> misses;
  ASSERT_TRUE((*ws)->Map(sel, phys, &misses).ok());
  Status st = fetch.Fetch(1, misses, **ws);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.ToString().find("entry 133"), std::string::npos) << st.ToString();
  ASSERT_TRUE((*ws)->Map(sel, phys, &misses).ok());
  ASSERT_EQ(misses.size(), 1u) << "only the damaged entry is fetched again";
  EXPECT_EQ(misses[0].entry, 133u);
  // Layer 0 of the same block is intact: its entries pass.
  EXPECT_TRUE(fetch.Fetch(0, misses, **ws).ok());
  // A record gone from the tier.
  ASSERT_TRUE(seq.host->Erase({Key(3)}).get()[0].ok());
  std::vector<int32_t> gone = {400}, phys1(1);
  ASSERT_TRUE((*ws)->Map(gone, phys1, &misses).ok());
  st = fetch.Fetch(0, misses, **ws);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  ASSERT_TRUE((*ws)->Map(gone, phys1, &misses).ok());
  EXPECT_EQ(misses.size(), 1u);
  // An entry past the sequence's blocks.
  std::vector<int32_t> past = {4 * 128}, phys2(1);
  ASSERT_TRUE((*ws)->Map(past, phys2, &misses).ok());
  EXPECT_EQ(fetch.Fetch(0, misses, **ws).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sparsekv

namespace sparsekv {
namespace {

// From the SSD tier: a sector damaged on disk refuses the entries it holds and only those (the
// rest of the batch is brought), and a record gone is NotFound for its entries.
TEST(SsdEntryFetcher, ADamagedSectorRefusesItsEntriesOnly) {
  Sequence seq = MakeSequence(StorageFormat::kFp8DsMla, 576, 128, 2, 4, 128, 5, /*ssd=*/true);
  ASSERT_NE(seq.ssd, nullptr);
  auto ws = SparseWorkingSet::Create(Options(StorageFormat::kFp8DsMla, 576, 64));
  ASSERT_TRUE(ws.ok());
  SsdEntryFetcher fetch(*seq.ssd, seq.layout, seq.blocks);
  // Entry 7 of block 2 (logical 263), layer 1: flip a byte of it in the data file.
  auto loc = seq.ssd->Locate(Key(2));
  ASSERT_TRUE(loc.ok());
  const SparseRecordLayout::Place at = seq.layout.Locate(1, 7);
  {
    const int fd = ::open(loc->file.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t where = static_cast<off_t>(loc->offset + kSparseSectorBytes + at.sector + at.data + 10);
    std::byte b;
    ASSERT_EQ(::pread(fd, &b, 1, where), 1);
    b ^= std::byte{0x10};
    ASSERT_EQ(::pwrite(fd, &b, 1, where), 1);
    ::close(fd);
  }
  // 263 shares its sector with 264 (6 per sector: slots 6..11); 12 lies in the next one.
  std::vector<int32_t> sel = {5, 263, 264, 268, 140}, phys(5);
  std::vector<SparseWorkingSet::Miss> misses;
  ASSERT_TRUE((*ws)->Map(sel, phys, &misses).ok());
  Status st = fetch.Fetch(1, misses, **ws);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.ToString().find("entry 263"), std::string::npos) << st.ToString();
  EXPECT_EQ(fetch.sectors_read(), 4u) << "5 entries in 4 sectors";
  ASSERT_TRUE((*ws)->Map(sel, phys, &misses).ok());
  ASSERT_EQ(misses.size(), 1u) << "only the damaged entry is fetched again";
  EXPECT_EQ(misses[0].entry, 263u);
  (*ws)->Forget(misses);
  // The same entries of layer 0 are intact, and come back as the resident pages hold them.
  auto ws0 = SparseWorkingSet::Create(Options(StorageFormat::kFp8DsMla, 576, 64));
  ASSERT_TRUE(ws0.ok());
  ASSERT_TRUE((*ws0)->Map(sel, phys, &misses).ok());
  ASSERT_EQ(misses.size(), sel.size());
  ASSERT_TRUE(fetch.Fetch(0, misses, **ws0).ok());
  for (size_t i = 0; i < sel.size(); ++i) {
    const uint64_t e = static_cast<uint64_t>(sel[i]);
    const std::byte* want = seq.pool.data() + uint64_t{seq.table[e / 128]} * seq.block_stride + (e % 128) * 656;
    const std::byte* got = (*ws0)->SlotPage(static_cast<uint32_t>(phys[i])) +
                           uint64_t{(*ws0)->SlotInPage(static_cast<uint32_t>(phys[i]))} * 656;
    EXPECT_EQ(std::memcmp(want, got, 656), 0) << "entry " << e;
  }
  ASSERT_TRUE(seq.ssd->Erase({Key(3)}).get()[0].ok());
  std::vector<int32_t> gone = {400, 6}, phys2(2);
  ASSERT_TRUE((*ws)->Map(gone, phys2, &misses).ok());
  st = fetch.Fetch(0, misses, **ws);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  ASSERT_TRUE((*ws)->Map(gone, phys2, &misses).ok());
  ASSERT_EQ(misses.size(), 1u);
  EXPECT_EQ(misses[0].entry, 400u);
}

}  // namespace
}  // namespace sparsekv

namespace sparsekv {
namespace {

// Prefix caching with the sparse cache offloaded: an engine whose L1 keeps only the resident
// kinds (SplitSparseModel) computes a prompt, storing the selection-read kinds as sparse
// records under the blocks' digests; a second engine over the same tiers (an empty L1) finds the
// prefix, restores only the resident kinds, and decodes from the records through a working set
// with outputs bit-identical to reading the whole latent cache.
struct PrefixCase {
  const char* name;
  const char* model;
  uint32_t layers;        // the preset's first layers
  uint32_t block_tokens;
  uint32_t top_k;
};

class SparsePrefix : public ::testing::TestWithParam<PrefixCase> {};

TEST_P(SparsePrefix, ARestoredPrefixBringsBackOnlyTheResidentKindsAndDecodesBitIdentical) {
  const PrefixCase c = GetParam();
  constexpr uint32_t kBlocks = 8, kSparseNs = 9, kHeads = 16, kIdxHeads = 8, kSteps = 24;
  auto full = ModelPreset(c.model, KvPrecision::kFp8);
  ASSERT_TRUE(full.ok());
  full->layers.resize(c.layers);
  auto split = SplitSparseModel(*full, c.block_tokens);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  ASSERT_EQ(split->records.size(), 1u);
  const SparseRecordLayout& layout = split->records[0];
  auto full_geometry = ComputeBlockGeometry(*full, c.block_tokens);
  ASSERT_TRUE(full_geometry.ok());

  HostTierOptions ho;
  ho.capacity_bytes = 64ull << 20;
  ho.max_record_bytes = 8ull << 20;
  ho.huge_pages = false;
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(HostTier::Open(ho).value());
  auto* host = dynamic_cast<HostTier*>(tiers[0].get());
  TierChain chain(std::move(tiers), TierChainOptions{});
  auto engine = [&] {
    CacheManagerOptions mo;
    mo.block_tokens = c.block_tokens;
    mo.capacity_blocks = 2 * kBlocks;
    mo.huge_pages = false;
    auto m = CacheManager::Create(split->resident, mo);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return std::move(m).value();
  };
  std::vector<TokenId> prompt(kBlocks * c.block_tokens + 1);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(77 + 13 * i);
  const int key_pool = [&] {
    auto g = ComputeBlockGeometry(split->resident, c.block_tokens);
    EXPECT_TRUE(g.ok());
    for (size_t p = 0; g.ok() && p < g->pools.size(); ++p) {
      if (g->pools[p].spec.kind == CacheKind::kIndexerKey) return static_cast<int>(p);
    }
    return -1;
  }();
  ASSERT_GE(key_pool, 0);

  // The first engine computes the prompt: valid entries in every page it keeps (codec-written
  // for the indexer keys, which the indexer reads), and the latent as sparse records.
  std::vector<std::byte> latent(layout.pages_bytes() * kBlocks);  // block b at b * pages_bytes
  std::vector<std::vector<std::byte>> keys_before;
  std::vector<BlockDigest> digests;
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  {
    auto m = engine();
    OffloadedCache cache(*m, chain);
    auto seq = cache.CreateSequence();
    ASSERT_TRUE(seq.ok());
    ASSERT_TRUE(cache.AppendTokens(*seq, prompt).ok());
    ASSERT_TRUE(cache.AcquirePrefix(*seq).ok());
    ASSERT_TRUE(m->AllocateSlots(*seq, prompt.size()).ok());
    for (size_t p = 0; p < m->num_pools(); ++p) {
      const PoolGeometry& g = m->geometry().pools[p];
      std::vector<PageId> table;
      ASSERT_TRUE(m->GetBlockTable(*seq, p, &table).ok());
      auto codec = PageCodec::Create(g.spec.format, g.spec.dims, g.entries_per_block);
      for (PageId page : table) {
        std::byte* d = m->pool(p).PageData(page);
        for (size_t l = 0; l < g.layers.size(); ++l) {
          if (g.spec.kind == CacheKind::kIndexerKey && codec.ok()) {
            std::vector<float> rows(uint64_t{g.entries_per_block} * g.spec.dims);
            for (float& x : rows) x = normal(rng);
            ASSERT_TRUE(codec->WriteTokens(d + l * g.layer_stride, 0,
                                           RowsView::Fp32(rows.data(), g.entries_per_block, g.spec.dims))
                            .ok());
          } else {
            for (uint64_t i = 0; i < g.layer_stride; ++i) d[l * g.layer_stride + i] = std::byte(rng());
          }
        }
      }
    }
    digests = cache.BlockDigests(*seq).value();
    ASSERT_EQ(digests.size(), kBlocks);
    auto codec = PageCodec::Create(layout.format, layout.dims, layout.entries);
    ASSERT_TRUE(codec.ok());
    std::vector<float> rows(uint64_t{layout.entries} * layout.dims);
    for (uint32_t b = 0; b < kBlocks; ++b) {
      std::byte* pages = latent.data() + b * layout.pages_bytes();
      for (uint32_t l = 0; l < layout.layers; ++l) {
        for (float& x : rows) x = normal(rng);
        ASSERT_TRUE(codec->WriteTokens(pages + l * layout.page_stride, 0,
                                       RowsView::Fp32(rows.data(), layout.entries, layout.dims))
                        .ok());
      }
      ASSERT_TRUE(StoreSparseRecord(*host, SparseRecordKey(kSparseNs, digests[b], 0), layout,
                                    {pages, layout.pages_bytes()}, chain.NextSequence())
                      .ok());
    }
    std::vector<PageId> table;
    ASSERT_TRUE(m->GetBlockTable(*seq, key_pool, &table).ok());
    for (uint32_t b = 0; b < kBlocks; ++b) {
      const std::byte* d = m->pool(key_pool).PageData(table[b]);
      keys_before.emplace_back(d, d + m->geometry().pools[key_pool].block_stride);
    }
    ASSERT_TRUE(cache.CommitComputed(*seq, prompt.size()).ok());
    ASSERT_TRUE(cache.Free(*seq).ok());
    cache.WaitIdle();
    EXPECT_EQ(cache.Stats().demoted_blocks, kBlocks);
  }

  // The second engine: an empty L1 over the same tiers.
  auto m = engine();
  OffloadedCache cache(*m, chain);
  auto seq = cache.CreateSequence();
  ASSERT_TRUE(cache.AppendTokens(*seq, prompt).ok());
  const uint64_t host_read0 = chain.tier(0).Stats().bytes_read;
  auto hit = cache.AcquirePrefix(*seq);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  EXPECT_EQ(hit->lower_blocks, kBlocks);
  EXPECT_EQ(cache.BlockDigests(*seq).value(), digests);
  // Only the resident kinds came back: L1 holds no latent page, and the restore read the
  // resident bundles' bytes, not the records'.
  const uint64_t resident_block = m->geometry().BytesPerBlock();
  EXPECT_EQ(resident_block + uint64_t{layout.layers} * layout.page_stride, full_geometry->BytesPerBlock());
  for (const PoolGeometry& g : m->geometry().pools) {
    EXPECT_NE(g.spec.kind, layout.format == StorageFormat::kFp8V4 ? CacheKind::kCsaCompressed : CacheKind::kMlaLatent);
  }
  const uint64_t restored = chain.tier(0).Stats().bytes_read - host_read0;
  EXPECT_LE(restored, kBlocks * (resident_block + 4096)) << "more than the resident kinds were read";
  std::printf("%s: restored %.1f KiB per block of %.1f KiB (%.3f of the full block)\n", c.name,
              restored / 1024.0 / kBlocks, full_geometry->BytesPerBlock() / 1024.0,
              static_cast<double>(resident_block) / static_cast<double>(full_geometry->BytesPerBlock()));
  std::vector<PageId> key_table;
  ASSERT_TRUE(m->GetBlockTable(*seq, key_pool, &key_table).ok());
  const PoolGeometry& kg = m->geometry().pools[key_pool];
  for (uint32_t b = 0; b < kBlocks; ++b) {
    const std::byte* d = m->pool(key_pool).PageData(key_table[b]);
    ASSERT_TRUE(std::equal(keys_before[b].begin(), keys_before[b].end(), d)) << "indexer keys of block " << b;
  }
  ASSERT_EQ(m->pool(key_pool).PageData(1) - m->pool(key_pool).PageData(0), static_cast<ptrdiff_t>(kg.block_stride));

  // Decode: the indexer over the restored keys, the kernel over the working set filled from the
  // records, against the kernel over the latent pages as computed.
  LightningIndexerOptions io;
  io.top_k = c.top_k;
  auto indexer = LightningIndexer::Create(io);
  auto mla = SparseMla::Create(SparseMlaOptions{});
  ASSERT_TRUE(indexer.ok() && mla.ok());
  std::vector<BundleKey> record_keys;
  for (const BlockDigest& d : digests) record_keys.push_back(SparseRecordKey(kSparseNs, d, 0));
  HostEntryFetcher fetch(*host, layout, record_keys);
  std::vector<uint32_t> identity(kBlocks);
  std::iota(identity.begin(), identity.end(), 0u);
  const uint32_t key_ratio = c.block_tokens / kg.entries_per_block;
  std::vector<float> qi(kIdxHeads * kg.spec.dims), weights(kIdxHeads);
  for (float& x : qi) x = normal(rng);
  for (float& w : weights) w = std::fabs(normal(rng)) + 0.1f;
  std::vector<int32_t> logical(c.top_k), physical(c.top_k);
  std::vector<float> out_a(kHeads * 512), lse_a(kHeads), out_b(kHeads * 512), lse_b(kHeads);
  std::vector<SparseWorkingSet::Miss> misses;
  for (uint32_t l = 0; l < layout.layers; ++l) {
    auto ws = SparseWorkingSet::Create(Options(layout.format, layout.dims, 2 * c.top_k));
    ASSERT_TRUE(ws.ok());
    // The key pool's slot for the same model layer as the latent pool's slot l.
    const PoolGeometry* latent_pool = nullptr;
    for (const PoolGeometry& g : full_geometry->pools) {
      if (g.spec.kind == CacheKind::kMlaLatent || g.spec.kind == CacheKind::kCsaCompressed) latent_pool = &g;
    }
    ASSERT_NE(latent_pool, nullptr);
    const int key_slot = kg.LayerSlot(latent_pool->layers[l]);
    ASSERT_GE(key_slot, 0);
    PagedCacheView keys{m->pool(key_pool).PageData(0) + uint64_t(key_slot) * kg.layer_stride, kg.block_stride,
                        m->pool(key_pool).capacity(), kg.entries_per_block, kg.spec.dims, kg.spec.format};
    PagedCacheView resident{latent.data() + uint64_t{l} * layout.page_stride, layout.pages_bytes(), kBlocks,
                            layout.entries, layout.dims, layout.format};
    for (uint32_t step = 0; step < kSteps; ++step) {
      for (float& x : qi) x = 0.98f * x + 0.2f * normal(rng);
      IndexerSequence is{key_table, identity, layout.entries};
      ASSERT_TRUE(Select(**indexer, keys, is, qi.data(), weights.data(), kIdxHeads,
                         uint64_t{kBlocks} * c.block_tokens - 1, key_ratio, logical.data())
                      .ok());
      ASSERT_TRUE((*ws)->Map(logical, physical, &misses).ok());
      Status st = fetch.Fetch(l, misses, **ws);
      ASSERT_TRUE(st.ok()) << st.ToString();
      const auto q = attention::testing::RandomBf16(uint64_t{kHeads} * layout.dims, step * 7 + l);
      SparseMlaBatch mb;
      mb.q = q.data();
      mb.tokens = 1;
      mb.heads = kHeads;
      mb.softmax_scale = 1.0f / std::sqrt(static_cast<float>(layout.dims));
      mb.main = Source(resident, logical.data(), c.top_k);
      ASSERT_TRUE((*mla)->Run(mb, {out_a.data(), lse_a.data()}).ok());
      mb.main = Source((*ws)->view(), physical.data(), c.top_k);
      ASSERT_TRUE((*mla)->Run(mb, {out_b.data(), lse_b.data()}).ok());
      ASSERT_EQ(std::memcmp(out_a.data(), out_b.data(), out_a.size() * 4), 0) << "layer " << l << " step " << step;
      ASSERT_EQ(std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * 4), 0) << "layer " << l << " step " << step;
    }
  }
  ASSERT_TRUE(cache.Free(*seq).ok());
}

INSTANTIATE_TEST_SUITE_P(Models, SparsePrefix,
                         ::testing::Values(PrefixCase{"v32", "deepseek-v3.2-exp", 2, 64, 256},
                                           PrefixCase{"v4", "deepseek-v4-flash", 5, 128, 128}),
                         [](const auto& info) { return std::string(info.param.name); });

// What the split keeps and refuses.
TEST(SparseModelSplit, KeepsTheResidentKindsAndRefusesAModelWithNothingToOffload) {
  auto v32 = ModelPreset("deepseek-v3.2-exp", KvPrecision::kFp8);
  ASSERT_TRUE(v32.ok());
  auto split = SplitSparseModel(*v32, 64);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  ASSERT_EQ(split->resident.layers.size(), v32->layers.size());
  for (const LayerSpec& l : split->resident.layers) {
    ASSERT_EQ(l.kinds.size(), 1u);
    EXPECT_EQ(l.kinds[0].kind, CacheKind::kIndexerKey);
  }
  EXPECT_EQ(split->kinds[0].kind, CacheKind::kMlaLatent);
  EXPECT_EQ(split->records[0].layers, v32->layers.size());
  EXPECT_EQ(split->records[0].entry_bytes(), 656u);
  auto v4 = ModelPreset("deepseek-v4-flash", KvPrecision::kFp8);
  ASSERT_TRUE(v4.ok());
  auto s4 = SplitSparseModel(*v4, 128);
  ASSERT_TRUE(s4.ok()) << s4.status().ToString();
  EXPECT_EQ(s4->kinds[0].kind, CacheKind::kCsaCompressed);
  // What a prefix hit restores per block, whole models.
  for (const auto& [spec, split_spec, bt] : {std::tuple{&*v32, &split->resident, 64u}, std::tuple{&*v4, &s4->resident, 128u}}) {
    const uint64_t all = ComputeBlockGeometry(*spec, bt)->BytesPerBlock();
    const uint64_t kept = ComputeBlockGeometry(*split_spec, bt)->BytesPerBlock();
    EXPECT_LT(kept, all);
    std::printf("%s, %u-token blocks: a prefix hit restores %llu of %llu bytes per block (%.3f)\n", spec->name.c_str(), bt,
                static_cast<unsigned long long>(kept), static_cast<unsigned long long>(all),
                static_cast<double>(kept) / static_cast<double>(all));
  }
  for (const LayerSpec& l : s4->resident.layers) {
    for (const KindSpec& k : l.kinds) EXPECT_NE(k.kind, CacheKind::kCsaCompressed);
  }
  // The first two V4 layers keep only a window: nothing there is read by selection.
  ModelSpec window_only = *v4;
  window_only.layers.resize(2);
  auto none = SplitSparseModel(window_only, 128);
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().ToString().find("no kind is read by selection"), std::string::npos);
  // A latent in a layer without an indexer is read whole (dense MLA); one pool cannot be both
  // in L1 and offloaded, so a model mixing the two in one pool is refused, by name.
  ModelSpec mixed = *v32;
  mixed.layers.resize(2);
  std::erase_if(mixed.layers[1].kinds, [](const KindSpec& k) { return k.kind == CacheKind::kIndexerKey; });
  auto sm = SplitSparseModel(mixed, 64);
  EXPECT_EQ(sm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(sm.status().ToString().find("layer 1"), std::string::npos) << sm.status().ToString();
  // Distinct kinds of one block get distinct record keys, and the bundles' key is not one.
  const BlockDigest d{{1, 2}, {3, 4}};
  EXPECT_FALSE(SparseRecordKey(5, d, 0) == SparseRecordKey(5, d, 1));
  EXPECT_FALSE(SparseRecordKey(5, d, 0).hash == d.hash);
}

}  // namespace
}  // namespace sparsekv
