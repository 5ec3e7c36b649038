#include "sparsekv/model_spec.h"

#include <fmt/format.h>

#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

namespace sparsekv {
namespace {

using nlohmann::json;

bool IsPowerOfTwo(uint32_t v) { return v != 0 && (v & (v - 1)) == 0; }

Status CheckKind(const KindSpec& k, size_t layer) {
  const auto where = fmt::format("layer {} kind {}", layer, CacheKindName(k.kind));
  if (k.dims == 0) return Status::InvalidArgument(where + ": dims is 0; expected a positive count");
  if (!IsPowerOfTwo(k.ratio)) {
    return Status::InvalidArgument(
        fmt::format("{}: ratio {} is not a power of two (1, 2, 4, ...)", where, k.ratio));
  }
  if ((k.kind == CacheKind::kMlaLatent || k.kind == CacheKind::kSwaWindow) && k.ratio != 1) {
    return Status::InvalidArgument(
        fmt::format("{}: ratio {} but this kind keeps one entry per token (ratio 1)", where, k.ratio));
  }
  if ((k.kind == CacheKind::kCsaCompressed || k.kind == CacheKind::kHcaCompressed) && k.ratio < 2) {
    return Status::InvalidArgument(
        fmt::format("{}: ratio {} but a compressed kind needs ratio 2 or more", where, k.ratio));
  }
  if (k.kind == CacheKind::kCompressorState) {
    if (k.state_rows == 0) {
      return Status::InvalidArgument(where + ": state_rows is 0; expected coff*ratio rows");
    }
  } else if (k.state_rows != 0) {
    return Status::InvalidArgument(
        fmt::format("{}: state_rows {} is only meaningful for compressor_state", where, k.state_rows));
  }
  Status fits = CheckFormatFits(k.format, k.kind, k.dims);
  if (!fits.ok()) return fits.WithContext(where);
  return Status::OK();
}

std::vector<KindSpec> V32Layer(KvPrecision p) {
  StorageFormat mla = p == KvPrecision::kBf16  ? StorageFormat::kBf16
                      : p == KvPrecision::kC8 ? StorageFormat::kC8Mla
                                              : StorageFormat::kFp8DsMla;
  StorageFormat idx = p == KvPrecision::kBf16  ? StorageFormat::kBf16
                      : p == KvPrecision::kC8 ? StorageFormat::kIdxC8
                                              : StorageFormat::kIdxFp8;
  return {KindSpec{CacheKind::kMlaLatent, mla, 576, 1, 0},
          KindSpec{CacheKind::kIndexerKey, idx, 128, 1, 0}};
}

Result<ModelSpec> V32(KvPrecision p) {
  ModelSpec s;
  s.name = "deepseek-v3.2-exp";
  s.attention_heads = 128;
  s.indexer_heads = 64;
  s.indexer_topk = 2048;
  s.layers.assign(61, LayerSpec{V32Layer(p)});
  return s;
}

Result<ModelSpec> V4Flash(KvPrecision p) {
  if (p == KvPrecision::kC8) {
    return Status::NotSupported(
        "deepseek-v4-flash has no c8 layout (its 8-bit KV layout is fp8_v4); use --kv-format fp8 or bf16");
  }
  const StorageFormat kv = p == KvPrecision::kFp8 ? StorageFormat::kFp8V4 : StorageFormat::kBf16;
  const StorageFormat idx = p == KvPrecision::kFp8 ? StorageFormat::kIdxFp8 : StorageFormat::kBf16;
  ModelSpec s;
  s.name = "deepseek-v4-flash";
  s.window_tokens = 128;
  s.attention_heads = 64;
  s.indexer_heads = 32;
  s.indexer_topk = 512;
  // Compress ratio per layer: two sliding-window-only layers, then CSA (4) and HCA (128)
  // alternating. Compressor state is [coff*ratio, coff*512] fp32 for kv and for score, with
  // coff = 2 for CSA (overlapping windows) and 1 for HCA.
  for (int layer = 0; layer < 43; ++layer) {
    LayerSpec l;
    l.kinds.push_back({CacheKind::kSwaWindow, kv, 512, 1, 0});
    if (layer >= 2) {
      const bool csa = (layer - 2) % 2 == 0;
      if (csa) {
        l.kinds.push_back({CacheKind::kCsaCompressed, kv, 512, 4, 0});
        l.kinds.push_back({CacheKind::kIndexerKey, idx, 128, 4, 0});
        l.kinds.push_back({CacheKind::kCompressorState, StorageFormat::kFp32, 2 * 512, 4, 2 * 4});
      } else {
        l.kinds.push_back({CacheKind::kHcaCompressed, kv, 512, 128, 0});
        l.kinds.push_back({CacheKind::kCompressorState, StorageFormat::kFp32, 512, 128, 128});
      }
    }
    s.layers.push_back(std::move(l));
  }
  return s;
}

// JSON helpers: every error names the path of the field.
Result<uint32_t> GetU32(const json& obj, const std::string& key, const std::string& path,
                        std::optional<uint32_t> fallback) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (fallback) return *fallback;
    return Status::InvalidArgument(fmt::format("{}.{} is missing; expected a non-negative integer", path, key));
  }
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0)) {
    return Status::InvalidArgument(
        fmt::format("{}.{} is {}; expected a non-negative integer", path, key, it->dump()));
  }
  const uint64_t v = it->get<uint64_t>();
  if (v > UINT32_MAX) return Status::InvalidArgument(fmt::format("{}.{} = {} is too large", path, key, v));
  return static_cast<uint32_t>(v);
}

Result<std::string> GetString(const json& obj, const std::string& key, const std::string& path) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) {
    return Status::InvalidArgument(fmt::format("{}.{} is missing or not a string", path, key));
  }
  return it->get<std::string>();
}

Status CheckKeys(const json& obj, const std::string& path, std::initializer_list<std::string_view> allowed) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool ok = false;
    for (auto a : allowed) ok = ok || it.key() == a;
    if (!ok) {
      std::string list;
      for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
      return Status::InvalidArgument(
          fmt::format("{}: unknown field '{}'; expected one of {}", path, it.key(), list));
    }
  }
  return Status::OK();
}

Result<ModelSpec> FromJson(const json& root) {
  if (!root.is_object()) return Status::InvalidArgument("spec: the top level must be a JSON object");
  SPARSEKV_RETURN_IF_ERROR(CheckKeys(root, "spec",
                                     {"name", "layers", "window_tokens", "attention_heads",
                                      "indexer_heads", "indexer_topk"}));
  ModelSpec s;
  SPARSEKV_ASSIGN_OR_RETURN(s.name, GetString(root, "name", "spec"));
  SPARSEKV_ASSIGN_OR_RETURN(s.window_tokens, GetU32(root, "window_tokens", "spec", 0u));
  SPARSEKV_ASSIGN_OR_RETURN(s.attention_heads, GetU32(root, "attention_heads", "spec", 0u));
  SPARSEKV_ASSIGN_OR_RETURN(s.indexer_heads, GetU32(root, "indexer_heads", "spec", 0u));
  SPARSEKV_ASSIGN_OR_RETURN(s.indexer_topk, GetU32(root, "indexer_topk", "spec", 0u));
  auto layers = root.find("layers");
  if (layers == root.end() || !layers->is_array()) {
    return Status::InvalidArgument("spec.layers is missing or not an array");
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    const json& jl = (*layers)[i];
    const std::string lpath = fmt::format("spec.layers[{}]", i);
    if (!jl.is_object()) return Status::InvalidArgument(lpath + " must be an object");
    SPARSEKV_RETURN_IF_ERROR(CheckKeys(jl, lpath, {"kinds", "repeat"}));
    uint32_t repeat;
    SPARSEKV_ASSIGN_OR_RETURN(repeat, GetU32(jl, "repeat", lpath, 1u));
    if (repeat == 0 || repeat > 4096) {
      return Status::InvalidArgument(fmt::format("{}.repeat = {}; expected 1..4096", lpath, repeat));
    }
    auto kinds = jl.find("kinds");
    if (kinds == jl.end() || !kinds->is_array()) {
      return Status::InvalidArgument(lpath + ".kinds is missing or not an array");
    }
    LayerSpec layer;
    for (size_t k = 0; k < kinds->size(); ++k) {
      const json& jk = (*kinds)[k];
      const std::string kpath = fmt::format("{}.kinds[{}]", lpath, k);
      if (!jk.is_object()) return Status::InvalidArgument(kpath + " must be an object");
      SPARSEKV_RETURN_IF_ERROR(CheckKeys(jk, kpath, {"kind", "format", "dims", "ratio", "state_rows"}));
      KindSpec ks;
      std::string kind_name, format_name;
      SPARSEKV_ASSIGN_OR_RETURN(kind_name, GetString(jk, "kind", kpath));
      SPARSEKV_ASSIGN_OR_RETURN(format_name, GetString(jk, "format", kpath));
      auto kind = ParseCacheKind(kind_name);
      if (!kind.ok()) return kind.status().WithContext(kpath);
      auto format = ParseStorageFormat(format_name);
      if (!format.ok()) return format.status().WithContext(kpath);
      ks.kind = *kind;
      ks.format = *format;
      SPARSEKV_ASSIGN_OR_RETURN(ks.dims, GetU32(jk, "dims", kpath, std::nullopt));
      SPARSEKV_ASSIGN_OR_RETURN(ks.ratio, GetU32(jk, "ratio", kpath, 1u));
      SPARSEKV_ASSIGN_OR_RETURN(ks.state_rows, GetU32(jk, "state_rows", kpath, 0u));
      layer.kinds.push_back(ks);
    }
    for (uint32_t r = 0; r < repeat; ++r) s.layers.push_back(layer);
  }
  if (s.layers.size() > 4096) {
    return Status::InvalidArgument(fmt::format("spec has {} layers; at most 4096", s.layers.size()));
  }
  SPARSEKV_RETURN_IF_ERROR(s.Validate());
  return s;
}

}  // namespace

Status ModelSpec::Validate() const {
  if (name.empty()) return Status::InvalidArgument("model spec: name is empty");
  if (layers.empty()) return Status::InvalidArgument(fmt::format("model {}: no layers", name));
  bool has_swa = false;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].kinds.empty()) {
      return Status::InvalidArgument(fmt::format("model {}: layer {} keeps no cache kind", name, l));
    }
    uint32_t seen = 0;
    for (const KindSpec& k : layers[l].kinds) {
      const uint32_t bit = 1u << static_cast<uint32_t>(k.kind);
      if (seen & bit) {
        return Status::InvalidArgument(
            fmt::format("model {}: layer {} lists kind {} twice", name, l, CacheKindName(k.kind)));
      }
      seen |= bit;
      Status st = CheckKind(k, l);
      if (!st.ok()) return st.WithContext(fmt::format("model {}", name));
      has_swa = has_swa || k.kind == CacheKind::kSwaWindow;
    }
  }
  if (has_swa && window_tokens == 0) {
    return Status::InvalidArgument(
        fmt::format("model {}: a layer keeps swa_window but window_tokens is 0", name));
  }
  return Status::OK();
}

Result<KvPrecision> ParseKvPrecision(std::string_view name) {
  if (name == "bf16") return KvPrecision::kBf16;
  if (name == "c8") return KvPrecision::kC8;
  if (name == "fp8") return KvPrecision::kFp8;
  return Status::InvalidArgument(fmt::format("unknown kv format '{}'; expected bf16, c8 or fp8", name));
}

std::string_view KvPrecisionName(KvPrecision p) {
  switch (p) {
    case KvPrecision::kBf16: return "bf16";
    case KvPrecision::kC8: return "c8";
    case KvPrecision::kFp8: return "fp8";
  }
  return "?";
}

std::vector<std::string> ModelPresetNames() { return {"deepseek-v3.2-exp", "deepseek-v4-flash"}; }

Result<ModelSpec> ModelPreset(std::string_view name, KvPrecision precision) {
  Result<ModelSpec> spec = Status::NotFound("");
  if (name == "deepseek-v3.2-exp") {
    spec = V32(precision);
  } else if (name == "deepseek-v4-flash") {
    spec = V4Flash(precision);
  } else {
    return Status::NotFound(fmt::format("unknown model preset '{}'; expected deepseek-v3.2-exp or "
                                        "deepseek-v4-flash (or a JSON spec file)",
                                        name));
  }
  if (spec.ok()) SPARSEKV_RETURN_IF_ERROR(spec->Validate());
  return spec;
}

Result<ModelSpec> ParseModelSpecJson(std::string_view json_text) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Status::InvalidArgument("spec: not valid JSON");
  return FromJson(root);
}

Result<ModelSpec> LoadModelSpecFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(fmt::format("cannot open model spec file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto spec = ParseModelSpecJson(ss.str());
  if (!spec.ok()) return spec.status().WithContext(path);
  return spec;
}

std::string ModelSpecToJson(const ModelSpec& spec, int indent) {
  json root;
  root["name"] = spec.name;
  root["window_tokens"] = spec.window_tokens;
  root["attention_heads"] = spec.attention_heads;
  root["indexer_heads"] = spec.indexer_heads;
  root["indexer_topk"] = spec.indexer_topk;
  json layers = json::array();
  for (const LayerSpec& l : spec.layers) {
    json kinds = json::array();
    for (const KindSpec& k : l.kinds) {
      json jk{{"kind", CacheKindName(k.kind)},
              {"format", StorageFormatName(k.format)},
              {"dims", k.dims},
              {"ratio", k.ratio}};
      if (k.kind == CacheKind::kCompressorState) jk["state_rows"] = k.state_rows;
      kinds.push_back(std::move(jk));
    }
    // Runs of equal layers are written once with "repeat".
    if (!layers.empty() && layers.back()["kinds"] == kinds) {
      layers.back()["repeat"] = layers.back().value("repeat", 1) + 1;
    } else {
      layers.push_back(json{{"kinds", std::move(kinds)}});
    }
  }
  root["layers"] = std::move(layers);
  return root.dump(indent);
}

}  // namespace sparsekv
