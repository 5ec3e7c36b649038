// ModelSpec: which cache kinds each layer of a model keeps, with dims, ratio and format.
//
// Built from a preset (`deepseek-v3.2-exp`, `deepseek-v4-flash`) or a JSON spec file, and
// checked by Validate(), whose errors name the layer and field at fault. A ModelSpec is a
// plain value; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/status.h"
#include "sparsekv/storage_format.h"

namespace sparsekv {

struct KindSpec {
  CacheKind kind = CacheKind::kMlaLatent;
  StorageFormat format = StorageFormat::kBf16;
  // Values per entry (per row for kCompressorState). Default: 0 (must be set).
  uint32_t dims = 0;
  // Tokens per entry: 1 = one entry per token; a power of two. Default: 1.
  uint32_t ratio = 1;
  // kCompressorState only: rows of each of the two snapshot tensors (kv and score), coff*ratio.
  // Default: 0.
  uint32_t state_rows = 0;

  bool operator==(const KindSpec&) const = default;
};

struct LayerSpec {
  std::vector<KindSpec> kinds;  // at most one of each CacheKind
  bool operator==(const LayerSpec&) const = default;
};

struct ModelSpec {
  std::string name;
  std::vector<LayerSpec> layers;
  // Sliding-window length in tokens; required when a layer keeps kSwaWindow. Default: 0.
  uint32_t window_tokens = 0;
  // Attention heads of the sparse MLA query (informative; kernels use it). Default: 0.
  uint32_t attention_heads = 0;
  // Lightning Indexer heads and top-k (informative; kernels use them). Default: 0.
  uint32_t indexer_heads = 0;
  uint32_t indexer_topk = 0;

  // Checks every layer and kind; the error names the layer, the kind and what was expected.
  Status Validate() const;
  bool operator==(const ModelSpec&) const = default;
};

// The 8-bit choice an engine makes for the MLA latent / compressed KV and the indexer keys.
enum class KvPrecision : uint8_t {
  kBf16,  // bf16 everywhere
  kC8,    // c8_mla + idx_c8 (V3.2 only; V4's layout is FP8)
  kFp8,   // fp8_ds_mla + idx_fp8 (V3.2), fp8_v4 + idx_fp8 (V4)
};
Result<KvPrecision> ParseKvPrecision(std::string_view name);
std::string_view KvPrecisionName(KvPrecision p);

// Names of the built-in presets.
std::vector<std::string> ModelPresetNames();
// A preset with its kinds stored at `precision`. Errors: unknown name (the message lists the
// presets), a precision the model has no layout for.
Result<ModelSpec> ModelPreset(std::string_view name, KvPrecision precision = KvPrecision::kBf16);

// JSON spec files. Shape:
//   {"name": "...", "window_tokens": 128,
//    "layers": [{"kinds": [{"kind": "mla_latent", "format": "bf16", "dims": 576, "ratio": 1}]}],
//    "repeat": optional, see README}
// Errors name the JSON path of the bad field. The result is validated.
Result<ModelSpec> ParseModelSpecJson(std::string_view json_text);
Result<ModelSpec> LoadModelSpecFile(const std::string& path);
std::string ModelSpecToJson(const ModelSpec& spec, int indent = 2);

}  // namespace sparsekv
