// Commands on keys, whatever they hold (resp_commands.h): existence, deletion, type, expiry,
// renaming and copying, and walking the caller's namespace.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstring>
#include <mutex>
#include <vector>

#include "server/resp_commands.h"

namespace sparsekv::server::resp {
namespace {

bool ReadError(Command& c, const Status& st) {
  if (st.ok()) return false;
  c.error = fmt::format("ERR reading the key failed: {}", st.message());
  return true;
}

void Exists(Command& c) {
  int64_t n = 0;
  for (size_t i = 1; i < c.args.size(); ++i) {
    Status st;
    n += c.ks.Present(c.ns, c.args[i], st) ? 1 : 0;
    if (ReadError(c, st)) return;
  }
  c.w.Integer(n);
}

// TOUCH key...: how many hold a value (reading a key is what touches it in the tiers' policies).
void Touch(Command& c) { Exists(c); }

// RANDOMKEY: a key of the caller's namespace (nil when it holds none).
void RandomKey(Command& c) {
  std::vector<wire::WireHash> all = c.ks.store().ListHashes(c.ns);
  // A few tries, as a picked key may have expired.
  for (int attempt = 0; attempt < 8 && !all.empty(); ++attempt) {
    const size_t i = static_cast<size_t>(NowMs() * 2654435761ull + attempt * 40503ull) % all.size();
    auto names = c.ks.KeyNames(c.ns, {all[i]});
    if (names[0]) return c.w.Bulk(*names[0]);
    all.erase(all.begin() + static_cast<std::ptrdiff_t>(i));
  }
  c.w.Null();
}

void Del(Command& c) {
  int64_t n = 0;
  for (size_t i = 1; i < c.args.size(); ++i) {
    std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(c.args[i])));
    Status st;
    const bool present = c.ks.Present(c.ns, c.args[i], st);
    if (ReadError(c, st)) return;
    if (!present) continue;
    if (std::string e = c.ks.Remove(c.ns, c.args[i]); !e.empty()) return void(c.error = std::move(e));
    ++n;
  }
  c.w.Integer(n);
}

void Type(Command& c) {
  Status st;
  const bool present = c.ks.Present(c.ns, c.args[1], st);
  if (ReadError(c, st)) return;
  c.w.Simple(present ? "string" : "none");
}

// TTL, PTTL, EXPIRETIME, PEXPIRETIME (Redis's ttlGenericCommand): -2 for no key, -1 for no
// deadline.
void Ttl(Command& c, bool ms, bool absolute) {
  Status st;
  const auto head = c.ks.HeadOf(c.ns, c.args[1], st);
  if (ReadError(c, st)) return;
  if (!head) return c.w.Integer(-2);
  if (head->deadline_ms == 0) return c.w.Integer(-1);
  int64_t t = absolute ? head->deadline_ms : head->deadline_ms - NowMs();
  if (t < 0) t = 0;
  c.w.Integer(ms ? t : (t + 500) / 1000);
}

// EXPIRE key seconds [NX|XX|GT|LT], PEXPIRE, EXPIREAT, PEXPIREAT (Redis's expireGenericCommand).
// The record is written again with its new deadline; a deadline already past deletes the key.
void Expire(Command& c, bool seconds, bool absolute) {
  bool nx = false, xx = false, gt = false, lt = false;
  for (size_t j = 3; j < c.args.size(); ++j) {
    const std::string_view opt = c.args[j];
    if (EqualsNoCase(opt, "nx")) {
      nx = true;
    } else if (EqualsNoCase(opt, "xx")) {
      xx = true;
    } else if (EqualsNoCase(opt, "gt")) {
      gt = true;
    } else if (EqualsNoCase(opt, "lt")) {
      lt = true;
    } else {
      return void(c.error = fmt::format("ERR Unsupported option {}", Printable(opt, 128)));
    }
  }
  if ((nx && xx) || (nx && gt) || (nx && lt)) {
    return void(c.error = "ERR NX and XX, GT or LT options at the same time are not compatible");
  }
  if (gt && lt) return void(c.error = "ERR GT and LT options at the same time are not compatible");
  int64_t when = 0;
  if (!ParseI64(c.args[2], when)) return void(c.error = kNotInteger);
  const std::string bad = fmt::format("ERR invalid expire time in '{}' command", kSpecs[c.cmd].name);
  if (seconds) {
    if (when > LLONG_MAX / 1000 || when < LLONG_MIN / 1000) return void(c.error = bad);
    when *= 1000;
  }
  const int64_t base = absolute ? 0 : NowMs();
  if (when > LLONG_MAX - base) return void(c.error = bad);
  when += base;

  const std::string_view key = c.args[1];
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  const auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  if (!v) return c.w.Integer(0);
  const int64_t current = v->deadline_ms == 0 ? -1 : v->deadline_ms;
  if ((nx && current != -1) || (xx && current == -1) || (gt && (when <= current || current == -1)) ||
      (lt && current != -1 && when >= current)) {
    return c.w.Integer(0);
  }
  if (when <= NowMs()) {
    if (std::string e = c.ks.Remove(c.ns, key); !e.empty()) return void(c.error = std::move(e));
    return c.w.Integer(1);
  }
  if (std::string e = c.ks.Store(c.ns, key, v->bytes, when); !e.empty()) return void(c.error = std::move(e));
  c.w.Integer(1);
}

void Persist(Command& c) {
  const std::string_view key = c.args[1];
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  const auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  if (!v || v->deadline_ms == 0) return c.w.Integer(0);
  if (std::string e = c.ks.Store(c.ns, key, v->bytes, 0); !e.empty()) return void(c.error = std::move(e));
  c.w.Integer(1);
}

// Both keys' stripes, in address order (one lock when they share one).
struct TwoStripes {
  TwoStripes(Keyspace& ks, std::string_view a, std::string_view b) {
    std::mutex* x = &ks.Stripe(KeyHash(a));
    std::mutex* y = &ks.Stripe(KeyHash(b));
    if (y < x) std::swap(x, y);
    first = std::unique_lock<std::mutex>(*x);
    if (y != x) second = std::unique_lock<std::mutex>(*y);
  }
  std::unique_lock<std::mutex> first, second;
};

// RENAME key newkey, RENAMENX key newkey: the value moves with its deadline.
void Rename(Command& c, bool nx) {
  const std::string_view from = c.args[1], to = c.args[2];
  TwoStripes locks(c.ks, from, to);
  Status st;
  const auto v = c.ks.Load(c.ns, from, st);
  if (ReadError(c, st)) return;
  if (!v) return void(c.error = "ERR no such key");
  if (from == to) {
    if (nx) return c.w.Integer(0);
    return c.w.Simple("OK");
  }
  if (nx) {
    const bool taken = c.ks.Present(c.ns, to, st);
    if (ReadError(c, st)) return;
    if (taken) return c.w.Integer(0);
  }
  if (std::string e = c.ks.Store(c.ns, to, v->bytes, v->deadline_ms); !e.empty()) return void(c.error = std::move(e));
  if (std::string e = c.ks.Remove(c.ns, from); !e.empty()) return void(c.error = std::move(e));
  if (nx) return c.w.Integer(1);
  c.w.Simple("OK");
}

// COPY source destination [DB destination-db] [REPLACE]: one database here (0).
void Copy(Command& c) {
  bool replace = false;
  for (size_t j = 3; j < c.args.size(); ++j) {
    const bool more = j + 1 < c.args.size();
    if (EqualsNoCase(c.args[j], "replace")) {
      replace = true;
    } else if (EqualsNoCase(c.args[j], "db") && more) {
      int64_t db = 0;
      if (!ParseI64(c.args[j + 1], db) || db < INT_MIN || db > INT_MAX) return void(c.error = kNotInteger);
      if (db != 0) return void(c.error = "ERR DB index is out of range");
      ++j;
    } else {
      return void(c.error = kSyntaxError);
    }
  }
  const std::string_view from = c.args[1], to = c.args[2];
  if (from == to) return void(c.error = "ERR source and destination objects are the same");
  TwoStripes locks(c.ks, from, to);
  Status st;
  const auto v = c.ks.Load(c.ns, from, st);
  if (ReadError(c, st)) return;
  if (!v) return c.w.Integer(0);
  const bool taken = c.ks.Present(c.ns, to, st);
  if (ReadError(c, st)) return;
  if (taken && !replace) return c.w.Integer(0);
  if (std::string e = c.ks.Store(c.ns, to, v->bytes, v->deadline_ms); !e.empty()) return void(c.error = std::move(e));
  c.w.Integer(1);
}

uint64_t HighOf(const wire::WireHash& h) {
  uint64_t hi;
  std::memcpy(&hi, h.data() + 8, 8);
  return hi;
}

// SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]. The cursor is the high 64 bits of the
// hash to go on from: hashes are listed in order, so a key present from the first call to the
// last is returned, whatever else changes.
void Scan(Command& c) {
  uint64_t cursor = 0;
  {
    const std::string_view a = c.args[1];
    auto [p, ec] = std::from_chars(a.data(), a.data() + a.size(), cursor);
    if (ec != std::errc() || p != a.data() + a.size()) return void(c.error = "ERR invalid cursor");
  }
  std::string_view match;
  bool have_match = false;
  int64_t count = 10;
  bool none = false;  // TYPE other than string: nothing matches
  for (size_t i = 2; i < c.args.size(); i += 2) {
    if (i + 1 >= c.args.size()) return void(c.error = kSyntaxError);
    if (EqualsNoCase(c.args[i], "match")) {
      match = c.args[i + 1];
      have_match = !(match.size() == 1 && match[0] == '*');
    } else if (EqualsNoCase(c.args[i], "count")) {
      if (!ParseI64(c.args[i + 1], count)) return void(c.error = kNotInteger);
      if (count < 1) return void(c.error = kSyntaxError);
    } else if (EqualsNoCase(c.args[i], "type")) {
      none = !EqualsNoCase(c.args[i + 1], "string");
    } else {
      return void(c.error = kSyntaxError);
    }
  }
  const std::vector<wire::WireHash> all = c.ks.store().ListHashes(c.ns);
  auto it = std::lower_bound(all.begin(), all.end(), cursor,
                             [&](const wire::WireHash& h, uint64_t x) { return HighOf(h) < x; });
  std::vector<wire::WireHash> batch;
  const auto want = static_cast<size_t>(std::min<int64_t>(count, 1 << 20));
  while (it != all.end() && (batch.size() < want || HighOf(*it) == HighOf(batch.back()))) batch.push_back(*it++);
  uint64_t next = 0;
  if (it != all.end()) next = HighOf(batch.back()) + 1;  // hi of the last < hi of *it: no overflow
  std::vector<std::string> shown;
  if (!none) {
    for (auto& n : c.ks.KeyNames(c.ns, batch)) {
      if (n && (!have_match || GlobMatch(match, *n))) shown.push_back(std::move(*n));
    }
  }
  c.w.Array(2);
  c.w.Bulk(std::to_string(next));
  c.w.Array(shown.size());
  for (const std::string& n : shown) c.w.Bulk(n);
}

// KEYS pattern: every key of the caller's namespace that matches (Redis's glob), in no set order.
// Like Redis's, one reply with the whole keyspace: SCAN is the way through a large one.
void Keys(Command& c) {
  const std::string_view pattern = c.args[1];
  const bool every = pattern.size() == 1 && pattern[0] == '*';
  const std::vector<wire::WireHash> all = c.ks.store().ListHashes(c.ns);
  std::vector<std::string> matched;
  constexpr size_t kPart = 1024;  // the records' headers are read a part at a time
  for (size_t at = 0; at < all.size(); at += kPart) {
    const std::vector<wire::WireHash> part(all.begin() + static_cast<std::ptrdiff_t>(at),
                                           all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), at + kPart)));
    for (auto& n : c.ks.KeyNames(c.ns, part)) {
      if (n && (every || GlobMatch(pattern, *n))) matched.push_back(std::move(*n));
    }
  }
  c.w.Array(matched.size());
  for (const std::string& n : matched) c.w.Bulk(n);
}

// FLUSHDB and FLUSHALL [SYNC|ASYNC] empty the caller's namespace: a namespace is a client's whole
// keyspace here, and no client empties another's.
void Flush(Command& c) {
  if (c.args.size() > 2 || (c.args.size() == 2 && !EqualsNoCase(c.args[1], "sync") && !EqualsNoCase(c.args[1], "async"))) {
    return void(c.error = kSyntaxError);
  }
  const std::vector<wire::WireHash> all = c.ks.store().ListHashes(c.ns);
  for (size_t at = 0; at < all.size(); at += 4096) {
    const size_t n = std::min<size_t>(4096, all.size() - at);
    const auto st = c.ks.store().Delete(c.ns, std::span<const wire::WireHash>(all.data() + at, n));
    for (const auto& s : st) {
      if (s.code != StatusCode::kOk && s.code != StatusCode::kNotFound) {
        return void(c.error = fmt::format("ERR flushing failed: {}", s.message));
      }
    }
  }
  c.ks.ForgetNamespace(c.ns);
  c.w.Simple("OK");
}

}  // namespace

bool ServeGenericCommand(Command& c) {
  switch (c.cmd) {
    case kExists:
      Exists(c);
      return true;
    case kDel:
    case kUnlink:
      Del(c);
      return true;
    case kType:
      Type(c);
      return true;
    case kTouch:
      Touch(c);
      return true;
    case kRandomkey:
      RandomKey(c);
      return true;
    case kTtl:
      Ttl(c, false, false);
      return true;
    case kPttl:
      Ttl(c, true, false);
      return true;
    case kExpiretime:
      Ttl(c, false, true);
      return true;
    case kPexpiretime:
      Ttl(c, true, true);
      return true;
    case kExpire:
      Expire(c, true, false);
      return true;
    case kPexpire:
      Expire(c, false, false);
      return true;
    case kExpireat:
      Expire(c, true, true);
      return true;
    case kPexpireat:
      Expire(c, false, true);
      return true;
    case kPersist:
      Persist(c);
      return true;
    case kRename:
      Rename(c, false);
      return true;
    case kRenamenx:
      Rename(c, true);
      return true;
    case kCopy:
      Copy(c);
      return true;
    case kDbsize:
      c.w.Integer(static_cast<int64_t>(c.ks.store().ListHashes(c.ns).size()));
      return true;
    case kScan:
      Scan(c);
      return true;
    case kKeys:
      Keys(c);
      return true;
    case kFlushdb:
    case kFlushall:
      Flush(c);
      return true;
    default:
      return false;
  }
}

}  // namespace sparsekv::server::resp
