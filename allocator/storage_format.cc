#include "sparsekv/storage_format.h"

#include <fmt/format.h>

#include <array>

namespace sparsekv {
namespace {

constexpr std::array<std::string_view, kNumCacheKinds> kKindNames = {
    "mla_latent", "indexer_key", "csa_compressed", "hca_compressed", "swa_window", "compressor_state"};
constexpr std::array<std::string_view, kNumStorageFormats> kFormatNames = {
    "bf16", "fp32", "c8_mla", "fp8_ds_mla", "fp8_v4", "idx_fp8", "idx_c8"};

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

template <size_t N>
std::string JoinNames(const std::array<std::string_view, N>& names) {
  std::string out;
  for (auto n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

}  // namespace

std::string_view CacheKindName(CacheKind kind) { return kKindNames[static_cast<size_t>(kind)]; }

Result<CacheKind> ParseCacheKind(std::string_view name) {
  for (size_t i = 0; i < kKindNames.size(); ++i) {
    if (kKindNames[i] == name) return static_cast<CacheKind>(i);
  }
  return Status::InvalidArgument(
      fmt::format("unknown cache kind '{}'; expected one of {}", name, JoinNames(kKindNames)));
}

bool IsFullHistoryKind(CacheKind kind) {
  return kind != CacheKind::kSwaWindow && kind != CacheKind::kCompressorState;
}

std::string_view StorageFormatName(StorageFormat format) {
  return kFormatNames[static_cast<size_t>(format)];
}

Result<StorageFormat> ParseStorageFormat(std::string_view name) {
  for (size_t i = 0; i < kFormatNames.size(); ++i) {
    if (kFormatNames[i] == name) return static_cast<StorageFormat>(i);
  }
  return Status::InvalidArgument(
      fmt::format("unknown storage format '{}'; expected one of {}", name, JoinNames(kFormatNames)));
}

Status CheckFormatFits(StorageFormat format, CacheKind kind, uint32_t dims) {
  const auto fname = StorageFormatName(format);
  const auto kname = CacheKindName(kind);
  if (dims == 0) return Status::InvalidArgument(fmt::format("{} has zero dims", kname));
  const bool is_state = kind == CacheKind::kCompressorState;
  if (is_state != (format == StorageFormat::kFp32)) {
    return Status::InvalidArgument(fmt::format(
        "format {} does not fit kind {}: compressor_state is stored as fp32 and only it", fname, kname));
  }
  switch (format) {
    case StorageFormat::kBf16:
    case StorageFormat::kFp32:
      return Status::OK();
    case StorageFormat::kC8Mla:
    case StorageFormat::kFp8DsMla:
      if (kind != CacheKind::kMlaLatent || dims != layout::kMlaDims) {
        return Status::InvalidArgument(fmt::format(
            "format {} stores mla_latent entries of {} dims, got {} with {} dims", fname,
            layout::kMlaDims, kname, dims));
      }
      return Status::OK();
    case StorageFormat::kFp8V4:
      if ((kind != CacheKind::kCsaCompressed && kind != CacheKind::kHcaCompressed &&
           kind != CacheKind::kSwaWindow) ||
          dims != layout::kV4Dims) {
        return Status::InvalidArgument(fmt::format(
            "format {} stores csa_compressed, hca_compressed or swa_window entries of {} dims, got "
            "{} with {} dims",
            fname, layout::kV4Dims, kname, dims));
      }
      return Status::OK();
    case StorageFormat::kIdxFp8:
    case StorageFormat::kIdxC8:
      if (kind != CacheKind::kIndexerKey) {
        return Status::InvalidArgument(
            fmt::format("format {} stores indexer_key entries, got {}", fname, kname));
      }
      if (dims % 16 != 0) {
        return Status::InvalidArgument(
            fmt::format("format {} needs dims that are a multiple of 16, got {}", fname, dims));
      }
      return Status::OK();
  }
  return Status::Internal("unhandled storage format");
}

uint64_t FormatEntryBytes(StorageFormat format, uint32_t dims) {
  switch (format) {
    case StorageFormat::kBf16: return 2ull * dims;
    case StorageFormat::kFp32: return 4ull * dims;
    case StorageFormat::kC8Mla:
    case StorageFormat::kFp8DsMla: return layout::kMla8BitBytes;
    case StorageFormat::kFp8V4: return layout::kV4DataBytes + layout::kV4ScaleBytes;
    case StorageFormat::kIdxFp8:
    case StorageFormat::kIdxC8: return uint64_t{dims} + layout::kIdxScaleBytes;
  }
  return 0;
}

uint64_t FormatPageBytes(StorageFormat format, uint32_t dims, uint32_t entries) {
  const uint64_t raw = FormatEntryBytes(format, dims) * entries;
  if (format == StorageFormat::kFp8V4) return RoundUp(raw, layout::kV4PageAlign);
  return raw;
}

}  // namespace sparsekv
