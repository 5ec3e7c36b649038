// Page layouts over tile primitives: the loops that place values, scales and rope parts at the
// `layout::` offsets of each storage format. Private to compress/.
//
// Included by each path's translation unit after it defines its primitives struct P; everything
// here is in an anonymous namespace so that each unit compiles its own copy with its own ISA
// flags (see scalar_math.h for why that matters). P provides these static templates, each on n
// values at byte pointers (kBf16In / kBf16Out: bf16 rows rather than fp32):
//   PlanInt8<kBf16In>(src, stride, n, count, plans)        (tile i at src + i * stride)
//   PlanE4m3<kBf16In>(src, stride, n, count, rule, plans)  ApplyInt8<kBf16In>(src, n, plan, dst)
//   ApplyE4m3<kBf16In>(src, n, plan, dst)
//   ToBf16<kBf16In>(src, n, dst)                     ToFp32<kBf16In>(src, n, dst)
//   DecodeInt8<kBf16Out>(q, scale, n, dst)           DecodeE4m3<kBf16Out>(codes, scale, n, dst)
// Plan/Apply take n a multiple of 16; the others take any n. The Plan calls' `plans` have room
// for `count` rounded up to a multiple of 4 (the SIMD planners write four at a time). The encode
// loops plan the tiles of token r + 1 (the next four keys for the indexer) before applying those
// of token r, so the scale arithmetic overlaps value work (see scalar_math.h, "Tile codecs in two
// steps"); int8 tiles are planned four at once, their divisions in one vector.
#pragma once

#include <cstdint>

#include "compress/kernels.h"
#include "compress/scalar_math.h"
#include "sparsekv/storage_format.h"

namespace sparsekv::compress {
namespace {

template <bool kBf16>
constexpr uint32_t kElemBytes = kBf16 ? 2 : 4;

// layout::'s offset functions, restated from its constants: they are inline functions with
// external linkage, which an unoptimized build could emit in this unit with its ISA flags and
// the linker then share with other units (scalar_math.h says why that must not happen). The
// static_asserts hold the two to the same answers.
constexpr uint64_t V4DataOffset(uint32_t entry) {
  return uint64_t{entry} * layout::kV4DataBytes;
}
constexpr uint64_t V4ScaleOffset(uint32_t entries, uint32_t entry) {
  return uint64_t{entries} * layout::kV4DataBytes + uint64_t{entry} * layout::kV4ScaleBytes;
}
constexpr uint64_t IdxValueOffset(uint32_t dims, uint32_t entry) {
  return uint64_t{entry} * dims;
}
constexpr uint64_t IdxScaleOffset(uint32_t dims, uint32_t entries, uint32_t entry) {
  return uint64_t{entries} * dims + uint64_t{entry} * layout::kIdxScaleBytes;
}
static_assert(V4DataOffset(37) == layout::Fp8V4DataOffset(37));
static_assert(V4ScaleOffset(128, 37) == layout::Fp8V4ScaleOffset(128, 37));
static_assert(IdxValueOffset(128, 37) == layout::IdxValueOffset(128, 37));
static_assert(IdxScaleOffset(128, 64, 37) == layout::IdxScaleOffset(128, 64, 37));

// The kTiles tiles of kTile values of a token (e4m3 under `rule`, or int8), planned one token
// ahead: slot `which` (r & 1) holds token r's plans while token r + 1's are made, so that the
// scale arithmetic (the int8 scales' divisions above all) overlaps value work.
template <class P, bool kBf16In, uint32_t kTiles, uint32_t kTile, bool kFp8>
struct TokenTiles {
  TilePlan plans[2][(kTiles + 3) / 4 * 4];  // the SIMD planners write four at a time

  [[gnu::always_inline]] void Plan(const uint8_t* x, uint32_t which, ScaleRule rule) {
    if constexpr (kFp8) {
      P::template PlanE4m3<kBf16In>(x, kTile * kElemBytes<kBf16In>, kTile, kTiles, rule, plans[which]);
    } else {
      P::template PlanInt8<kBf16In>(x, kTile * kElemBytes<kBf16In>, kTile, kTiles, plans[which]);
    }
  }
  [[gnu::always_inline]] void Apply(const uint8_t* x, uint32_t which, uint8_t* dst) {
    for (uint32_t t = 0; t < kTiles; ++t) {
      const uint8_t* tile = x + t * kTile * kElemBytes<kBf16In>;
      if constexpr (kFp8) {
        P::template ApplyE4m3<kBf16In>(tile, kTile, plans[which][t], dst + t * kTile);
      } else {
        P::template ApplyInt8<kBf16In>(tile, kTile, plans[which][t], dst + t * kTile);
      }
    }
  }
};

// Stored bf16 or fp32 values out as bf16 or fp32 rows: a copy, or the path's own widening or
// narrowing (ToFp32 of bf16, ToBf16 of fp32).
template <class P, bool kBf16Out>
void FromBf16(const uint8_t* src, uint32_t n, uint8_t* dst) {
  if constexpr (kBf16Out) {
    __builtin_memcpy(dst, src, 2 * size_t{n});
  } else {
    P::template ToFp32<true>(src, n, dst);
  }
}
template <class P, bool kBf16Out>
void FromFp32(const uint8_t* src, uint32_t n, uint8_t* dst) {
  if constexpr (kBf16Out) {
    P::template ToBf16<false>(src, n, dst);
  } else {
    __builtin_memcpy(dst, src, 4 * size_t{n});
  }
}

// ---- c8_mla and fp8_ds_mla: per token 512 8-bit values, 4 fp32 scales and 64 bf16 rope ----
// fp8_ds_mla: nope | scales | rope (FlashMLA). c8_mla: nope | rope | scales (CANN).

template <bool kFp8>
constexpr uint32_t kMlaScaleAt = kFp8 ? layout::kDsMlaScaleOffset : layout::kC8MlaScaleOffset;
template <bool kFp8>
constexpr uint32_t kMlaRopeAt = kFp8 ? layout::kDsMlaRopeOffset : layout::kC8MlaRopeOffset;

template <class P, bool kFp8, bool kBf16In>
void EncodeMla8(const EncodeJob& j) {
  constexpr uint32_t in = kElemBytes<kBf16In>;
  constexpr uint32_t kTiles = layout::kMlaNopeDims / layout::kMlaTile;
  constexpr ScaleRule kRule = kFp8 ? ScaleRule::kPow2Fp32 : ScaleRule::kLinear127;
  TokenTiles<P, kBf16In, kTiles, layout::kMlaTile, kFp8> tiles;
  if (j.count > 0) tiles.Plan(j.rows, 0, kRule);
  for (uint32_t r = 0; r < j.count; ++r) {
    const uint8_t* x = j.rows + r * j.row_stride;
    uint8_t* tok = j.page + uint64_t{j.first_slot + r} * layout::kMla8BitBytes;
    if (r + 1 < j.count) tiles.Plan(x + j.row_stride, (r + 1) & 1, kRule);
    tiles.Apply(x, r & 1, tok);
    for (uint32_t t = 0; t < kTiles; ++t) {
      StoreF32(tok + kMlaScaleAt<kFp8> + 4 * t, tiles.plans[r & 1][t].scale);
    }
    P::template ToBf16<kBf16In>(x + layout::kMlaNopeDims * in, layout::kMlaRopeDims,
                                tok + kMlaRopeAt<kFp8>);
  }
}

template <class P, bool kFp8, bool kBf16Out>
void DecodeMla8(const DecodeJob& j) {
  constexpr uint32_t out = kElemBytes<kBf16Out>;
  for (uint32_t r = 0; r < j.count; ++r) {
    const uint8_t* tok = j.page + uint64_t{j.first_slot + r} * layout::kMla8BitBytes;
    uint8_t* y = j.rows + r * j.row_stride;
    for (uint32_t t = 0; t < layout::kMlaNopeDims / layout::kMlaTile; ++t) {
      const float scale = LoadF32(tok + kMlaScaleAt<kFp8> + 4 * t);
      const uint8_t* src = tok + t * layout::kMlaTile;
      uint8_t* dst = y + t * layout::kMlaTile * out;
      if constexpr (kFp8) {
        P::template DecodeE4m3<kBf16Out>(src, scale, layout::kMlaTile, dst);
      } else {
        P::template DecodeInt8<kBf16Out>(src, scale, layout::kMlaTile, dst);
      }
    }
    FromBf16<P, kBf16Out>(tok + kMlaRopeAt<kFp8>, layout::kMlaRopeDims,
                                   y + layout::kMlaNopeDims * out);
  }
}

// ---- fp8_v4: n x (448 fp8 | 64 bf16 rope), then n x (7 ue8m0 scales | 1 pad byte) ----

template <class P, bool kBf16In>
void EncodeFp8V4(const EncodeJob& j) {
  constexpr uint32_t in = kElemBytes<kBf16In>;
  TokenTiles<P, kBf16In, layout::kV4Scales, layout::kV4Tile, true> tiles;
  if (j.count > 0) tiles.Plan(j.rows, 0, ScaleRule::kPow2Ue8m0);
  for (uint32_t r = 0; r < j.count; ++r) {
    const uint32_t slot = j.first_slot + r;
    const uint8_t* x = j.rows + r * j.row_stride;
    if (r + 1 < j.count) tiles.Plan(x + j.row_stride, (r + 1) & 1, ScaleRule::kPow2Ue8m0);
    uint8_t* data = j.page + V4DataOffset(slot);
    uint8_t* scales = j.page + V4ScaleOffset(j.entries, slot);
    tiles.Apply(x, r & 1, data);
    for (uint32_t t = 0; t < layout::kV4Scales; ++t) scales[t] = tiles.plans[r & 1][t].ue8m0;
    scales[layout::kV4Scales] = 0;  // the pad byte: written so a page's bytes are deterministic
    P::template ToBf16<kBf16In>(x + layout::kV4NopeDims * in, layout::kV4RopeDims,
                                data + layout::kV4NopeDims);
  }
}

template <class P, bool kBf16Out>
void DecodeFp8V4(const DecodeJob& j) {
  constexpr uint32_t out = kElemBytes<kBf16Out>;
  for (uint32_t r = 0; r < j.count; ++r) {
    const uint32_t slot = j.first_slot + r;
    const uint8_t* data = j.page + V4DataOffset(slot);
    const uint8_t* scales = j.page + V4ScaleOffset(j.entries, slot);
    uint8_t* y = j.rows + r * j.row_stride;
    for (uint32_t t = 0; t < layout::kV4Scales; ++t) {
      P::template DecodeE4m3<kBf16Out>(data + t * layout::kV4Tile, Ue8m0ToFloatRef(scales[t]),
                                       layout::kV4Tile, y + t * layout::kV4Tile * out);
    }
    FromBf16<P, kBf16Out>(data + layout::kV4NopeDims, layout::kV4RopeDims,
                                   y + layout::kV4NopeDims * out);
  }
}

// ---- idx_fp8 and idx_c8: n x dims 8-bit values, then n x fp32 scale ----

// Both models' indexer keys are 128 values wide (DESIGN.md), so the idx loops are also compiled
// for that width (kDims), where every tile loop has a known trip count and no remainder: on the
// AVX2 path that took a sixth off idx_c8's decode time (`bench codec`, Intel Xeon, AVX2 forced).
// kDims 0: j.dims.
template <class P, bool kFp8, bool kBf16In, uint32_t kDims>
void EncodeIdxRows(const EncodeJob& j) {
  const uint32_t dims = kDims != 0 ? kDims : j.dims;
  // Four keys planned together (the four int8 scales' divisions in one vector), one group ahead:
  // the next four are planned before this four's values are written, so that planning overlaps
  // value work.
  constexpr uint32_t kGroup = 4;
  TilePlan plans[2][kGroup];
  auto plan = [&](uint32_t first, uint32_t which) {
    const uint32_t n = j.count - first < kGroup ? j.count - first : kGroup;
    const uint8_t* x = j.rows + first * j.row_stride;
    if constexpr (kFp8) {
      P::template PlanE4m3<kBf16In>(x, j.row_stride, dims, n, ScaleRule::kPow2Fp32AmaxFloor, plans[which]);
    } else {
      P::template PlanInt8<kBf16In>(x, j.row_stride, dims, n, plans[which]);
    }
  };
  if (j.count > 0) plan(0, 0);
  for (uint32_t g = 0; g < j.count; g += kGroup) {
    const uint32_t which = (g / kGroup) & 1;
    if (g + kGroup < j.count) plan(g + kGroup, which ^ 1);
    for (uint32_t k = 0; k < kGroup && g + k < j.count; ++k) {
      const uint32_t slot = j.first_slot + g + k;
      const uint8_t* x = j.rows + (g + k) * j.row_stride;
      uint8_t* values = j.page + IdxValueOffset(dims, slot);
      if constexpr (kFp8) {
        P::template ApplyE4m3<kBf16In>(x, dims, plans[which][k], values);
      } else {
        P::template ApplyInt8<kBf16In>(x, dims, plans[which][k], values);
      }
      StoreF32(j.page + IdxScaleOffset(dims, j.entries, slot), plans[which][k].scale);
    }
  }
}

template <class P, bool kFp8, bool kBf16In>
void EncodeIdx(const EncodeJob& j) {
  if (j.dims == 128) {
    EncodeIdxRows<P, kFp8, kBf16In, 128>(j);
  } else {
    EncodeIdxRows<P, kFp8, kBf16In, 0>(j);
  }
}

template <class P, bool kFp8, bool kBf16Out, uint32_t kDims>
void DecodeIdxRows(const DecodeJob& j) {
  const uint32_t dims = kDims != 0 ? kDims : j.dims;
  for (uint32_t r = 0; r < j.count; ++r) {
    const uint32_t slot = j.first_slot + r;
    const uint8_t* values = j.page + IdxValueOffset(dims, slot);
    const float scale = LoadF32(j.page + IdxScaleOffset(dims, j.entries, slot));
    uint8_t* y = j.rows + r * j.row_stride;
    if constexpr (kFp8) {
      P::template DecodeE4m3<kBf16Out>(values, scale, dims, y);
    } else {
      P::template DecodeInt8<kBf16Out>(values, scale, dims, y);
    }
  }
}

template <class P, bool kFp8, bool kBf16Out>
void DecodeIdx(const DecodeJob& j) {
  if (j.dims == 128) {
    DecodeIdxRows<P, kFp8, kBf16Out, 128>(j);
  } else {
    DecodeIdxRows<P, kFp8, kBf16Out, 0>(j);
  }
}

// ---- bf16 and fp32: raw values ----

template <class P, bool kBf16Stored, bool kBf16In>
void EncodeRaw(const EncodeJob& j) {
  const uint64_t entry_bytes = uint64_t{j.dims} * kElemBytes<kBf16Stored>;
  for (uint32_t r = 0; r < j.count; ++r) {
    const uint8_t* x = j.rows + r * j.row_stride;
    uint8_t* dst = j.page + (j.first_slot + r) * entry_bytes;
    if constexpr (kBf16Stored) {
      P::template ToBf16<kBf16In>(x, j.dims, dst);
    } else {
      P::template ToFp32<kBf16In>(x, j.dims, dst);
    }
  }
}

template <class P, bool kBf16Stored, bool kBf16Out>
void DecodeRaw(const DecodeJob& j) {
  const uint64_t entry_bytes = uint64_t{j.dims} * kElemBytes<kBf16Stored>;
  for (uint32_t r = 0; r < j.count; ++r) {
    const uint8_t* src = j.page + (j.first_slot + r) * entry_bytes;
    uint8_t* y = j.rows + r * j.row_stride;
    if constexpr (kBf16Stored) {
      FromBf16<P, kBf16Out>(src, j.dims, y);
    } else {
      FromFp32<P, kBf16Out>(src, j.dims, y);
    }
  }
}

// ---- the public tile primitives over P ----

template <class P>
void TileInt8ToFp32(const int8_t* v, float s, uint32_t n, float* out) {
  P::template DecodeInt8<false>(reinterpret_cast<const uint8_t*>(v), s, n,
                                reinterpret_cast<uint8_t*>(out));
}
template <class P>
void TileInt8ToBf16(const int8_t* v, float s, uint32_t n, uint16_t* out) {
  P::template DecodeInt8<true>(reinterpret_cast<const uint8_t*>(v), s, n,
                               reinterpret_cast<uint8_t*>(out));
}
template <class P>
void TileE4m3ToFp32(const uint8_t* c, float s, uint32_t n, float* out) {
  P::template DecodeE4m3<false>(c, s, n, reinterpret_cast<uint8_t*>(out));
}
template <class P>
void TileE4m3ToBf16(const uint8_t* c, float s, uint32_t n, uint16_t* out) {
  P::template DecodeE4m3<true>(c, s, n, reinterpret_cast<uint8_t*>(out));
}
template <class P>
void TileBf16ToFp32(const uint16_t* v, uint32_t n, float* out) {
  FromBf16<P, false>(reinterpret_cast<const uint8_t*>(v), n,
                              reinterpret_cast<uint8_t*>(out));
}
template <class P>
void TileFp32ToBf16(const float* v, uint32_t n, uint16_t* out) {
  FromFp32<P, true>(reinterpret_cast<const uint8_t*>(v), n,
                             reinterpret_cast<uint8_t*>(out));
}

template <class P, bool kFp8>
constexpr FormatKernels kMla8Kernels = {{&EncodeMla8<P, kFp8, false>, &EncodeMla8<P, kFp8, true>},
                                        {&DecodeMla8<P, kFp8, false>, &DecodeMla8<P, kFp8, true>}};
template <class P, bool kFp8>
constexpr FormatKernels kIdxKernels = {{&EncodeIdx<P, kFp8, false>, &EncodeIdx<P, kFp8, true>},
                                       {&DecodeIdx<P, kFp8, false>, &DecodeIdx<P, kFp8, true>}};
template <class P, bool kBf16Stored>
constexpr FormatKernels kRawKernels = {
    {&EncodeRaw<P, kBf16Stored, false>, &EncodeRaw<P, kBf16Stored, true>},
    {&DecodeRaw<P, kBf16Stored, false>, &DecodeRaw<P, kBf16Stored, true>}};

// In StorageFormat order: bf16, fp32, c8_mla, fp8_ds_mla, fp8_v4, idx_fp8, idx_c8.
template <class P>
constexpr PathKernels MakePathKernels(SimdPath path) {
  return PathKernels{
      {kRawKernels<P, true>, kRawKernels<P, false>, kMla8Kernels<P, false>, kMla8Kernels<P, true>,
       FormatKernels{{&EncodeFp8V4<P, false>, &EncodeFp8V4<P, true>},
                     {&DecodeFp8V4<P, false>, &DecodeFp8V4<P, true>}},
       kIdxKernels<P, true>, kIdxKernels<P, false>},
      TileKernels{path, &TileInt8ToFp32<P>, &TileInt8ToBf16<P>, &TileE4m3ToFp32<P>,
                  &TileE4m3ToBf16<P>, &TileBf16ToFp32<P>, &TileFp32ToBf16<P>}};
}

static_assert(static_cast<int>(StorageFormat::kBf16) == 0 &&
                  static_cast<int>(StorageFormat::kFp32) == 1 &&
                  static_cast<int>(StorageFormat::kC8Mla) == 2 &&
                  static_cast<int>(StorageFormat::kFp8DsMla) == 3 &&
                  static_cast<int>(StorageFormat::kFp8V4) == 4 &&
                  static_cast<int>(StorageFormat::kIdxFp8) == 5 &&
                  static_cast<int>(StorageFormat::kIdxC8) == 6,
              "MakePathKernels lists formats in StorageFormat order");

}  // namespace
}  // namespace sparsekv::compress
