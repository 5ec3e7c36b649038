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

KvEvent KvEventRun::Event(size_t i) const {
  const KvEventRecord& r = events[i];
  KvEvent e;
  e.type = r.type;
  e.sequence_number = r.sequence_number;
  e.kinds = r.kinds;
  const auto h = HashesOf(r);
  e.block_hashes.assign(h.begin(), h.end());
  e.parent_hash = r.parent_hash;
  e.block_tokens = r.block_tokens;
  const auto t = TokensOf(r);
  e.token_ids.assign(t.begin(), t.end());
  return e;
}

}  // namespace sparsekv
