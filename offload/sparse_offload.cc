#include "sparsekv/sparse_offload.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "allocator/xxhash_dispatch.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/ssd_tier.h"

namespace sparsekv {
namespace {

constexpr uint64_t kFree = std::numeric_limits<uint64_t>::max();

bool KernelFormat(StorageFormat f) {
  return f == StorageFormat::kFp8DsMla || f == StorageFormat::kC8Mla || f == StorageFormat::kBf16 ||
         f == StorageFormat::kFp8V4;
}

uint64_t EntrySeed(const BundleKey& key, uint32_t layer, uint32_t slot) {
  return (key.hash.lo * 0x9e3779b97f4a7c15ull) ^ key.hash.hi ^ (uint64_t{key.namespace_id} << 40) ^
         (((uint64_t{layer} << 32) | slot) * 0xc2b2ae3d27d4eb4full);
}

// Copies an entry between a page and its packed form (ranges back to back).
void PageToPacked(const std::byte* page, const EntryRanges& r, std::byte* packed) {
  for (uint32_t i = 0; i < r.count; ++i) {
    std::memcpy(packed, page + r.offset[i], r.bytes[i]);
    packed += r.bytes[i];
  }
}
void PackedToPage(const std::byte* packed, const EntryRanges& r, std::byte* page) {
  for (uint32_t i = 0; i < r.count; ++i) {
    std::memcpy(page + r.offset[i], packed, r.bytes[i]);
    packed += r.bytes[i];
  }
}

}  // namespace

EntryRanges EntryByteRanges(StorageFormat format, uint32_t dims, uint32_t entries, uint32_t slot) {
  EntryRanges r;
  switch (format) {
    case StorageFormat::kFp8V4:
      r.count = 2;
      r.offset = {layout::Fp8V4DataOffset(slot), layout::Fp8V4ScaleOffset(entries, slot)};
      r.bytes = {layout::kV4DataBytes, layout::kV4ScaleBytes};
      return r;
    case StorageFormat::kIdxFp8:
    case StorageFormat::kIdxC8:
      r.count = 2;
      r.offset = {layout::IdxValueOffset(dims, slot), layout::IdxScaleOffset(dims, entries, slot)};
      r.bytes = {dims, layout::kIdxScaleBytes};
      return r;
    default: {
      const uint64_t bytes = FormatEntryBytes(format, dims);
      r.count = 1;
      r.offset = {uint64_t{slot} * bytes, 0};
      r.bytes = {static_cast<uint32_t>(bytes), 0};
      return r;
    }
  }
}

SparseRecordLayout SparseRecordLayout::ForPool(const PoolGeometry& pool) {
  SparseRecordLayout l;
  l.format = pool.spec.format;
  l.dims = pool.spec.dims;
  l.entries = pool.entries_per_block;
  l.layers = static_cast<uint32_t>(pool.layers.size());
  l.page_stride = pool.layer_stride;
  return l;
}

Result<SparseModelSplit> SplitSparseModel(const ModelSpec& spec, uint32_t block_tokens) {
  SPARSEKV_RETURN_IF_ERROR(spec.Validate());
  SPARSEKV_ASSIGN_OR_RETURN(BlockGeometry geometry, ComputeBlockGeometry(spec, block_tokens));
  auto selected = [&](const LayerSpec& layer, const KindSpec& k) {
    if (k.kind != CacheKind::kMlaLatent && k.kind != CacheKind::kCsaCompressed) return false;
    return std::any_of(layer.kinds.begin(), layer.kinds.end(),
                       [](const KindSpec& o) { return o.kind == CacheKind::kIndexerKey; });
  };
  SparseModelSplit out;
  out.resident = spec;
  out.resident.name = spec.name + "/resident";
  // (The pools are checked below; a layer's kinds here.)
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    std::vector<KindSpec>& kinds = out.resident.layers[l].kinds;
    kinds.clear();
    // A selected kind's layer keeps its indexer keys, so no layer is left empty.
    for (const KindSpec& k : spec.layers[l].kinds) {
      if (!selected(spec.layers[l], k)) kinds.push_back(k);
    }
  }
  for (const PoolGeometry& pool : geometry.pools) {
    if (pool.layers.empty() || !selected(spec.layers[pool.layers[0]], pool.spec)) {
      for (uint32_t l : pool.layers) {
        if (selected(spec.layers[l], pool.spec)) {
          return Status::InvalidArgument(fmt::format(
              "sparse split of {}: {} is read by selection in layer {} and whole in layer {}, which share a pool",
              spec.name, CacheKindName(pool.spec.kind), l, pool.layers[0]));
        }
      }
      continue;
    }
    for (uint32_t l : pool.layers) {
      if (!selected(spec.layers[l], pool.spec)) {
        return Status::InvalidArgument(fmt::format(
            "sparse split of {}: {} is read by selection in layer {} and whole in layer {}, which share a pool",
            spec.name, CacheKindName(pool.spec.kind), pool.layers[0], l));
      }
    }
    SparseRecordLayout layout = SparseRecordLayout::ForPool(pool);
    SPARSEKV_RETURN_IF_ERROR(layout.Validate().WithContext(fmt::format("sparse split of {}", spec.name)));
    out.kinds.push_back(pool.spec);
    out.records.push_back(layout);
  }
  if (out.records.empty()) {
    return Status::InvalidArgument(
        fmt::format("sparse split of {}: no kind is read by selection (an MLA latent or CSA cache in a layer with "
                    "an indexer)",
                    spec.name));
  }
  SPARSEKV_RETURN_IF_ERROR(out.resident.Validate());
  return out;
}

BundleKey SparseRecordKey(uint32_t namespace_id, const BlockDigest& digest, uint32_t kind_index) {
  // The digest's hash with the kind folded into its high half: still unique per block and kind.
  BundleKey key{namespace_id, digest.hash};
  key.hash.hi ^= (uint64_t{kind_index} + 1) * 0x9e3779b97f4a7c15ull;
  return key;
}

Status SparseRecordLayout::Validate() const {
  if (!KernelFormat(format)) {
    return Status::InvalidArgument(fmt::format("sparse record: {} is not a format the sparse kernel reads",
                                               StorageFormatName(format)));
  }
  if (dims == 0 || entries == 0 || layers == 0) {
    return Status::InvalidArgument("sparse record: dims, entries and layers must be at least 1");
  }
  const uint32_t want = format == StorageFormat::kFp8V4 ? layout::kV4Dims
                        : format == StorageFormat::kBf16 ? dims
                                                         : layout::kMlaDims;
  if (dims != want || dims > 2040) {
    return Status::InvalidArgument(fmt::format("sparse record: {} entries of {} dims do not fit a sector",
                                               StorageFormatName(format), dims));
  }
  if (entry_bytes() + 8 > kSparseSectorBytes) {
    return Status::InvalidArgument("sparse record: an entry and its checksum do not fit a 4 KiB sector");
  }
  if (page_stride < FormatPageBytes(format, dims, entries)) {
    return Status::InvalidArgument(fmt::format("sparse record: a page stride of {} bytes is below a {}-byte page",
                                               page_stride, FormatPageBytes(format, dims, entries)));
  }
  return Status::OK();
}

uint32_t SparseRecordLayout::entry_bytes() const {
  const EntryRanges r = EntryByteRanges(format, dims, entries, 0);
  return r.bytes[0] + (r.count > 1 ? r.bytes[1] : 0);
}

uint32_t SparseRecordLayout::entries_per_sector() const { return kSparseSectorBytes / (entry_bytes() + 8); }

uint32_t SparseRecordLayout::sectors_per_layer() const {
  const uint32_t per = entries_per_sector();
  return per == 0 ? 0 : (entries + per - 1) / per;
}

uint64_t SparseRecordLayout::PadBytes() { return kSparseSectorBytes - BundleHeaderBytes(2); }

SparseRecordLayout::Place SparseRecordLayout::Locate(uint32_t layer, uint32_t slot) const {
  const uint32_t per = entries_per_sector();
  Place p;
  p.sector = (uint64_t{layer} * sectors_per_layer() + slot / per) * kSparseSectorBytes;
  p.data = (slot % per) * entry_bytes();
  p.checksum = per * entry_bytes() + (slot % per) * 8;
  return p;
}

bool SparseEntryMatches(const SparseRecordLayout& layout, const BundleKey& key, uint32_t layer, uint32_t slot,
                        const std::byte* sector, const SparseRecordLayout::Place& place) {
  uint64_t want;
  std::memcpy(&want, sector + place.checksum, 8);
  return XXH3_64bits_withSeed(sector + place.data, layout.entry_bytes(), EntrySeed(key, layer, slot)) == want;
}

namespace {
Status CheckBuffers(const SparseRecordLayout& layout, size_t pages, size_t sectors) {
  SPARSEKV_RETURN_IF_ERROR(layout.Validate());
  if (pages != layout.pages_bytes() || sectors != layout.sectors_bytes()) {
    return Status::InvalidArgument(fmt::format(
        "sparse record: {} bytes of pages and {} of sectors; the layout holds {} and {}", pages, sectors,
        layout.pages_bytes(), layout.sectors_bytes()));
  }
  return Status::OK();
}
}  // namespace

Status PackSparseRecord(const SparseRecordLayout& layout, const BundleKey& key, std::span<const std::byte> pages,
                        std::span<std::byte> sectors) {
  SPARSEKV_RETURN_IF_ERROR(CheckBuffers(layout, pages.size(), sectors.size()));
  std::memset(sectors.data(), 0, sectors.size());
  const uint32_t bytes = layout.entry_bytes();
  for (uint32_t l = 0; l < layout.layers; ++l) {
    const std::byte* page = pages.data() + uint64_t{l} * layout.page_stride;
    for (uint32_t s = 0; s < layout.entries; ++s) {
      const SparseRecordLayout::Place at = layout.Locate(l, s);
      std::byte* sector = sectors.data() + at.sector;
      PageToPacked(page, EntryByteRanges(layout.format, layout.dims, layout.entries, s), sector + at.data);
      const uint64_t sum = XXH3_64bits_withSeed(sector + at.data, bytes, EntrySeed(key, l, s));
      std::memcpy(sector + at.checksum, &sum, 8);
    }
  }
  return Status::OK();
}

Status UnpackSparseRecord(const SparseRecordLayout& layout, const BundleKey& key, std::span<const std::byte> sectors,
                          std::span<std::byte> pages) {
  SPARSEKV_RETURN_IF_ERROR(CheckBuffers(layout, pages.size(), sectors.size()));
  for (uint32_t l = 0; l < layout.layers; ++l) {
    std::byte* page = pages.data() + uint64_t{l} * layout.page_stride;
    for (uint32_t s = 0; s < layout.entries; ++s) {
      const SparseRecordLayout::Place at = layout.Locate(l, s);
      const std::byte* sector = sectors.data() + at.sector;
      if (!SparseEntryMatches(layout, key, l, s, sector, at)) {
        return Status::Corruption(fmt::format("sparse record {}: entry {} of layer {} does not match its checksum",
                                              key.ToString(), s, l));
      }
      PackedToPage(sector + at.data, EntryByteRanges(layout.format, layout.dims, layout.entries, s), page);
    }
  }
  return Status::OK();
}

uint32_t SparseRecordLayout::PagesTag() const {
  // What decides how the sectors' bytes are read, as OffloadedCache::PagesDescription does for
  // whole bundles.
  const std::string d = fmt::format("sparsekv.sparse-record.v1 format={} dims={} entries={} layers={} page_stride={}",
                                    StorageFormatName(format), dims, entries, layers, page_stride);
  const auto tag = static_cast<uint32_t>(XXH3_64bits(d.data(), d.size()));
  return tag != 0 ? tag : 1;
}

Result<BundlePtr> MakeSparseRecord(const BundleKey& key, const SparseRecordLayout& layout,
                                   std::span<const std::byte> pages, uint64_t sequence) {
  SPARSEKV_RETURN_IF_ERROR(layout.Validate());
  std::vector<std::byte> sectors(layout.sectors_bytes());
  SPARSEKV_RETURN_IF_ERROR(PackSparseRecord(layout, key, pages, sectors));
  const std::vector<std::byte> pad(SparseRecordLayout::PadBytes());
  const std::span<const std::byte> segments[2] = {pad, sectors};
  return Bundle::Make(key, segments, sequence, layout.PagesTag());
}

Status StoreSparseRecord(HostTier& host, const BundleKey& key, const SparseRecordLayout& layout,
                         std::span<const std::byte> pages, uint64_t sequence) {
  SPARSEKV_RETURN_IF_ERROR(layout.Validate());
  std::vector<std::byte> sectors(layout.sectors_bytes());
  SPARSEKV_RETURN_IF_ERROR(PackSparseRecord(layout, key, pages, sectors));
  const std::vector<std::byte> pad(SparseRecordLayout::PadBytes());
  const std::span<const std::byte> segments[2] = {pad, sectors};
  SPARSEKV_ASSIGN_OR_RETURN(BundlePtr stored, host.PutGathered(key, segments, sequence, layout.PagesTag()));
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<SparseWorkingSet>> SparseWorkingSet::Create(const SparseWorkingSetOptions& o) {
  if (!KernelFormat(o.format)) {
    return Status::InvalidArgument(fmt::format("sparse working set: {} is not a format the sparse kernel reads",
                                               StorageFormatName(o.format)));
  }
  if (o.capacity_entries == 0 || o.page_entries == 0 || o.dims == 0) {
    return Status::InvalidArgument("sparse working set: capacity, page entries and dims must be at least 1");
  }
  if (o.capacity_entries > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
    return Status::InvalidArgument("sparse working set: a capacity past what an int32 index can name");
  }
  std::unique_ptr<SparseWorkingSet> ws(new SparseWorkingSet());
  ws->format_ = o.format;
  ws->dims_ = o.dims;
  ws->capacity_ = o.capacity_entries;
  ws->page_entries_ = o.page_entries;
  ws->max_entries_ = o.max_entries;
  ws->page_stride_ = (FormatPageBytes(o.format, o.dims, o.page_entries) + 63) & ~uint64_t{63};
  const uint64_t pages = (uint64_t{o.capacity_entries} + o.page_entries - 1) / o.page_entries;
  ws->arena_bytes_ = pages * ws->page_stride_;
  ws->arena_ = static_cast<std::byte*>(std::aligned_alloc(64, ws->arena_bytes_));
  if (ws->arena_ == nullptr) return Status::ResourceExhausted("sparse working set: no memory for its arena");
  std::memset(ws->arena_, 0, ws->arena_bytes_);
  ws->entry_of_.assign(o.capacity_entries, kFree);
  ws->prev_.assign(o.capacity_entries + 1, 0);
  ws->next_.assign(o.capacity_entries + 1, 0);
  ws->prev_[o.capacity_entries] = ws->next_[o.capacity_entries] = o.capacity_entries;  // empty list
  ws->stamp_.assign(o.capacity_entries, 0);
  ws->prefetch_.assign(o.capacity_entries, 0);
  ws->free_.reserve(o.capacity_entries);
  for (uint32_t s = o.capacity_entries; s-- > 0;) ws->free_.push_back(s);
  return ws;
}

SparseWorkingSet::~SparseWorkingSet() { std::free(arena_); }

void SparseWorkingSet::Unlink(uint32_t s) {
  next_[prev_[s]] = next_[s];
  prev_[next_[s]] = prev_[s];
}

void SparseWorkingSet::PushFront(uint32_t s) {
  const uint32_t head = capacity_;
  prev_[s] = head;
  next_[s] = next_[head];
  prev_[next_[head]] = s;
  next_[head] = s;
}

uint32_t SparseWorkingSet::TakeSlot(bool for_prefetch) {
  uint32_t slot;
  if (!free_.empty()) {
    slot = free_.back();
  } else {
    slot = prev_[capacity_];  // the least recently used
    // A prefetch leaves what the last Map named (the kernel may be reading it) and what it
    // took itself. The Map's entries are all in front of any other (it moved them there), so
    // once the tail is one of them, no other is left.
    if (for_prefetch &&
        (slot == capacity_ || (call_ > 0 && stamp_[slot] == call_) || prefetch_[slot] == 2)) {
      return capacity_;
    }
    Release(slot);
  }
  free_.pop_back();
  return slot;
}

void SparseWorkingSet::Assign(uint32_t slot, uint64_t entry, uint64_t stamp) {
  slot_of_[entry] = static_cast<int32_t>(slot);
  entry_of_[slot] = entry;
  stamp_[slot] = stamp;
  PushFront(slot);
}

void SparseWorkingSet::Release(uint32_t s) {
  Unlink(s);
  prefetch_[s] = 0;
  slot_of_[entry_of_[s]] = -1;
  entry_of_[s] = kFree;
  free_.push_back(s);
}

Status SparseWorkingSet::Map(std::span<const int32_t> logical, std::span<int32_t> physical,
                             std::vector<Miss>* misses) {
  misses->clear();
  if (logical.size() != physical.size()) {
    return Status::InvalidArgument(fmt::format("sparse working set: {} indices in, room for {} out", logical.size(),
                                               physical.size()));
  }
  int32_t top = -1;
  for (int32_t e : logical) {
    if (e < -1) return Status::InvalidArgument(fmt::format("sparse working set: index {} is below -1", e));
    if (e >= 0 && static_cast<uint64_t>(e) >= max_entries_) {
      return Status::InvalidArgument(
          fmt::format("sparse working set: index {} is past the {} entries it may name", e, max_entries_));
    }
    top = std::max(top, e);
  }
  if (logical.size() > capacity_) {  // (a selection no longer than the capacity always fits)
    std::vector<int32_t> distinct(logical.begin(), logical.end());
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    const size_t n = distinct.size() - (distinct.front() == -1 ? 1 : 0);
    if (n > capacity_) {
      return Status::ResourceExhausted(fmt::format(
          "sparse working set: a selection of {} distinct entries; its capacity is {}", n, capacity_));
    }
  }
  if (top >= 0 && static_cast<uint64_t>(top) >= slot_of_.size()) slot_of_.resize(uint64_t(top) + 1, -1);
  ++call_;
  // First everything already held moves to the front, so that making room for the misses
  // below never drops an entry this selection names.
  uint64_t hits = 0;
  for (int32_t e : logical) {
    if (e < 0) continue;
    const int32_t s = slot_of_[static_cast<uint64_t>(e)];
    if (s < 0) continue;
    if (stamp_[s] != call_) ++hits;
    stamp_[s] = call_;
    if (prefetch_[s]) {
      prefetch_[s] = 0;
      ++prefetch_used_;
    }
    Unlink(static_cast<uint32_t>(s));
    PushFront(static_cast<uint32_t>(s));
  }
  for (size_t i = 0; i < logical.size(); ++i) {
    const int32_t e = logical[i];
    if (e < 0) {
      physical[i] = -1;
      continue;
    }
    int32_t s = slot_of_[static_cast<uint64_t>(e)];
    if (s < 0) {
      // The least recently used, when none is free, is never one this call named: the
      // selection has at most capacity_ distinct entries (checked above), all in front of it.
      const uint32_t slot = TakeSlot(/*for_prefetch=*/false);
      s = static_cast<int32_t>(slot);
      Assign(slot, static_cast<uint64_t>(e), call_);
      misses->push_back({static_cast<uint64_t>(e), slot});
    }
    physical[i] = s;
  }
  hits_ += hits;
  misses_ += misses->size();
  return Status::OK();
}

void SparseWorkingSet::Prefetch(std::span<const int32_t> logical, std::vector<Miss>* misses) {
  misses->clear();
  for (int32_t e : logical) {
    if (e < 0 || static_cast<uint64_t>(e) >= max_entries_) continue;
    if (static_cast<uint64_t>(e) >= slot_of_.size()) slot_of_.resize(uint64_t(e) + 1, -1);
    if (slot_of_[static_cast<uint64_t>(e)] >= 0) continue;  // held (or named earlier in this call)
    const uint32_t slot = TakeSlot(/*for_prefetch=*/true);
    if (slot == capacity_) break;  // only what the last Map named (or this call took) is left
    Assign(slot, static_cast<uint64_t>(e), /*stamp=*/0);
    prefetch_[slot] = 2;  // taken by this call: not taken back by it
    misses->push_back({static_cast<uint64_t>(e), slot});
  }
  for (const Miss& m : *misses) prefetch_[m.slot] = 1;
  prefetched_ += misses->size();
}

void SparseWorkingSet::Forget(std::span<const Miss> misses) {
  for (const Miss& m : misses) {
    if (m.slot < capacity_ && entry_of_[m.slot] == m.entry) Release(m.slot);
  }
}

PagedCacheView SparseWorkingSet::view() const {
  PagedCacheView v;
  v.base = arena_;
  v.block_stride = page_stride_;
  v.num_blocks = static_cast<uint32_t>(arena_bytes_ / page_stride_);
  v.block_entries = page_entries_;
  v.dims = dims_;
  v.format = format_;
  return v;
}

uint64_t SparseWorkingSet::memory_bytes() const {
  return arena_bytes_ + slot_of_.size() * sizeof(int32_t) +
         uint64_t{capacity_} * (sizeof(uint64_t) * 2 + sizeof(uint32_t) * 3) + sizeof(uint32_t) * 2;
}

// ---------------------------------------------------------------------------------------------

namespace {
// What every fetcher checks before it reads: the records' layout, a working set of its format,
// a layer the records hold. On failure every miss is forgotten (the next Map names it again).
Status CheckFetch(const SparseRecordLayout& layout, SparseWorkingSet& ws, uint32_t layer,
                  std::span<const SparseWorkingSet::Miss> misses, const char* what) {
  const PagedCacheView v = ws.view();
  Status st = layout.Validate();
  if (st.ok() && (v.format != layout.format || v.dims != layout.dims)) {
    st = Status::InvalidArgument(fmt::format("{}: the working set holds another format than the records", what));
  }
  if (st.ok() && layer >= layout.layers) {
    st = Status::InvalidArgument(fmt::format("{}: layer {} of a record of {}", what, layer, layout.layers));
  }
  if (!st.ok()) ws.Forget(misses);
  return st;
}
}  // namespace

HostEntryFetcher::HostEntryFetcher(HostTier& host, SparseRecordLayout layout, std::vector<BundleKey> blocks)
    : host_(host), layout_(layout), blocks_(std::move(blocks)) {}

Status HostEntryFetcher::Fetch(uint32_t layer, std::span<const SparseWorkingSet::Miss> misses, SparseWorkingSet& ws) {
  if (misses.empty()) return Status::OK();
  Status st = CheckFetch(layout_, ws, layer, misses, "host entry fetch");
  if (!st.ok()) return st;
  const PagedCacheView wv = ws.view();
  // By block, so that each record is pinned once.
  sorted_.assign(misses.begin(), misses.end());
  std::sort(sorted_.begin(), sorted_.end(), [](const auto& a, const auto& b) { return a.entry < b.entry; });
  const uint64_t sectors_bytes = layout_.sectors_bytes();
  const uint32_t pages_tag = layout_.PagesTag();
  std::vector<SparseWorkingSet::Miss> failed;
  auto fail = [&](Status why, std::span<const SparseWorkingSet::Miss> which) {
    if (st.ok()) st = std::move(why);
    failed.insert(failed.end(), which.begin(), which.end());
  };
  size_t i = 0;
  while (i < sorted_.size()) {
    const uint64_t block = sorted_[i].entry / layout_.entries;
    size_t end = i;
    while (end < sorted_.size() && sorted_[end].entry / layout_.entries == block) ++end;
    const std::span<const SparseWorkingSet::Miss> group(sorted_.data() + i, end - i);
    i = end;
    if (block >= blocks_.size()) {
      fail(Status::InvalidArgument(fmt::format("host entry fetch: entry {} lies past the sequence's {} blocks",
                                               group[0].entry, blocks_.size())),
           group);
      continue;
    }
    // The record's layout is checked (no span reaches past it), its checksum is not: each
    // entry is checked on its own below.
    const BundleKey& key = blocks_[block];
    Result<BundlePtr> rec = host_.GetPinned(key, /*check=*/false);
    if (!rec.ok()) {
      fail(rec.status().WithContext(fmt::format("host entry fetch: block {} ({})", block, key.ToString())), group);
      continue;
    }
    if ((*rec)->pages() != 0 && (*rec)->pages() != pages_tag) {
      fail(Status::NotSupported(fmt::format(
               "host entry fetch: {} holds the entries of another sparse layout or storage format (pages tag "
               "{:08x}, this layout's {:08x})",
               key.ToString(), (*rec)->pages(), pages_tag)),
           group);
      continue;
    }
    if ((*rec)->segment_count() != 2 || (*rec)->segment_bytes(0) != SparseRecordLayout::PadBytes() ||
        (*rec)->segment_bytes(1) != sectors_bytes) {
      fail(Status::InvalidArgument(
               fmt::format("host entry fetch: {} is not a sparse record of this layout", key.ToString())),
           group);
      continue;
    }
    const std::byte* sectors = (*rec)->segment(1).data();
    for (const SparseWorkingSet::Miss& m : group) {
      const uint32_t slot = static_cast<uint32_t>(m.entry % layout_.entries);
      const SparseRecordLayout::Place at = layout_.Locate(layer, slot);
      const std::byte* sector = sectors + at.sector;
      if (!SparseEntryMatches(layout_, key, layer, slot, sector, at)) {
        fail(Status::Corruption(fmt::format(
                 "host entry fetch: entry {} (layer {}, slot {}) of {} does not match its checksum", m.entry,
                 layer, slot, key.ToString())),
             std::span<const SparseWorkingSet::Miss>(&m, 1));
        continue;
      }
      PackedToPage(sector + at.data, EntryByteRanges(layout_.format, layout_.dims, wv.block_entries, ws.SlotInPage(m.slot)),
                   ws.SlotPage(m.slot));
      bytes_fetched_ += layout_.entry_bytes();
    }
  }
  ws.Forget(failed);
  return st;
}

// ---------------------------------------------------------------------------------------------

SsdEntryFetcher::SsdEntryFetcher(SsdTier& ssd, SparseRecordLayout layout, std::vector<BundleKey> blocks)
    : ssd_(ssd), layout_(layout), blocks_(std::move(blocks)) {}

SsdEntryFetcher::~SsdEntryFetcher() { std::free(staging_); }

Status SsdEntryFetcher::Fetch(uint32_t layer, std::span<const SparseWorkingSet::Miss> misses, SparseWorkingSet& ws) {
  if (misses.empty()) return Status::OK();
  Status st = CheckFetch(layout_, ws, layer, misses, "ssd entry fetch");
  if (!st.ok()) return st;
  const PagedCacheView wv = ws.view();
  // One read per distinct (block, sector), in the order of the entries.
  struct Want {
    SparseWorkingSet::Miss miss;
    uint64_t block = 0;
    SparseRecordLayout::Place at;
    uint32_t read = 0;
  };
  std::vector<Want> wants(misses.size());
  for (size_t i = 0; i < misses.size(); ++i) {
    wants[i].miss = misses[i];
    wants[i].block = misses[i].entry / layout_.entries;
    wants[i].at = layout_.Locate(layer, static_cast<uint32_t>(misses[i].entry % layout_.entries));
  }
  std::sort(wants.begin(), wants.end(), [](const Want& a, const Want& b) {
    return a.block != b.block ? a.block < b.block : a.at.sector < b.at.sector;
  });
  std::vector<SsdTier::SectorRead> reads;
  std::vector<SparseWorkingSet::Miss> failed;
  for (Want& w : wants) {
    if (w.block >= blocks_.size()) {
      if (st.ok()) {
        st = Status::InvalidArgument(fmt::format("ssd entry fetch: entry {} lies past the sequence's {} blocks",
                                                 w.miss.entry, blocks_.size()));
      }
      w.read = UINT32_MAX;
      failed.push_back(w.miss);
      continue;
    }
    // The sectors segment starts one sector into the record (after the padded header).
    const uint64_t sector = kSparseSectorBytes + w.at.sector;
    if (reads.empty() || !(reads.back().key == blocks_[w.block]) || reads.back().sector != sector) {
      reads.push_back({blocks_[w.block], sector, nullptr});
    }
    w.read = static_cast<uint32_t>(reads.size() - 1);
  }
  if (reads.size() > staging_sectors_) {
    std::free(staging_);
    staging_sectors_ = std::max<uint64_t>(reads.size(), 2 * staging_sectors_);
    staging_ = static_cast<std::byte*>(std::aligned_alloc(kSparseSectorBytes, staging_sectors_ * kSparseSectorBytes));
    if (staging_ == nullptr) {
      staging_sectors_ = 0;
      ws.Forget(misses);
      return Status::ResourceExhausted("ssd entry fetch: no memory to read sectors into");
    }
  }
  for (size_t r = 0; r < reads.size(); ++r) reads[r].out = staging_ + r * kSparseSectorBytes;
  const std::vector<Status> got = ssd_.ReadSectors(reads);
  sectors_read_ += reads.size();
  for (const Want& w : wants) {
    if (w.read == UINT32_MAX) continue;
    const SsdTier::SectorRead& r = reads[w.read];
    const uint32_t slot = static_cast<uint32_t>(w.miss.entry % layout_.entries);
    Status bad;
    if (!got[w.read].ok()) {
      bad = got[w.read].WithContext(fmt::format("ssd entry fetch: block {} ({})", w.block, r.key.ToString()));
    } else if (!SparseEntryMatches(layout_, r.key, layer, slot, r.out, w.at)) {
      bad = Status::Corruption(fmt::format(
          "ssd entry fetch: entry {} (layer {}, slot {}) of {} does not match its checksum", w.miss.entry, layer,
          slot, r.key.ToString()));
    }
    if (!bad.ok()) {
      if (st.ok()) st = bad;
      failed.push_back(w.miss);
      continue;
    }
    PackedToPage(r.out + w.at.data,
                 EntryByteRanges(layout_.format, layout_.dims, wv.block_entries, ws.SlotInPage(w.miss.slot)),
                 ws.SlotPage(w.miss.slot));
    bytes_fetched_ += layout_.entry_bytes();
  }
  ws.Forget(failed);
  return st;
}

// ---------------------------------------------------------------------------------------------

BundleKey SparseValueKey(const WireBlockHash& hash) {
  BundleKey key;
  std::memcpy(&key.hash.lo, hash.data(), 8);
  std::memcpy(&key.hash.hi, hash.data() + 8, 8);
  return key;
}

Result<std::vector<std::byte>> MakeSparseValue(const SparseRecordLayout& layout, const WireBlockHash& hash,
                                               std::span<const std::byte> pages) {
  SPARSEKV_RETURN_IF_ERROR(layout.Validate());
  std::vector<std::byte> value(kSparseValuePadBytes + layout.sectors_bytes());
  SPARSEKV_RETURN_IF_ERROR(PackSparseRecord(layout, SparseValueKey(hash), pages,
                                            std::span(value).subspan(kSparseValuePadBytes)));
  return value;
}

DaemonEntryFetcher::DaemonEntryFetcher(Client& client, SparseRecordLayout layout, std::vector<WireBlockHash> blocks)
    : client_(client), layout_(layout), blocks_(std::move(blocks)) {}

Status DaemonEntryFetcher::Fetch(uint32_t layer, std::span<const SparseWorkingSet::Miss> misses,
                                 SparseWorkingSet& ws) {
  if (misses.empty()) return Status::OK();
  Status st = CheckFetch(layout_, ws, layer, misses, "daemon entry fetch");
  if (!st.ok()) return st;
  const PagedCacheView wv = ws.view();
  std::vector<SparseWorkingSet::Miss> sorted(misses.begin(), misses.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.entry < b.entry; });
  std::vector<SparseWorkingSet::Miss> failed;
  // One item per block, two ranges per entry: the entry, then its checksum.
  std::vector<RangesRequest> items;
  std::vector<std::pair<size_t, size_t>> groups;  // [begin, end) of `sorted` per item
  const uint32_t entry_bytes = layout_.entry_bytes();
  size_t i = 0;
  while (i < sorted.size()) {
    const uint64_t block = sorted[i].entry / layout_.entries;
    size_t end = i;
    while (end < sorted.size() && sorted[end].entry / layout_.entries == block) ++end;
    if (block >= blocks_.size()) {
      if (st.ok()) {
        st = Status::InvalidArgument(fmt::format("daemon entry fetch: entry {} lies past the sequence's {} blocks",
                                                 sorted[i].entry, blocks_.size()));
      }
      failed.insert(failed.end(), sorted.begin() + i, sorted.begin() + end);
      i = end;
      continue;
    }
    RangesRequest req;
    req.hash = blocks_[block];
    for (size_t k = i; k < end; ++k) {
      const SparseRecordLayout::Place at = layout_.Locate(layer, static_cast<uint32_t>(sorted[k].entry % layout_.entries));
      const uint64_t sector = kSparseValuePadBytes + at.sector;
      req.ranges.push_back({sector + at.data, entry_bytes});
      req.ranges.push_back({sector + at.checksum, 8});
      bytes_requested_ += entry_bytes + 8;
    }
    items.push_back(std::move(req));
    groups.emplace_back(i, end);
    i = end;
  }
  if (!items.empty()) {
    ++requests_;
    Result<std::vector<GetResult>> got = client_.GetRanges(items);
    if (!got.ok()) {
      ws.Forget(misses);
      return got.status().WithContext("daemon entry fetch");
    }
    // An entry is checked where the record would hold it: its bytes and checksum put back at
    // their offsets in a sector.
    alignas(64) std::byte sector[kSparseSectorBytes];
    for (size_t k = 0; k < items.size(); ++k) {
      const auto [begin, end] = groups[k];
      const GetResult& r = (*got)[k];
      const BundleKey key = SparseValueKey(items[k].hash);
      if (!r.status.ok()) {
        if (st.ok()) st = r.status.WithContext(fmt::format("daemon entry fetch: block {}", sorted[begin].entry / layout_.entries));
        failed.insert(failed.end(), sorted.begin() + begin, sorted.begin() + end);
        continue;
      }
      const std::byte* p = r.bytes.data();
      for (size_t e = begin; e < end; ++e, p += entry_bytes + 8) {
        const SparseWorkingSet::Miss& m = sorted[e];
        const uint32_t slot = static_cast<uint32_t>(m.entry % layout_.entries);
        const SparseRecordLayout::Place at = layout_.Locate(layer, slot);
        std::memcpy(sector + at.data, p, entry_bytes);
        std::memcpy(sector + at.checksum, p + entry_bytes, 8);
        if (!SparseEntryMatches(layout_, key, layer, slot, sector, at)) {
          if (st.ok()) {
            st = Status::Corruption(fmt::format(
                "daemon entry fetch: entry {} (layer {}, slot {}) of block {} does not match its checksum", m.entry,
                layer, slot, m.entry / layout_.entries));
          }
          failed.push_back(m);
          continue;
        }
        PackedToPage(sector + at.data,
                     EntryByteRanges(layout_.format, layout_.dims, wv.block_entries, ws.SlotInPage(m.slot)),
                     ws.SlotPage(m.slot));
        bytes_fetched_ += entry_bytes;
      }
    }
  }
  ws.Forget(failed);
  return st;
}

// ---------------------------------------------------------------------------------------------

AsyncEntryFetcher::AsyncEntryFetcher(FetchFn fetch) : fetch_(std::move(fetch)), thread_([this] { Run(); }) {}

AsyncEntryFetcher::~AsyncEntryFetcher() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void AsyncEntryFetcher::Start(uint32_t layer, std::vector<SparseWorkingSet::Miss> misses, SparseWorkingSet& ws) {
  if (misses.empty()) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    jobs_.push_back({layer, std::move(misses), &ws});
  }
  cv_.notify_all();
}

Status AsyncEntryFetcher::Wait(SparseWorkingSet& ws) {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] {
    if (running_ == &ws) return false;
    return std::none_of(jobs_.begin(), jobs_.end(), [&](const Job& j) { return j.ws == &ws; });
  });
  Status first;
  for (auto it = errors_.begin(); it != errors_.end();) {
    if (it->first == &ws) {
      if (first.ok()) first = it->second;
      it = errors_.erase(it);
    } else {
      ++it;
    }
  }
  return first;
}

void AsyncEntryFetcher::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and nothing left
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    running_ = job.ws;
    l.unlock();
    Status st = fetch_(job.layer, job.misses, *job.ws);
    l.lock();
    running_ = nullptr;
    if (!st.ok()) errors_.emplace_back(job.ws, std::move(st));
    cv_.notify_all();
  }
}

}  // namespace sparsekv
