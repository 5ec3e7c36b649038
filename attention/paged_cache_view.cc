#include "sparsekv/paged_cache_view.h"

#include <fmt/format.h>

#include "sparsekv/page_pool.h"

namespace sparsekv {

Result<PagedCacheView> PagedCacheView::ForLayer(const PagePool& pool, const PoolGeometry& geometry,
                                                uint32_t layer) {
  if (pool.arena_base() == nullptr) {
    return Status::InvalidArgument(fmt::format("pool '{}' has no arena to read", pool.name()));
  }
  if (pool.page_bytes() != geometry.block_stride) {
    return Status::InvalidArgument(
        fmt::format("pool '{}' has {}-byte pages but the geometry says {}", pool.name(),
                    pool.page_bytes(), geometry.block_stride));
  }
  const int slot = geometry.LayerSlot(layer);
  if (slot < 0) {
    return Status::InvalidArgument(fmt::format("pool '{}' ({}) does not keep layer {}",
                                               pool.name(), CacheKindName(geometry.spec.kind),
                                               layer));
  }
  PagedCacheView v;
  v.base = pool.arena_base() + uint64_t(slot) * geometry.layer_stride;
  v.block_stride = geometry.block_stride;
  v.num_blocks = pool.capacity();
  v.block_entries = geometry.entries_per_block;
  v.dims = geometry.spec.dims;
  v.format = geometry.spec.format;
  if (Status s = v.Validate(); !s.ok()) return s;
  return v;
}

Status PagedCacheView::Validate() const {
  if (base == nullptr) return Status::InvalidArgument("cache view has no base pointer");
  if (block_entries == 0 || num_blocks == 0 || dims == 0) {
    return Status::InvalidArgument(
        fmt::format("cache view needs nonzero blocks, entries per block and dims (got {}, {}, {})",
                    num_blocks, block_entries, dims));
  }
  if (format == StorageFormat::kFp32) {
    return Status::InvalidArgument("cache view: fp32 holds compressor state, not attention entries");
  }
  // The formats a kernel reads and the kinds that use them.
  CacheKind kind = CacheKind::kMlaLatent;
  if (format == StorageFormat::kIdxFp8 || format == StorageFormat::kIdxC8) {
    kind = CacheKind::kIndexerKey;
  } else if (format == StorageFormat::kFp8V4) {
    kind = CacheKind::kCsaCompressed;
  }
  if (format != StorageFormat::kBf16) {
    if (Status s = CheckFormatFits(format, kind, dims); !s.ok()) return s.WithContext("cache view");
  }
  if (block_stride < page_bytes() && num_blocks > 1) {
    return Status::InvalidArgument(fmt::format(
        "cache view: block stride {} is shorter than a {} page of {} entries x {} dims ({} bytes)",
        block_stride, StorageFormatName(format), block_entries, dims, page_bytes()));
  }
  return Status::OK();
}

}  // namespace sparsekv
