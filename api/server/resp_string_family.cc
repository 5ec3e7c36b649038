// Commands on one string value (resp_commands.h). Each that reads a key, decides and writes holds
// the key's stripe throughout, so that it is atomic with respect to the other RESP writers.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cctype>
#include <cstring>
#include <mutex>
#include <vector>

#include "server/resp_commands.h"

namespace sparsekv::server::resp {
namespace {

std::string ExpireTimeError(Cmd cmd) { return fmt::format("ERR invalid expire time in '{}' command", kSpecs[cmd].name); }

// Redis's checkStringLength.
bool StringFits(Command& c, uint64_t size, uint64_t append) {
  if (size + append > c.max_bulk_bytes || size + append < size) {
    c.error = "ERR string exceeds maximum allowed size (proto-max-bulk-len)";
    return false;
  }
  return true;
}

// SET's and GETEX's options, as Redis's parseExtendedStringArgumentsOrReply reads them.
struct StringOptions {
  bool nx = false, xx = false, get = false, keepttl = false, persist = false;
  bool ex = false, px = false, exat = false, pxat = false;
  std::string_view expire;
  bool has_expire() const { return ex || px || exat || pxat; }
};

bool ParseStringOptions(Command& c, bool set, StringOptions& o) {
  const auto& a = c.args;
  for (size_t j = set ? 3 : 2; j < a.size(); ++j) {
    const std::string_view opt = a[j];
    const bool next = j + 1 < a.size();
    const bool any_expire = o.has_expire();
    if (set && EqualsNoCase(opt, "nx") && !o.xx) {
      o.nx = true;
    } else if (set && EqualsNoCase(opt, "xx") && !o.nx) {
      o.xx = true;
    } else if (set && EqualsNoCase(opt, "get")) {
      o.get = true;
    } else if (set && EqualsNoCase(opt, "keepttl") && !o.persist && !any_expire) {
      o.keepttl = true;
    } else if (!set && EqualsNoCase(opt, "persist") && !any_expire && !o.keepttl) {
      o.persist = true;
    } else if (next && !o.keepttl && !o.persist && !any_expire &&
               (EqualsNoCase(opt, "ex") || EqualsNoCase(opt, "px") || EqualsNoCase(opt, "exat") ||
                EqualsNoCase(opt, "pxat"))) {
      // (Redis also takes a repeat of the same one, the last value winning.)
      o.ex = EqualsNoCase(opt, "ex");
      o.px = EqualsNoCase(opt, "px");
      o.exat = EqualsNoCase(opt, "exat");
      o.pxat = EqualsNoCase(opt, "pxat");
      o.expire = a[++j];
    } else if (next && any_expire &&
               ((o.ex && EqualsNoCase(opt, "ex")) || (o.px && EqualsNoCase(opt, "px")) ||
                (o.exat && EqualsNoCase(opt, "exat")) || (o.pxat && EqualsNoCase(opt, "pxat")))) {
      o.expire = a[++j];
    } else {
      c.error = kSyntaxError;
      return false;
    }
  }
  return true;
}

bool OptionDeadline(Command& c, const StringOptions& o, int64_t& deadline) {
  return ParseExpiry(c, o.expire, o.ex || o.exat, o.ex || o.px, deadline);
}

void BulkOrNull(RespWriter& w, const std::optional<Keyspace::Value>& v) {
  if (v) {
    w.Bulk(v->bytes);
  } else {
    w.Null();
  }
}

// Reports a failed read as the reply's error; true when there was one.
bool ReadError(Command& c, const Status& st) {
  if (st.ok()) return false;
  c.error = fmt::format("ERR reading the key failed: {}", st.message());
  return true;
}

// SET key value [NX|XX] [GET] [EX|PX|EXAT|PXAT time|KEEPTTL], and the commands Redis builds on it.
void SetGeneric(Command& c, std::string_view key, std::string_view value, const StringOptions& o, bool integer_reply) {
  int64_t deadline = 0;
  if (o.has_expire() && !OptionDeadline(c, o, deadline)) return;
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  std::optional<Keyspace::Value> old;
  std::optional<Keyspace::Head> head;
  if (o.get) {
    old = c.ks.Load(c.ns, key, st);
    if (old) head = Keyspace::Head{old->bytes.size(), old->deadline_ms};
  } else if (o.nx || o.xx || o.keepttl) {
    head = c.ks.HeadOf(c.ns, key, st);
  }
  if (ReadError(c, st)) return;
  const bool found = head.has_value();
  if ((o.nx && found) || (o.xx && !found)) {
    if (o.get) {
      BulkOrNull(c.w, old);
    } else if (integer_reply) {
      c.w.Integer(0);
    } else {
      c.w.Null();
    }
    return;
  }
  if (o.keepttl && found) deadline = head->deadline_ms;
  if (std::string e = c.ks.Store(c.ns, key, value, deadline); !e.empty()) {
    c.error = std::move(e);
    return;
  }
  if (o.get) {
    BulkOrNull(c.w, old);
  } else if (integer_reply) {
    c.w.Integer(1);
  } else {
    c.w.Simple("OK");
  }
}

void Set(Command& c) {
  StringOptions o;
  if (!ParseStringOptions(c, /*set=*/true, o)) return;
  SetGeneric(c, c.args[1], c.args[2], o, false);
}

// SETEX key seconds value, PSETEX key milliseconds value.
void SetEx(Command& c, bool seconds) {
  StringOptions o;
  o.ex = seconds;
  o.px = !seconds;
  o.expire = c.args[2];
  SetGeneric(c, c.args[1], c.args[3], o, false);
}

// MSET and MSETNX: every key's stripe held (in address order, each once) while they are written.
void Mset(Command& c, bool nx) {
  const auto& a = c.args;
  std::vector<std::mutex*> stripes;
  for (size_t i = 1; i < a.size(); i += 2) stripes.push_back(&c.ks.Stripe(KeyHash(a[i])));
  std::sort(stripes.begin(), stripes.end());
  stripes.erase(std::unique(stripes.begin(), stripes.end()), stripes.end());
  std::vector<std::unique_lock<std::mutex>> held;
  for (auto* m : stripes) held.emplace_back(*m);
  if (nx) {
    for (size_t i = 1; i < a.size(); i += 2) {
      Status st;
      const bool present = c.ks.Present(c.ns, a[i], st);
      if (ReadError(c, st)) return;
      if (present) {
        c.w.Integer(0);
        return;
      }
    }
  }
  // One Put for all: the tiers take them as one batch.
  const size_t n = (a.size() - 1) / 2;
  std::vector<std::string> records(n);
  std::vector<wire::PutItem> items(n);
  uint64_t bytes = 0;
  for (size_t k = 0; k < n; ++k) {
    Keyspace::BuildRecord(a[1 + 2 * k], a[2 + 2 * k], 0, records[k]);
    items[k].hash = KeyHash(a[1 + 2 * k]);
    items[k].bundle = std::as_bytes(std::span<const char>(records[k].data(), records[k].size()));
    bytes += records[k].size();
  }
  c.ks.metrics().BytesIn(bytes);
  const auto st = c.ks.store().Put(c.ns, items);
  for (size_t k = 0; k < n; ++k) {
    if (st[k].code != StatusCode::kOk) {
      c.error = st[k].code == StatusCode::kResourceExhausted
                    ? fmt::format("OOM {}", st[k].message)
                    : fmt::format("ERR storing the value failed: {}", st[k].message);
      return;
    }
    c.ks.NoteDeadline(c.ns, a[1 + 2 * k], 0);
  }
  if (nx) {
    c.w.Integer(1);
  } else {
    c.w.Simple("OK");
  }
}

// GETEX key [EX|PX|EXAT|PXAT time|PERSIST]
void GetEx(Command& c) {
  StringOptions o;
  if (!ParseStringOptions(c, /*set=*/false, o)) return;
  const std::string_view key = c.args[1];
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  const auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  if (!v) {
    c.w.Null();
    return;
  }
  int64_t deadline = 0;
  if (o.has_expire() && !OptionDeadline(c, o, deadline)) return;
  if ((o.exat || o.pxat) && Expired(deadline, NowMs())) {
    if (std::string e = c.ks.Remove(c.ns, key); !e.empty()) return void(c.error = std::move(e));
  } else if (o.has_expire() || (o.persist && v->deadline_ms != 0)) {
    if (std::string e = c.ks.Store(c.ns, key, v->bytes, o.persist ? 0 : deadline); !e.empty()) {
      return void(c.error = std::move(e));
    }
  }
  c.w.Bulk(v->bytes);
}

// GETDEL key, GETSET key value.
void GetDelOrSet(Command& c, bool del) {
  const std::string_view key = c.args[1];
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  const auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  if (del) {
    if (v) {
      if (std::string e = c.ks.Remove(c.ns, key); !e.empty()) return void(c.error = std::move(e));
    }
  } else if (std::string e = c.ks.Store(c.ns, key, c.args[2], 0); !e.empty()) {
    return void(c.error = std::move(e));
  }
  BulkOrNull(c.w, v);
}

// APPEND key value: the key's deadline is kept.
void Append(Command& c) {
  const std::string_view key = c.args[1], more = c.args[2];
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  if (!v) v.emplace();
  if (!StringFits(c, v->bytes.size(), more.size())) return;
  v->bytes.append(more);
  if (std::string e = c.ks.Store(c.ns, key, v->bytes, v->deadline_ms); !e.empty()) return void(c.error = std::move(e));
  c.w.Integer(static_cast<int64_t>(v->bytes.size()));
}

// SETRANGE key offset value: zero bytes fill any gap; the key's deadline is kept.
void SetRange(Command& c) {
  const std::string_view key = c.args[1], part = c.args[3];
  int64_t offset = 0;
  if (!ParseI64(c.args[2], offset)) return void(c.error = kNotInteger);
  if (offset < 0) return void(c.error = "ERR offset is out of range");
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  if (!v) {
    if (part.empty()) return c.w.Integer(0);
    v.emplace();
  } else if (part.empty()) {
    return c.w.Integer(static_cast<int64_t>(v->bytes.size()));
  }
  if (!StringFits(c, static_cast<uint64_t>(offset), part.size())) return;
  const size_t end = static_cast<size_t>(offset) + part.size();
  if (v->bytes.size() < end) v->bytes.resize(end, '\0');
  std::memcpy(v->bytes.data() + offset, part.data(), part.size());
  if (std::string e = c.ks.Store(c.ns, key, v->bytes, v->deadline_ms); !e.empty()) return void(c.error = std::move(e));
  c.w.Integer(static_cast<int64_t>(v->bytes.size()));
}

// INCR, DECR, INCRBY, DECRBY (Redis's incrDecrCommand): the value read as a 64-bit integer,
// written back with its deadline kept.
void IncrBy(Command& c, int64_t by) {
  const std::string_view key = c.args[1];
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  int64_t value = 0;
  if (v && !ParseI64(v->bytes, value)) return void(c.error = kNotInteger);
  if ((by < 0 && value < 0 && by < LLONG_MIN - value) || (by > 0 && value > 0 && by > LLONG_MAX - value)) {
    return void(c.error = "ERR increment or decrement would overflow");
  }
  value += by;
  const std::string text = std::to_string(value);
  if (std::string e = c.ks.Store(c.ns, key, text, v ? v->deadline_ms : 0); !e.empty()) return void(c.error = std::move(e));
  c.w.Integer(value);
}

// Redis's string2ld: the whole text a long double, no leading space, no NaN.
bool ParseLongDouble(std::string_view s, long double& out) {
  if (s.empty() || s.size() >= 5 * 1024 || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  const std::string text(s);
  char* end = nullptr;
  errno = 0;
  out = std::strtold(text.c_str(), &end);
  if (*end != '\0' || std::isnan(out)) return false;
  if (errno == ERANGE && (out == HUGE_VALL || out == -HUGE_VALL || std::fpclassify(out) == FP_ZERO)) return false;
  return true;
}

// INCRBYFLOAT: the sum written as Redis's ld2string(LD_STR_HUMAN) does: 17 decimals, trailing
// zeros (and a trailing point) dropped, "-0" as "0".
void IncrByFloat(Command& c) {
  const std::string_view key = c.args[1];
  std::lock_guard<std::mutex> l(c.ks.Stripe(KeyHash(key)));
  Status st;
  auto v = c.ks.Load(c.ns, key, st);
  if (ReadError(c, st)) return;
  long double value = 0, by = 0;
  if ((v && !ParseLongDouble(v->bytes, value)) || !ParseLongDouble(c.args[2], by)) {
    return void(c.error = "ERR value is not a valid float");
  }
  value += by;
  if (std::isnan(value) || std::isinf(value)) return void(c.error = "ERR increment would produce NaN or Infinity");
  char buf[5 * 1024];
  int n = std::snprintf(buf, sizeof buf, "%.17Lf", value);
  if (n < 0 || n + 1 > static_cast<int>(sizeof buf)) return void(c.error = "ERR value is not a valid float");
  if (std::memchr(buf, '.', static_cast<size_t>(n)) != nullptr) {
    while (buf[n - 1] == '0') --n;
    if (buf[n - 1] == '.') --n;
  }
  std::string text(buf, static_cast<size_t>(n));
  if (text == "-0") text = "0";
  if (std::string e = c.ks.Store(c.ns, key, text, v ? v->deadline_ms : 0); !e.empty()) return void(c.error = std::move(e));
  c.w.Bulk(text);
}

void Strlen(Command& c) {
  Status st;
  const auto head = c.ks.HeadOf(c.ns, c.args[1], st);
  if (ReadError(c, st)) return;
  c.w.Integer(head ? static_cast<int64_t>(head->value_bytes) : 0);
}

// GETRANGE key start end: reads the header, then header and range in one read of one version
// (a SET in between that changed the length is read again).
void GetRange(Command& c) {
  int64_t start = 0, end = 0;
  if (!ParseI64(c.args[2], start) || !ParseI64(c.args[3], end)) return void(c.error = kNotInteger);
  const std::string_view key = c.args[1];
  const wire::WireHash h = KeyHash(key);
  auto clamp = [&](uint64_t len, uint64_t& from, uint64_t& n) {
    const auto l = static_cast<int64_t>(len);
    int64_t s = start < 0 ? l + start : start;
    int64_t e = end < 0 ? l + end : end;
    if (s < 0) s = 0;
    if (e < 0) e = 0;
    if (e >= l) e = l - 1;
    if (l == 0 || s > e || (start < 0 && end < 0 && start > end)) {
      n = 0;
      return;
    }
    from = static_cast<uint64_t>(s);
    n = static_cast<uint64_t>(e - s + 1);
  };
  if (IsBridgeKey(key)) {
    Status st;
    const auto v = c.ks.Load(c.ns, key, st);
    if (ReadError(c, st)) return;
    uint64_t from = 0, n = 0;
    if (v) clamp(v->bytes.size(), from, n);
    c.w.Bulk(v ? std::string_view(v->bytes).substr(from, n) : std::string_view());
    return;
  }
  for (int attempt = 0; attempt < 4; ++attempt) {
    Status st;
    std::string header;
    const auto head = c.ks.HeadOf(c.ns, key, st, &header);
    if (ReadError(c, st)) return;
    if (!head) return c.w.Bulk("");
    uint64_t from = 0, n = 0;
    clamp(head->value_bytes, from, n);
    if (n == 0) return c.w.Bulk("");
    if (n > c.max_bulk_bytes) {
      c.error = "ERR the range asked for is larger than the largest reply (max_frame_bytes)";
      return;
    }
    std::vector<wire::RangeItem> items(1);
    items[0].hash = h;
    items[0].ranges.push_back({0, static_cast<uint32_t>(header.size())});
    // Ranges are at most 4 GiB - 1 each: a longer one is split.
    for (uint64_t at = 0; at < n;) {
      const uint64_t piece = std::min<uint64_t>(n - at, 1u << 30);
      items[0].ranges.push_back({header.size() + from + at, static_cast<uint32_t>(piece)});
      at += piece;
    }
    bool same = false;
    c.ks.store().GetRanges(c.ns, items, [&](size_t, const Status& s, std::span<const std::byte> b) {
      if (!s.ok()) {
        if (s.code() != StatusCode::kNotFound && !s.data_loss() && s.code() != StatusCode::kInvalidArgument) {
          c.error = fmt::format("ERR reading the key failed: {}", s.message());
        }
        return;
      }
      if (b.size() == header.size() + n && std::memcmp(b.data(), header.data(), header.size()) == 0) {
        same = true;
        c.w.Bulk(AsChars(b.subspan(header.size())));
      }
    });
    if (!c.error.empty() || same) return;
    // Deleted or replaced meanwhile: look again.
  }
  c.w.Bulk("");
}

}  // namespace

bool ParseExpiry(Command& c, std::string_view arg, bool seconds, bool relative, int64_t& deadline_ms) {
  int64_t v = 0;
  if (!ParseI64(arg, v)) {
    c.error = kNotInteger;
    return false;
  }
  const std::string bad = ExpireTimeError(c.cmd);
  if (v <= 0 || (seconds && v > LLONG_MAX / 1000)) {
    c.error = bad;
    return false;
  }
  if (seconds) v *= 1000;
  if (relative) {
    const int64_t now = NowMs();
    if (v > LLONG_MAX - now) {
      c.error = bad;
      return false;
    }
    v += now;
  }
  deadline_ms = v;
  return true;
}

bool ServeStringCommand(Command& c) {
  switch (c.cmd) {
    case kSet:
      Set(c);
      return true;
    case kSetnx: {
      StringOptions o;
      o.nx = true;
      SetGeneric(c, c.args[1], c.args[2], o, /*integer_reply=*/true);
      return true;
    }
    case kSetex:
      SetEx(c, true);
      return true;
    case kPsetex:
      SetEx(c, false);
      return true;
    case kMset:
      Mset(c, false);
      return true;
    case kMsetnx:
      Mset(c, true);
      return true;
    case kGetex:
      GetEx(c);
      return true;
    case kGetdel:
      GetDelOrSet(c, true);
      return true;
    case kGetset:
      GetDelOrSet(c, false);
      return true;
    case kAppend:
      Append(c);
      return true;
    case kSetrange:
      SetRange(c);
      return true;
    case kStrlen:
      Strlen(c);
      return true;
    case kIncr:
    case kDecr:
      IncrBy(c, c.cmd == kIncr ? 1 : -1);
      return true;
    case kIncrby:
    case kDecrby: {
      int64_t by = 0;
      if (!ParseI64(c.args[2], by)) {
        c.error = kNotInteger;
      } else if (c.cmd == kDecrby && by == LLONG_MIN) {
        c.error = "ERR decrement would overflow";
      } else {
        IncrBy(c, c.cmd == kIncrby ? by : -by);
      }
      return true;
    }
    case kIncrbyfloat:
      IncrByFloat(c);
      return true;
    case kGetrange:
      GetRange(c);
      return true;
    default:
      return false;
  }
}

}  // namespace sparsekv::server::resp
