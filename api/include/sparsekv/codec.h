// PageCodec: writes rows of bf16 or fp32 values into the slots of a cache page in one storage
// format, and reads them back.
//
// A page holds `entries` entries of `dims` values (one layer of one token block; see
// block_geometry.h) and takes FormatPageBytes(format, dims, entries) bytes, laid out as
// storage_format.h's `layout::` offsets say. The codec knows the entry count because the
// page-major formats (fp8_v4, idx_fp8, idx_c8) keep every entry's scales after all entries'
// values. "Token" below means one entry: a token of mla_latent or swa_window, a compressed
// entry of csa/hca_compressed, a key of indexer_key.
//
// What each format does to a value, its error bound, and what NaN and infinity do, are in the
// README ("Storage formats"). In short: int8 tiles use scale = amax / 127 and a NaN or infinity
// makes its whole tile decode as NaN; fp8 tiles store NaN and infinity as the NaN code in that
// element only; rope parts and bf16 rows are stored exactly (fp32 input is rounded to bf16).
//
// Ownership: a PageCodec is a small value holding only its parameters and the kernels of its
// SIMD path; pages and rows belong to the caller. Rows and page must not overlap.
// Thread safety: all methods are const and thread-safe. Writes to distinct slots of one page
// touch disjoint bytes, so threads may fill different slots of a page at once; a slot must not
// be read while it is being written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "sparsekv/cpu_features.h"
#include "sparsekv/status.h"
#include "sparsekv/storage_format.h"

namespace sparsekv {

// Element type of caller rows.
enum class RowType : uint8_t {
  kFp32 = 0,
  kBf16,  // raw bf16 bits in a uint16_t
};

// `count` rows of `dims` values each; row r starts at data + r * stride_bytes.
struct RowsView {
  const void* data = nullptr;
  RowType type = RowType::kBf16;
  uint32_t count = 0;
  uint32_t dims = 0;
  size_t stride_bytes = 0;  // at least dims * element size

  static RowsView Fp32(const float* data, uint32_t count, uint32_t dims, size_t stride_bytes = 0) {
    return {data, RowType::kFp32, count, dims, stride_bytes ? stride_bytes : size_t{dims} * 4};
  }
  static RowsView Bf16(const uint16_t* data, uint32_t count, uint32_t dims,
                       size_t stride_bytes = 0) {
    return {data, RowType::kBf16, count, dims, stride_bytes ? stride_bytes : size_t{dims} * 2};
  }
};

// The same, writable: where ReadTokens puts decoded rows.
struct MutableRowsView {
  void* data = nullptr;
  RowType type = RowType::kBf16;
  uint32_t count = 0;
  uint32_t dims = 0;
  size_t stride_bytes = 0;

  static MutableRowsView Fp32(float* data, uint32_t count, uint32_t dims, size_t stride_bytes = 0) {
    return {data, RowType::kFp32, count, dims, stride_bytes ? stride_bytes : size_t{dims} * 4};
  }
  static MutableRowsView Bf16(uint16_t* data, uint32_t count, uint32_t dims,
                              size_t stride_bytes = 0) {
    return {data, RowType::kBf16, count, dims, stride_bytes ? stride_bytes : size_t{dims} * 2};
  }
};

struct CodecOptions {
  // SIMD path of this codec's kernels. Default: unset, meaning ActiveSimdPath() at Create.
  std::optional<SimdPath> simd_path;
};

namespace compress {
struct FormatKernels;  // private to compress/
}

class PageCodec {
 public:
  // Errors: a format that cannot hold `dims` (as CheckFormatFits says for the kinds the format
  // stores), zero entries, a SIMD path this CPU does not support.
  static Result<PageCodec> Create(StorageFormat format, uint32_t dims, uint32_t entries,
                                  const CodecOptions& options = {});

  StorageFormat format() const { return format_; }
  uint32_t dims() const { return dims_; }
  uint32_t entries() const { return entries_; }
  SimdPath simd_path() const { return path_; }
  // FormatPageBytes(format, dims, entries): the bytes a page must have.
  uint64_t page_bytes() const { return page_bytes_; }

  // Encodes rows.count rows into slots [first_slot, first_slot + rows.count) of `page`.
  // Touches only those slots' bytes (values, scales, pad byte); page padding is left alone.
  // Errors (nothing written): a null page or rows, rows of other dims, a stride shorter than a
  // row, slots past the page's entries.
  Status WriteTokens(void* page, uint32_t first_slot, const RowsView& rows) const;
  // Decodes slots [first_slot, first_slot + rows.count) into `rows`. Same errors.
  Status ReadTokens(const void* page, uint32_t first_slot, const MutableRowsView& rows) const;

  // Hot-path forms for kernels that walk pages in place: decode one entry of `dims` values.
  // Unchecked: slot < entries(), `out` holds dims() values, `page` is a page of this codec.
  void DecodeEntryFp32(const void* page, uint32_t slot, float* out) const;
  void DecodeEntryBf16(const void* page, uint32_t slot, uint16_t* out) const;
  // Slots [first_slot, first_slot + count) into `count` rows of dims() values, back to back.
  // Unchecked like the above: first_slot + count <= entries().
  void DecodeEntriesFp32(const void* page, uint32_t first_slot, uint32_t count, float* out) const;

 private:
  PageCodec() = default;
  StorageFormat format_ = StorageFormat::kBf16;
  uint32_t dims_ = 0;
  uint32_t entries_ = 0;
  SimdPath path_ = SimdPath::kScalar;
  uint64_t page_bytes_ = 0;
  const compress::FormatKernels* kernels_ = nullptr;
};

// An idx_c8 page in the shape vllm-ascend's C8 indexer caches keep (two tensors: int8 keys
// [count, dims] and one fp16 scale per key), for slots [first_slot, first_slot + count).
// `keys` gets count x dims bytes (the page's own values: they can also be used in place, as a
// [entries, dims] int8 view at offset 0 of the page); `scales_fp16` gets count IEEE fp16 bit
// patterns, each the page's fp32 scale rounded to nearest even (beyond 65504: infinity; a NaN
// scale, an idx_c8 row that held NaN or inf: NaN). The values stay those our fp32 scale
// chose, so a reader's key * fp16 scale differs from ours by the scale's rounding (at most
// 2^-11 relative for scales of 2^-14 and above).
// Errors: a codec of another format, null outputs, slots past the page's entries.
Status ExportIdxC8(const PageCodec& codec, const void* page, uint32_t first_slot, uint32_t count,
                   int8_t* keys, uint16_t* scales_fp16);

}  // namespace sparsekv
