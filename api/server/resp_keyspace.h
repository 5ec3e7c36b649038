// Keyspace: RESP's keys over a DaemonStore (their records are resp_keys.h's), with expiry.
//
// Expiry as Redis has it (expire.c), kept in the record so that it holds across a restart:
// - lazy: every read takes a record at or past its deadline for no value (a key is never
//   returned after its deadline), and queues it to be deleted;
// - active: every kExpiryPeriod the front end hands ExpireDue the keys whose deadline has come,
//   from an index of deadlines (key, namespace, deadline) kept in memory. Keys given a deadline
//   are noted in it when written; after a restart LearnDeadlines fills it from the records' own
//   headers, a part of the keyspace at a time.
// A deletion by expiry reads the record's header again under its key's stripe and deletes only a
// record still past its deadline: a key written again meanwhile stays.
//
// Writers of one key are serialized by its stripe (Stripe); a command that reads a key, decides
// and writes holds its stripe throughout, as SET NX, RENAME and APPEND do.
//
// Thread safety: every method is thread-safe. Methods that read or write records block on tier
// I/O: call them from worker threads.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "protocol/wire.h"
#include "server/daemon_store.h"
#include "server/metrics.h"
#include "server/resp_keys.h"
#include "sparsekv/status.h"

namespace sparsekv::server::resp {

class Keyspace {
 public:
  Keyspace(DaemonStore* store, Metrics* metrics) : store_(store), metrics_(metrics) {}

  DaemonStore& store() { return *store_; }
  Metrics& metrics() { return *metrics_; }
  std::mutex& Stripe(const wire::WireHash& h);

  // What `key` holds, read from its header alone: the value's length and deadline. Nullopt when
  // it holds no value of its own, or its deadline has passed (the key is then queued to be
  // deleted). `raw`: the header's bytes (fixed part and key), when given. An error only for a
  // failed read (not for absent, damaged or another key's record).
  struct Head {
    uint64_t value_bytes = 0;
    int64_t deadline_ms = 0;  // 0: none
  };
  std::optional<Head> HeadOf(uint32_t ns, std::string_view key, Status& error, std::string* raw = nullptr);
  bool Present(uint32_t ns, std::string_view key, Status& error) { return HeadOf(ns, key, error).has_value(); }

  // `key`'s whole value, copied, and its deadline; nullopt as for HeadOf.
  struct Value {
    std::string bytes;
    int64_t deadline_ms = 0;
  };
  std::optional<Value> Load(uint32_t ns, std::string_view key, Status& error);

  // Stores `key` = `value` with `deadline_ms` (0: none); noted in the index when it has one.
  // The reply's error text (Redis's or sparsekv's words), "" when stored.
  std::string Store(uint32_t ns, std::string_view key, std::string_view value, int64_t deadline_ms);
  // Deletes `key`'s record; the error text, "" when deleted or absent.
  std::string Remove(uint32_t ns, std::string_view key);
  // The record as stored (`key`'s own header, then its value) for `value` and `deadline_ms`.
  static void BuildRecord(std::string_view key, std::string_view value, int64_t deadline_ms, std::string& out);

  // The keys filed under `hashes` (records' keys, or the bridge key naming a native block); a key
  // past its deadline is nullopt (and queued to be deleted). Reads the records' headers only.
  // `deadlines`, when given, gets each record's deadline (0: none).
  std::vector<std::optional<std::string>> KeyNames(uint32_t ns, const std::vector<wire::WireHash>& hashes,
                                                   std::vector<int64_t>* deadlines = nullptr);

  // ---- the index of deadlines ----

  // `key` of `ns` has `deadline_ms` (0: none: forgotten).
  void NoteDeadline(uint32_t ns, std::string_view key, int64_t deadline_ms);
  // Notes the deadlines of the records filed under `hashes` (after a restart).
  void LearnDeadlines(uint32_t ns, const std::vector<wire::WireHash>& hashes);
  struct Due {
    uint32_t ns = 0;
    std::string key;
    int64_t deadline_ms = 0;
  };
  // Up to `max` keys whose deadline is at or before `now_ms`, taken out of the index.
  std::vector<Due> TakeDue(int64_t now_ms, size_t max);
  // Deletes those still past their deadline; returns how many were deleted.
  uint64_t ExpireDue(const std::vector<Due>& due);
  // FLUSHDB: the index forgets `ns`'s keys.
  void ForgetNamespace(uint32_t ns);
  // Keys of `ns` with a deadline in the index, and the average time they have left (ms).
  std::pair<uint64_t, int64_t> Expiring(uint32_t ns, int64_t now_ms);
  uint64_t expired_keys() const { return expired_.load(std::memory_order_relaxed); }

  // What a connection may lazily find past its deadline (GET on the network thread).
  void QueueExpired(uint32_t ns, std::string_view key, int64_t deadline_ms) { NoteDeadline(ns, key, deadline_ms); }

 private:
  DaemonStore* store_;
  Metrics* metrics_;
  std::array<std::mutex, 64> stripes_;

  std::mutex index_mu_;
  using Id = std::pair<uint32_t, wire::WireHash>;
  struct Entry {
    int64_t deadline_ms;
    std::string key;
  };
  std::map<Id, Entry> entries_;                                // guarded by index_mu_
  std::set<std::tuple<int64_t, uint32_t, wire::WireHash>> by_deadline_;  // guarded by index_mu_
  std::atomic<uint64_t> expired_{0};
};

}  // namespace sparsekv::server::resp
