// Cache kinds and storage formats: what a page of each kind holds and how many bytes it takes.
//
// The byte layouts follow the public DeepSeek/FlashMLA kernels so that an engine can hand our
// pages to the kernels it already uses (see README "Storage formats"). Everything here is a pure
// function of its arguments; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "sparsekv/status.h"

namespace sparsekv {

// What a cache page holds for one layer of one token block.
enum class CacheKind : uint8_t {
  kMlaLatent = 0,     // V3.2 MLA latent: 512 "nope" + 64 rope dims per token
  kIndexerKey,        // Lightning Indexer keys, one per `ratio` tokens
  kCsaCompressed,     // V4 CSA: one compressed entry per 4 tokens
  kHcaCompressed,     // V4 HCA: one compressed entry per 128 tokens
  kSwaWindow,         // V4 sliding-window KV, one entry per token
  kCompressorState,   // V4 compressor's fp32 running state at the block boundary
};
inline constexpr int kNumCacheKinds = 6;

std::string_view CacheKindName(CacheKind kind);
Result<CacheKind> ParseCacheKind(std::string_view name);
// Kinds whose every block back to the start is needed to resume decoding (all but the sliding
// window and the compressor snapshot).
bool IsFullHistoryKind(CacheKind kind);

enum class StorageFormat : uint8_t {
  kBf16 = 0,   // raw bf16 values: 2 x dims bytes
  kFp32,       // raw fp32 values: 4 x dims bytes (compressor state)
  kC8Mla,      // 512 int8 (4 tiles of 128) | 64 bf16 rope | 4 fp32 scales = 656 B/token (CANN)
  kFp8DsMla,   // 512 fp8 e4m3 (4 tiles) | 4 fp32 power-of-two scales | 64 bf16 rope = 656 B
  kFp8V4,      // page: n x (448 fp8 + 64 bf16) then n x (7 ue8m0 + 1 pad), padded to 576 B
  kIdxFp8,     // page: n x dims fp8 values then n x fp32 scales
  kIdxC8,      // page: n x dims int8 values then n x fp32 scales
};
inline constexpr int kNumStorageFormats = 7;

std::string_view StorageFormatName(StorageFormat format);
Result<StorageFormat> ParseStorageFormat(std::string_view name);

// Checks that `format` can store entries of `dims` values of `kind`, with an error naming both.
Status CheckFormatFits(StorageFormat format, CacheKind kind, uint32_t dims);

// Bytes one entry takes, page padding aside. Precondition: CheckFormatFits passed.
uint64_t FormatEntryBytes(StorageFormat format, uint32_t dims);

// Bytes of one page holding `entries` entries (one layer of one block), padding included.
uint64_t FormatPageBytes(StorageFormat format, uint32_t dims, uint32_t entries);

// Fixed facts of the 8-bit layouts (DESIGN.md, "Storage formats").
namespace layout {
inline constexpr uint32_t kMlaDims = 576;          // 512 nope + 64 rope
inline constexpr uint32_t kMlaNopeDims = 512;
inline constexpr uint32_t kMlaRopeDims = 64;
inline constexpr uint32_t kMlaTile = 128;          // c8_mla / fp8_ds_mla scale tile
inline constexpr uint32_t kMla8BitBytes = 656;     // 512 + 4*4 + 64*2
// Within a token's 656 bytes. fp8_ds_mla keeps FlashMLA's order, nope | scales | rope
// (FlashMLA README, "FP8 KV cache"); c8_mla keeps CANN's, nope | rope | scales (the key of
// npu_kv_quant_sparse_flash_attention with key_quant_mode 2, tile 128).
inline constexpr uint32_t kDsMlaScaleOffset = 512;
inline constexpr uint32_t kDsMlaRopeOffset = 528;
inline constexpr uint32_t kC8MlaRopeOffset = 512;
inline constexpr uint32_t kC8MlaScaleOffset = 640;

inline constexpr uint32_t kV4Dims = 512;           // 448 nope + 64 rope
inline constexpr uint32_t kV4NopeDims = 448;
inline constexpr uint32_t kV4RopeDims = 64;
inline constexpr uint32_t kV4Tile = 64;            // ue8m0 scale tile
inline constexpr uint32_t kV4Scales = 7;           // 448 / 64
inline constexpr uint32_t kV4DataBytes = 576;      // 448 fp8 + 64 bf16
inline constexpr uint32_t kV4ScaleBytes = 8;       // 7 ue8m0 + 1 pad
inline constexpr uint32_t kV4PageAlign = 576;

inline constexpr uint32_t kIdxScaleBytes = 4;      // one fp32 per indexer entry

// Byte offsets inside one page of `entries` entries.
inline constexpr uint64_t Fp8V4DataOffset(uint32_t entry) { return uint64_t{entry} * kV4DataBytes; }
inline constexpr uint64_t Fp8V4ScaleOffset(uint32_t entries, uint32_t entry) {
  return uint64_t{entries} * kV4DataBytes + uint64_t{entry} * kV4ScaleBytes;
}
inline constexpr uint64_t IdxValueOffset(uint32_t dims, uint32_t entry) { return uint64_t{entry} * dims; }
inline constexpr uint64_t IdxScaleOffset(uint32_t dims, uint32_t entries, uint32_t entry) {
  return uint64_t{entries} * dims + uint64_t{entry} * kIdxScaleBytes;
}
}  // namespace layout

}  // namespace sparsekv
