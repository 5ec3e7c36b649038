#include "server/resp_keyspace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace sparsekv::server::resp {
namespace {

std::string_view AsCharsOf(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

bool ReadFailed(const Status& st) {
  return !st.ok() && st.code() != StatusCode::kNotFound && !st.data_loss() && st.code() != StatusCode::kInvalidArgument;
}

std::string PutError(const wire::ItemStatus& s) {
  if (s.code == StatusCode::kInvalidArgument) {
    return fmt::format("ERR value too large for sparsekvd's tiers ({}); nothing was stored", s.message);
  }
  if (s.code == StatusCode::kResourceExhausted) return fmt::format("OOM {}", s.message);
  return fmt::format("ERR storing the value failed: {}", s.message);
}

// The header of `key`'s record in `b` (its first bytes), or nullopt when they are not `key`'s.
std::optional<Header> KeyHeader(std::span<const std::byte> b, std::string_view key) {
  const auto h = ReadFixedHeader(b);
  if (!h || !h->deadline_known || h->key_bytes != key.size() || b.size() < h->header_bytes()) return std::nullopt;
  if (!key.empty() && std::memcmp(b.data() + h->fixed_bytes, key.data(), key.size()) != 0) return std::nullopt;
  return h;
}

}  // namespace

std::mutex& Keyspace::Stripe(const wire::WireHash& h) {
  uint64_t lo;
  std::memcpy(&lo, h.data(), 8);
  return stripes_[lo % stripes_.size()];
}

// The header as stored, whether or not past its deadline.
static std::optional<Keyspace::Head> ReadHead(DaemonStore& store, uint32_t ns, std::string_view key, Status& error,
                                              std::string* raw) {
  const wire::WireHash h = KeyHash(key);
  std::optional<Keyspace::Head> out;
  if (IsBridgeKey(key)) {
    store.Get(ns, std::span<const wire::WireHash>(&h, 1),
              [&](size_t, const Status& st, std::span<const std::byte> bytes, const DaemonStore::Keep&) {
                if (st.ok()) {
                  out = Keyspace::Head{bytes.size(), 0};
                } else if (ReadFailed(st)) {
                  error = st;
                }
              });
    return out;
  }
  // An "SKVE" record's header is 8 bytes longer than an "SKVR" one's: read that much first; a
  // record too short for it (a plain one with a value under 8 bytes) is read again for less.
  for (size_t fixed : {kExpiringHeaderBytes, kFixedHeaderBytes}) {
    std::vector<wire::RangeItem> items(1);
    items[0].hash = h;
    items[0].ranges.push_back({0, static_cast<uint32_t>(fixed + key.size())});
    bool short_record = false;
    store.GetRanges(ns, items, [&](size_t, const Status& st, std::span<const std::byte> b) {
      if (st.ok()) {
        if (const auto head = KeyHeader(b, key)) {
          out = Keyspace::Head{head->value_bytes, head->deadline_ms};
          if (raw != nullptr) raw->assign(reinterpret_cast<const char*>(b.data()), head->header_bytes());
        }
      } else if (st.code() == StatusCode::kInvalidArgument) {
        short_record = true;
      } else if (ReadFailed(st)) {
        error = st;
      }
    });
    if (!short_record) break;
  }
  return out;
}

std::optional<Keyspace::Head> Keyspace::HeadOf(uint32_t ns, std::string_view key, Status& error, std::string* raw) {
  auto head = ReadHead(*store_, ns, key, error, raw);
  if (head && Expired(head->deadline_ms, NowMs())) {
    QueueExpired(ns, key, head->deadline_ms);
    return std::nullopt;
  }
  return head;
}

std::optional<Keyspace::Value> Keyspace::Load(uint32_t ns, std::string_view key, Status& error) {
  const wire::WireHash h = KeyHash(key);
  std::optional<Value> out;
  store_->Get(ns, std::span<const wire::WireHash>(&h, 1),
              [&](size_t, const Status& st, std::span<const std::byte> b, const DaemonStore::Keep&) {
                if (!st.ok()) {
                  if (ReadFailed(st)) error = st;
                  return;
                }
                const auto s = Parse(b, key);
                if (!s) return;
                if (Expired(s->deadline_ms, NowMs())) {
                  QueueExpired(ns, key, s->deadline_ms);
                  return;
                }
                out = Value{std::string(AsCharsOf(s->value)), s->deadline_ms};
              });
  return out;
}

void Keyspace::BuildRecord(std::string_view key, std::string_view value, int64_t deadline_ms, std::string& out) {
  const size_t header = HeaderBytes(key, deadline_ms != 0);
  out.resize(header + value.size());
  if (header > 0) WriteHeader(key, value.size(), reinterpret_cast<std::byte*>(out.data()), deadline_ms);
  if (!value.empty()) std::memcpy(out.data() + header, value.data(), value.size());
}

std::string Keyspace::Store(uint32_t ns, std::string_view key, std::string_view value, int64_t deadline_ms) {
  if (deadline_ms != 0 && IsBridgeKey(key)) {
    return "ERR sparsekv: a bridge key (32 hex digits) names a native block and takes no expiry";
  }
  const uint64_t record = HeaderBytes(key, deadline_ms != 0) + value.size();
  if (record > store_->MaxValueBytes()) {
    return fmt::format("ERR value too large: {} bytes with its key, sparsekvd's tiers take at most {}; nothing was "
                       "stored",
                       record, store_->MaxValueBytes());
  }
  std::string bytes;
  BuildRecord(key, value, deadline_ms, bytes);
  wire::PutItem item{KeyHash(key), std::as_bytes(std::span<const char>(bytes.data(), bytes.size()))};
  metrics_->BytesIn(bytes.size());
  const auto st = store_->Put(ns, std::span<const wire::PutItem>(&item, 1));
  if (st[0].code != StatusCode::kOk) return PutError(st[0]);
  NoteDeadline(ns, key, deadline_ms);
  return {};
}

std::string Keyspace::Remove(uint32_t ns, std::string_view key) {
  const wire::WireHash h = KeyHash(key);
  const auto st = store_->Delete(ns, std::span<const wire::WireHash>(&h, 1));
  if (st[0].code != StatusCode::kOk && st[0].code != StatusCode::kNotFound) {
    return fmt::format("ERR deleting a key failed: {}", st[0].message);
  }
  NoteDeadline(ns, key, 0);
  return {};
}

std::vector<std::optional<std::string>> Keyspace::KeyNames(uint32_t ns, const std::vector<wire::WireHash>& hashes,
                                                           std::vector<int64_t>* deadlines) {
  std::vector<std::optional<std::string>> out(hashes.size());
  if (deadlines != nullptr) deadlines->assign(hashes.size(), 0);
  std::vector<wire::RangeItem> items(hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) {
    out[i] = BridgeKeyOf(hashes[i]);
    items[i].hash = hashes[i];
    items[i].ranges.push_back({0, static_cast<uint32_t>(kFixedHeaderBytes)});
  }
  std::vector<size_t> header_bytes(hashes.size(), 0);
  std::vector<size_t> second;
  store_->GetRanges(ns, items, [&](size_t i, const Status& st, std::span<const std::byte> b) {
    if (!st.ok()) return;
    if (auto h = ReadFixedHeader(b)) {
      header_bytes[i] = h->header_bytes();
      second.push_back(i);
    }
  });
  if (second.empty()) return out;
  std::vector<wire::RangeItem> keys;
  for (size_t i : second) {
    wire::RangeItem item;
    item.hash = hashes[i];
    item.ranges.push_back({0, static_cast<uint32_t>(header_bytes[i])});
    keys.push_back(std::move(item));
  }
  const int64_t now = NowMs();
  store_->GetRanges(ns, keys, [&](size_t k, const Status& st, std::span<const std::byte> b) {
    if (!st.ok()) return;
    const auto h = ReadFixedHeader(b);
    if (!h || !h->deadline_known || b.size() != h->header_bytes()) return;
    std::string_view key = AsCharsOf(b.subspan(h->fixed_bytes));
    // A record whose key does not hash to where it lies is a native block that starts like one
    // of ours: shown by its bridge key.
    const size_t i = second[k];
    if (IsBridgeKey(key) || KeyHash(key) != hashes[i]) return;
    if (h->deadline_ms != 0) NoteDeadline(ns, key, h->deadline_ms);
    if (deadlines != nullptr) (*deadlines)[i] = h->deadline_ms;
    if (Expired(h->deadline_ms, now)) {
      out[i].reset();
    } else {
      out[i] = std::string(key);
    }
  });
  return out;
}

void Keyspace::NoteDeadline(uint32_t ns, std::string_view key, int64_t deadline_ms) {
  const Id id{ns, KeyHash(key)};
  std::lock_guard<std::mutex> l(index_mu_);
  auto it = entries_.find(id);
  if (it != entries_.end()) {
    if (it->second.deadline_ms == deadline_ms) return;
    by_deadline_.erase({it->second.deadline_ms, ns, id.second});
    if (deadline_ms == 0) {
      entries_.erase(it);
      return;
    }
    it->second.deadline_ms = deadline_ms;
  } else {
    if (deadline_ms == 0) return;
    entries_.emplace(id, Entry{deadline_ms, std::string(key)});
  }
  by_deadline_.emplace(deadline_ms, ns, id.second);
}

void Keyspace::LearnDeadlines(uint32_t ns, const std::vector<wire::WireHash>& hashes) { KeyNames(ns, hashes); }

std::vector<Keyspace::Due> Keyspace::TakeDue(int64_t now_ms, size_t max) {
  std::vector<Due> out;
  std::lock_guard<std::mutex> l(index_mu_);
  while (!by_deadline_.empty() && out.size() < max) {
    const auto& [deadline, ns, hash] = *by_deadline_.begin();
    if (deadline > now_ms) break;
    auto it = entries_.find({ns, hash});
    if (it != entries_.end()) {
      out.push_back(Due{ns, std::move(it->second.key), deadline});
      entries_.erase(it);
    }
    by_deadline_.erase(by_deadline_.begin());
  }
  return out;
}

uint64_t Keyspace::ExpireDue(const std::vector<Due>& due) {
  uint64_t n = 0;
  for (const Due& d : due) {
    const wire::WireHash h = KeyHash(d.key);
    std::lock_guard<std::mutex> l(Stripe(h));
    Status error;
    const auto head = ReadHead(*store_, d.ns, d.key, error, nullptr);
    if (!head) continue;  // deleted meanwhile (or unreadable: found again by the next read)
    if (!Expired(head->deadline_ms, NowMs())) {
      // Written again with another deadline (or none) since it was noted.
      NoteDeadline(d.ns, d.key, head->deadline_ms);
      continue;
    }
    const auto st = store_->Delete(d.ns, std::span<const wire::WireHash>(&h, 1));
    if (st[0].code == StatusCode::kOk) ++n;
  }
  expired_.fetch_add(n, std::memory_order_relaxed);
  return n;
}

void Keyspace::ForgetNamespace(uint32_t ns) {
  std::lock_guard<std::mutex> l(index_mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first.first == ns) {
      by_deadline_.erase({it->second.deadline_ms, ns, it->first.second});
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

std::pair<uint64_t, int64_t> Keyspace::Expiring(uint32_t ns, int64_t now_ms) {
  std::lock_guard<std::mutex> l(index_mu_);
  uint64_t n = 0;
  int64_t left = 0;
  for (const auto& [id, e] : entries_) {
    if (id.first != ns) continue;
    ++n;
    left += std::max<int64_t>(0, e.deadline_ms - now_ms);
  }
  return {n, n == 0 ? 0 : left / static_cast<int64_t>(n)};
}

}  // namespace sparsekv::server::resp
