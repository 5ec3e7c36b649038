// BlockGeometry: how a model's cache kinds are laid out in token blocks and pages.
//
// A token block holds `block_tokens` tokens; it must be a multiple of every compression ratio
// in the model, so no compressed entry straddles two blocks. Each distinct KindSpec (kind,
// format, dims, ratio, rows) gets one page pool; a page of that pool holds one block of that
// kind for every layer that keeps it, block-major:
//   address(block b, layer slot l) = base + b * block_stride + l * layer_stride
// A BlockGeometry is an immutable value; thread-safe to share.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsekv/model_spec.h"
#include "sparsekv/status.h"

namespace sparsekv {

inline constexpr uint32_t kDefaultBlockTokens = 128;
inline constexpr uint64_t kLayerStrideAlign = 64;  // one cache line

struct PoolGeometry {
  KindSpec spec;
  std::vector<uint32_t> layers;   // model layer ids, in layer-slot order
  uint32_t entries_per_block = 0; // block_tokens / ratio, or 1 for a compressor snapshot
  uint64_t bytes_per_entry = 0;   // FormatEntryBytes (compressor state: both tensors)
  uint64_t page_bytes = 0;        // one layer of one block, format padding included
  uint64_t layer_stride = 0;      // page_bytes rounded up to kLayerStrideAlign
  uint64_t block_stride = 0;      // layers.size() * layer_stride: one pool page

  uint64_t Offset(uint64_t block, uint32_t layer_slot) const {
    return block * block_stride + uint64_t{layer_slot} * layer_stride;
  }
  // Slot of model layer `layer` in this pool, or -1.
  int LayerSlot(uint32_t layer) const;
};

struct BlockGeometry {
  uint32_t block_tokens = kDefaultBlockTokens;
  std::vector<PoolGeometry> pools;

  // Index into `pools` of the pool holding (layer, kind), or -1.
  int PoolIndex(uint32_t layer, CacheKind kind) const;
  // Bytes of one token block across every pool.
  uint64_t BytesPerBlock() const;
};

// Errors: block_tokens of 0; a block_tokens that is not a multiple of some ratio (the message
// names the ratio, the kind and the layer); an invalid spec.
Result<BlockGeometry> ComputeBlockGeometry(const ModelSpec& spec,
                                           uint32_t block_tokens = kDefaultBlockTokens);

}  // namespace sparsekv
