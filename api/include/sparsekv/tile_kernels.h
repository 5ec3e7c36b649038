// TileKernels: the dequantization primitives PageCodec is built from, for kernels that read a
// page's bytes themselves (layout:: in storage_format.h says where values and scales are).
//
// out[i] = value(in[i]) * scale, with one fp32 rounding; a `_bf16` form then rounds that to
// bf16 (bf16.h). e4m3 NaN codes give NaN. Any n; no alignment beyond the element type's. The
// results are bit-identical on every SIMD path. The table is static and immutable: thread-safe.
#pragma once

#include <cstdint>

#include "sparsekv/cpu_features.h"
#include "sparsekv/status.h"

namespace sparsekv {

struct TileKernels {
  SimdPath path;
  void (*int8_to_fp32)(const int8_t* values, float scale, uint32_t n, float* out);
  void (*int8_to_bf16)(const int8_t* values, float scale, uint32_t n, uint16_t* out);
  void (*e4m3_to_fp32)(const uint8_t* codes, float scale, uint32_t n, float* out);
  void (*e4m3_to_bf16)(const uint8_t* codes, float scale, uint32_t n, uint16_t* out);
  void (*bf16_to_fp32)(const uint16_t* values, uint32_t n, float* out);
  void (*fp32_to_bf16)(const float* values, uint32_t n, uint16_t* out);
};

// The table of `path`; NotSupported if this CPU cannot run it.
Result<const TileKernels*> TileKernelsFor(SimdPath path);
// The table of ActiveSimdPath().
const TileKernels& ActiveTileKernels();

}  // namespace sparsekv
