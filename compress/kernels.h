// The kernel table of one SIMD path: per storage format, encode from and decode to each row
// type. Private to compress/; PageCodec (codec.h) and TileKernels (tile_kernels.h) are the
// public faces.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sparsekv/storage_format.h"
#include "sparsekv/tile_kernels.h"

namespace sparsekv::compress {

// Rows [0, count) go to slots [first_slot, first_slot + count) of a page of `entries` entries.
struct EncodeJob {
  const uint8_t* rows;
  size_t row_stride;
  uint32_t count;
  uint8_t* page;
  uint32_t entries;
  uint32_t dims;
  uint32_t first_slot;
};

// Slots [first_slot, first_slot + count) of a page of `entries` entries go to rows [0, count).
struct DecodeJob {
  const uint8_t* page;
  uint32_t entries;
  uint32_t dims;
  uint32_t first_slot;
  uint32_t count;
  uint8_t* rows;
  size_t row_stride;
};

using EncodeFn = void (*)(const EncodeJob&);
using DecodeFn = void (*)(const DecodeJob&);

// Indexed by RowType: [0] fp32 rows, [1] bf16 rows.
struct FormatKernels {
  EncodeFn encode[2];
  DecodeFn decode[2];
};

struct PathKernels {
  FormatKernels formats[kNumStorageFormats];
  TileKernels tiles;
};

// Each path's table, or nullptr where this build has no code for it (a non-x86 target). The
// caller checks SimdPathSupported before using a table.
const PathKernels* ScalarPathKernels();
const PathKernels* Avx2PathKernels();
const PathKernels* Avx512PathKernels();
const PathKernels* Avx512Bf16PathKernels();
const PathKernels* NeonPathKernels();

// The table of `path`; nullptr when unavailable in this build or not supported by this CPU.
const PathKernels* KernelsFor(SimdPath path);

}  // namespace sparsekv::compress
