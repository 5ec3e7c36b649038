#include "sparsekv/codec.h"

#include <fmt/format.h>

#include <bit>
#include <cstring>

#include "compress/kernels.h"
#include "sparsekv/tile_kernels.h"

namespace sparsekv {
namespace compress {

const PathKernels* KernelsFor(SimdPath path) {
  if (!SimdPathSupported(path)) return nullptr;
  switch (path) {
    case SimdPath::kScalar:
      return ScalarPathKernels();
    case SimdPath::kAvx2:
      return Avx2PathKernels();
    case SimdPath::kAvx512:
      return Avx512PathKernels();
    case SimdPath::kAvx512Bf16:
      return Avx512Bf16PathKernels();
    case SimdPath::kNeon:
      return NeonPathKernels();
  }
  return nullptr;
}

}  // namespace compress

namespace {

Status CheckDims(StorageFormat format, uint32_t dims) {
  const std::string_view name = StorageFormatName(format);
  switch (format) {
    case StorageFormat::kBf16:
    case StorageFormat::kFp32:
      if (dims == 0)
        return Status::InvalidArgument(fmt::format("format {} needs at least 1 dim", name));
      return Status::OK();
    case StorageFormat::kC8Mla:
    case StorageFormat::kFp8DsMla:
      if (dims != layout::kMlaDims) {
        return Status::InvalidArgument(fmt::format("format {} stores entries of {} dims, got {}",
                                                   name, layout::kMlaDims, dims));
      }
      return Status::OK();
    case StorageFormat::kFp8V4:
      if (dims != layout::kV4Dims) {
        return Status::InvalidArgument(fmt::format("format {} stores entries of {} dims, got {}",
                                                   name, layout::kV4Dims, dims));
      }
      return Status::OK();
    case StorageFormat::kIdxFp8:
    case StorageFormat::kIdxC8:
      if (dims == 0 || dims % 16 != 0) {
        return Status::InvalidArgument(fmt::format(
            "format {} needs dims that are a positive multiple of 16, got {}", name, dims));
      }
      return Status::OK();
  }
  return Status::InvalidArgument(
      fmt::format("unknown storage format {}", static_cast<int>(format)));
}

size_t ElemBytes(RowType type) {
  return type == RowType::kBf16 ? 2 : 4;
}

template <typename View>
Status CheckRows(const char* op, const View& rows, uint32_t first_slot, uint32_t dims,
                 uint32_t entries) {
  if (rows.type != RowType::kFp32 && rows.type != RowType::kBf16) {
    return Status::InvalidArgument(
        fmt::format("{}: unknown row type {}", op, static_cast<int>(rows.type)));
  }
  if (first_slot > entries || rows.count > entries - first_slot) {
    return Status::OutOfRange(fmt::format("{}: slots [{}, {}) are past the page's {} entries", op,
                                          first_slot, uint64_t{first_slot} + rows.count, entries));
  }
  if (rows.count == 0) return Status::OK();
  if (rows.data == nullptr) return Status::InvalidArgument(fmt::format("{}: null rows", op));
  if (rows.dims != dims) {
    return Status::InvalidArgument(
        fmt::format("{}: rows have {} dims, the page's entries have {}", op, rows.dims, dims));
  }
  if (rows.stride_bytes < size_t{dims} * ElemBytes(rows.type)) {
    return Status::InvalidArgument(
        fmt::format("{}: row stride {} bytes is shorter than a row of {} bytes", op,
                    rows.stride_bytes, size_t{dims} * ElemBytes(rows.type)));
  }
  return Status::OK();
}

}  // namespace

Result<PageCodec> PageCodec::Create(StorageFormat format, uint32_t dims, uint32_t entries,
                                    const CodecOptions& options) {
  if (static_cast<int>(format) >= kNumStorageFormats) {
    return Status::InvalidArgument(
        fmt::format("unknown storage format {}", static_cast<int>(format)));
  }
  SPARSEKV_RETURN_IF_ERROR(CheckDims(format, dims));
  if (entries == 0) return Status::InvalidArgument("a page needs at least 1 entry");
  const SimdPath path = options.simd_path.value_or(ActiveSimdPath());
  const compress::PathKernels* kernels = compress::KernelsFor(path);
  if (kernels == nullptr) {
    return Status::NotSupported(
        fmt::format("SIMD path {} is not supported by this CPU", SimdPathName(path)));
  }
  PageCodec codec;
  codec.format_ = format;
  codec.dims_ = dims;
  codec.entries_ = entries;
  codec.path_ = path;
  codec.page_bytes_ = FormatPageBytes(format, dims, entries);
  codec.kernels_ = &kernels->formats[static_cast<int>(format)];
  return codec;
}

Status PageCodec::WriteTokens(void* page, uint32_t first_slot, const RowsView& rows) const {
  if (page == nullptr) return Status::InvalidArgument("WriteTokens: null page");
  SPARSEKV_RETURN_IF_ERROR(CheckRows("WriteTokens", rows, first_slot, dims_, entries_));
  if (rows.count == 0) return Status::OK();
  const compress::EncodeJob job{static_cast<const uint8_t*>(rows.data),
                                rows.stride_bytes,
                                rows.count,
                                static_cast<uint8_t*>(page),
                                entries_,
                                dims_,
                                first_slot};
  kernels_->encode[static_cast<int>(rows.type)](job);
  return Status::OK();
}

Status PageCodec::ReadTokens(const void* page, uint32_t first_slot,
                             const MutableRowsView& rows) const {
  if (page == nullptr) return Status::InvalidArgument("ReadTokens: null page");
  SPARSEKV_RETURN_IF_ERROR(CheckRows("ReadTokens", rows, first_slot, dims_, entries_));
  if (rows.count == 0) return Status::OK();
  const compress::DecodeJob job{
      static_cast<const uint8_t*>(page), entries_,         dims_, first_slot, rows.count,
      static_cast<uint8_t*>(rows.data),  rows.stride_bytes};
  kernels_->decode[static_cast<int>(rows.type)](job);
  return Status::OK();
}

void PageCodec::DecodeEntryFp32(const void* page, uint32_t slot, float* out) const {
  const compress::DecodeJob job{static_cast<const uint8_t*>(page), entries_,         dims_, slot, 1,
                                reinterpret_cast<uint8_t*>(out),   size_t{dims_} * 4};
  kernels_->decode[static_cast<int>(RowType::kFp32)](job);
}

void PageCodec::DecodeEntriesFp32(const void* page, uint32_t first_slot, uint32_t count,
                                  float* out) const {
  const compress::DecodeJob job{static_cast<const uint8_t*>(page), entries_,         dims_,
                                first_slot,                         count,
                                reinterpret_cast<uint8_t*>(out),   size_t{dims_} * 4};
  kernels_->decode[static_cast<int>(RowType::kFp32)](job);
}

void PageCodec::DecodeEntryBf16(const void* page, uint32_t slot, uint16_t* out) const {
  const compress::DecodeJob job{static_cast<const uint8_t*>(page), entries_,         dims_, slot, 1,
                                reinterpret_cast<uint8_t*>(out),   size_t{dims_} * 2};
  kernels_->decode[static_cast<int>(RowType::kBf16)](job);
}

Result<const TileKernels*> TileKernelsFor(SimdPath path) {
  const compress::PathKernels* k = compress::KernelsFor(path);
  if (k == nullptr) {
    return Status::NotSupported(
        fmt::format("SIMD path {} is not supported by this CPU", SimdPathName(path)));
  }
  return &k->tiles;
}

const TileKernels& ActiveTileKernels() {
  return compress::KernelsFor(ActiveSimdPath())->tiles;
}

Status ExportIdxC8(const PageCodec& codec, const void* page, uint32_t first_slot, uint32_t count,
                   int8_t* keys, uint16_t* scales_fp16) {
  if (codec.format() != StorageFormat::kIdxC8) {
    return Status::InvalidArgument(fmt::format("ExportIdxC8: the codec's format is {}, not idx_c8",
                                               StorageFormatName(codec.format())));
  }
  if (page == nullptr || keys == nullptr || scales_fp16 == nullptr)
    return Status::InvalidArgument("ExportIdxC8: null page or output");
  if (first_slot > codec.entries() || count > codec.entries() - first_slot) {
    return Status::InvalidArgument(fmt::format(
        "ExportIdxC8: slots {} .. {} are past the page's {} entries", first_slot,
        uint64_t{first_slot} + count, codec.entries()));
  }
  const auto* p = static_cast<const uint8_t*>(page);
  const uint32_t dims = codec.dims();
  std::memcpy(keys, p + layout::IdxValueOffset(dims, first_slot), uint64_t{count} * dims);
  for (uint32_t i = 0; i < count; ++i) {
    float s;
    std::memcpy(&s, p + layout::IdxScaleOffset(dims, codec.entries(), first_slot + i), 4);
    // GCC's half conversion is IEEE's: nearest even, overflow to infinity, NaN kept. GCC 12 has
    // _Float16 in C++ on x86-64 only; AArch64's __fp16 is the same IEEE binary16.
#if defined(__aarch64__)
    scales_fp16[i] = std::bit_cast<uint16_t>(static_cast<__fp16>(s));
#else
    scales_fp16[i] = std::bit_cast<uint16_t>(static_cast<_Float16>(s));
#endif
  }
  return Status::OK();
}

}  // namespace sparsekv
