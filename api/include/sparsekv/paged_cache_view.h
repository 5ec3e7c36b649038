// PagedCacheView: one layer of one cache kind across a pool's pages, as the attention kernels
// read it in place (FlashInfer's paged_kv_t is the model).
//
// Entry `offset` of physical block `block` lies in the page at base + block * block_stride, laid
// out as its storage format says (storage_format.h, codec.h). Kernels name entries the way
// FlashMLA's sparse kernels do: index = physical_block * block_entries + offset, and -1 for "no
// entry". For kinds of ratio 1 (mla_latent, swa_window, V3.2's indexer keys) block_entries is the
// block's token count; for compressed kinds it is block_tokens / ratio.
//
// Ownership: a view is a plain value that owns nothing; the pages must stay mapped, and the
// entries a kernel reads must not be written, while a kernel runs over them. Thread safety: a
// view is immutable; any number of kernels may read through one at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsekv/block_geometry.h"
#include "sparsekv/status.h"
#include "sparsekv/storage_format.h"

namespace sparsekv {

class PagePool;

struct PagedCacheView {
  const std::byte* base = nullptr;  // page of physical block 0 for this layer
  uint64_t block_stride = 0;        // bytes from one physical block's page to the next
  uint32_t num_blocks = 0;          // physical blocks addressable through the view
  uint32_t block_entries = 0;       // entries per page
  uint32_t dims = 0;                // values per entry
  StorageFormat format = StorageFormat::kBf16;

  // The view of model layer `layer` of `pool`, whose geometry is `geometry` (one of
  // BlockGeometry::pools). Errors: a pool without an arena, a layer the pool does not keep, a
  // geometry whose page size differs from the pool's.
  static Result<PagedCacheView> ForLayer(const PagePool& pool, const PoolGeometry& geometry,
                                         uint32_t layer);

  // Checks the view is usable by a kernel: base set, format fits dims, stride holds a page.
  Status Validate() const;

  uint64_t page_bytes() const { return FormatPageBytes(format, dims, block_entries); }
  uint64_t num_entries() const { return uint64_t{num_blocks} * block_entries; }
  const std::byte* Page(uint32_t block) const { return base + uint64_t{block} * block_stride; }
};

// Where a sequence's entries live: physical block ids of its pages, in logical order (what
// CacheManager::GetBlockTable gives for the view's pool).
using BlockTable = std::span<const uint32_t>;

// The FlashMLA index of logical entry `entry` of a sequence whose pages are `table`, or -1 when
// the table does not reach it. Precondition: block_entries > 0.
inline int32_t PhysicalIndex(BlockTable table, uint32_t block_entries, uint64_t entry) {
  const uint64_t block = entry / block_entries;
  if (block >= table.size()) return -1;
  return static_cast<int32_t>(uint64_t{table[block]} * block_entries + entry % block_entries);
}

}  // namespace sparsekv
