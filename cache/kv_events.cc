#include "sparsekv/kv_events.h"

namespace sparsekv {

std::vector<CacheKind> KindSet::Kinds() const {
  std::vector<CacheKind> out;
  for (int k = 0; k < kNumCacheKinds; ++k) {
    if (Has(static_cast<CacheKind>(k))) out.push_back(static_cast<CacheKind>(k));
  }
  return out;
}

std::string KindSet::ToString() const {
  std::string out;
  for (CacheKind k : Kinds()) {
    if (!out.empty()) out += ',';
    out += CacheKindName(k);
  }
  return out;
}

std::string_view KvEventTypeName(KvEventType type) {
  switch (type) {
    case KvEventType::kBlocksStored:
      return "blocks_stored";
    case KvEventType::kBlocksRemoved:
      return "blocks_removed";
    case KvEventType::kAllCleared:
      return "all_cleared";
  }
  return "?";
}

}  // namespace sparsekv
