// RESP commands: the table of what sparsekvd serves, and the command families that serve the
// keyspace apart from connection handling (resp_session.cc), as Dragonfly keeps its facade apart
// from string_family.cc:
//   resp_string_family.cc   GET-side and SET-side commands on one value (SET's options, GETEX,
//                           GETDEL, GETSET, SETNX, SETEX, PSETEX, MSET, MSETNX, APPEND,
//                           SETRANGE, STRLEN, GETRANGE)
//   resp_generic_family.cc  commands on keys whatever they hold (EXISTS, DEL, TYPE, the expiry
//                           commands, RENAME, COPY, SCAN, KEYS, DBSIZE, FLUSHDB, FLUSHALL)
// Connection and server commands (HELLO, AUTH, CLIENT, CONFIG, INFO, COMMAND) stay with the
// connection, whose state they read and change.
//
// A family's handler runs on a worker thread (it may block on tier I/O) with a Command: the
// request's words, the caller's namespace, a writer for the reply and the Keyspace. It answers
// through the writer or sets `error` (the reply's whole text, "ERR ..."), never both.
//
// Replies and errors are Redis 7.0's, word for word (read at redis/redis 7.0.15, f35f36a2:
// t_string.c, expire.c, db.c).
//
// Thread safety: handlers are called from many worker threads at once; what they share is the
// Keyspace's (thread-safe).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "server/resp_keyspace.h"
#include "server/resp_protocol.h"

namespace sparsekv::server::resp {

// The commands sparsekvd serves, with Redis's arity (n: exactly n words with the name; -n: at
// least n). kUnknown counts everything else in the metrics.
enum Cmd : int {
  kPing, kEcho, kHello, kAuth, kClient, kSelect, kQuit, kGet, kSet, kMget, kMset, kExists, kDel, kUnlink,
  kStrlen, kGetrange, kDbsize, kScan, kType, kTtl, kPttl, kInfo, kConfig, kCommand, kFlushdb, kReset,
  kKeys, kFlushall, kExpire, kPexpire, kExpireat, kPexpireat, kExpiretime, kPexpiretime, kPersist, kGetex,
  kGetdel, kGetset, kSetnx, kSetex, kPsetex, kMsetnx, kAppend, kSetrange, kCopy, kRename, kRenamenx, kFunction, kIncr, kDecr, kIncrby, kDecrby, kIncrbyfloat, kTouch, kTime, kRandomkey, kMonitor,
  kUnknown, kCmdCount
};

enum class Group { kConnection, kServer, kGeneric, kString };

struct CmdSpec {
  const char* name;
  int arity;
  bool before_auth;  // allowed before AUTH
  Group group;
  // Keys for COMMAND INFO: the first, the last (-1: the last word), the step (0: no keys).
  int first_key, last_key, key_step;
};
extern const std::array<CmdSpec, kCmdCount> kSpecs;

Cmd Lookup(std::string_view name);

std::string Lower(std::string_view s);
bool EqualsNoCase(std::string_view a, std::string_view b);
// Redis's string2ll: a whole base-10 64-bit integer, no '+', no spaces.
bool ParseI64(std::string_view s, int64_t& out);
inline std::string_view AsChars(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}
// `s` cut to `max` bytes with CR and LF as spaces (for an error's text).
std::string Printable(std::string_view s, size_t max);

inline constexpr std::string_view kNotInteger = "ERR value is not an integer or out of range";
inline constexpr std::string_view kSyntaxError = "ERR syntax error";

struct Command {
  Cmd cmd = kUnknown;
  uint32_t ns = 0;
  std::span<const std::string_view> args;  // args[0] is the command's name
  RespWriter& w;
  std::string& error;
  Keyspace& ks;
  uint64_t max_bulk_bytes = 0;  // the longest string a value may grow to (proto-max-bulk-len)
};

// Reads an expiry argument as Redis's getExpireMillisecondsOrReply does: `seconds` (else ms),
// `relative` (EX/PX: added to now, else a Unix time). False with `c.error` set when invalid.
bool ParseExpiry(Command& c, std::string_view arg, bool seconds, bool relative, int64_t& deadline_ms);

// The families' worker-thread handlers; false when `c.cmd` is not the family's.
bool ServeStringCommand(Command& c);
bool ServeGenericCommand(Command& c);

// The words of a key argument that a command takes (for the key length check before serving):
// calls `f(i)` for each.
template <typename F>
void ForEachKey(Cmd cmd, size_t argc, F&& f) {
  const CmdSpec& s = kSpecs[cmd];
  if (s.key_step == 0) return;
  const size_t last = s.last_key < 0 ? argc - 1 : static_cast<size_t>(s.last_key);
  for (size_t i = static_cast<size_t>(s.first_key); i <= last && i < argc; i += static_cast<size_t>(s.key_step)) f(i);
}

}  // namespace sparsekv::server::resp
