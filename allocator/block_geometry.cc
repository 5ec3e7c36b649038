#include "sparsekv/block_geometry.h"

#include <fmt/format.h>

namespace sparsekv {

int PoolGeometry::LayerSlot(uint32_t layer) const {
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] == layer) return static_cast<int>(i);
  }
  return -1;
}

int BlockGeometry::PoolIndex(uint32_t layer, CacheKind kind) const {
  for (size_t p = 0; p < pools.size(); ++p) {
    if (pools[p].spec.kind == kind && pools[p].LayerSlot(layer) >= 0) return static_cast<int>(p);
  }
  return -1;
}

uint64_t BlockGeometry::BytesPerBlock() const {
  uint64_t total = 0;
  for (const PoolGeometry& p : pools) total += p.block_stride;
  return total;
}

Result<BlockGeometry> ComputeBlockGeometry(const ModelSpec& spec, uint32_t block_tokens) {
  SPARSEKV_RETURN_IF_ERROR(spec.Validate());
  if (block_tokens == 0) return Status::InvalidArgument("block_tokens is 0; expected a positive multiple of every ratio");
  BlockGeometry g;
  g.block_tokens = block_tokens;
  for (uint32_t l = 0; l < spec.layers.size(); ++l) {
    for (const KindSpec& k : spec.layers[l].kinds) {
      if (block_tokens % k.ratio != 0) {
        return Status::InvalidArgument(fmt::format(
            "block_tokens {} is not a multiple of compression ratio {} (kind {}, layer {}): a "
            "compressed entry would straddle two blocks; use a multiple of {}",
            block_tokens, k.ratio, CacheKindName(k.kind), l, k.ratio));
      }
      PoolGeometry* pool = nullptr;
      for (PoolGeometry& p : g.pools) {
        if (p.spec == k) pool = &p;
      }
      if (pool == nullptr) {
        PoolGeometry p;
        p.spec = k;
        if (k.kind == CacheKind::kCompressorState) {
          p.entries_per_block = 1;
          // Two tensors (kv and score) of state_rows x dims fp32 values.
          p.bytes_per_entry = 2ull * k.state_rows * FormatEntryBytes(k.format, k.dims);
          p.page_bytes = p.bytes_per_entry;
        } else {
          p.entries_per_block = block_tokens / k.ratio;
          p.bytes_per_entry = FormatEntryBytes(k.format, k.dims);
          p.page_bytes = FormatPageBytes(k.format, k.dims, p.entries_per_block);
        }
        p.layer_stride = (p.page_bytes + kLayerStrideAlign - 1) / kLayerStrideAlign * kLayerStrideAlign;
        g.pools.push_back(std::move(p));
        pool = &g.pools.back();
      }
      pool->layers.push_back(l);
    }
  }
  for (PoolGeometry& p : g.pools) p.block_stride = p.layer_stride * p.layers.size();
  return g;
}

}  // namespace sparsekv
