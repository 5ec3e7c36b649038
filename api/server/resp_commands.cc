#include "server/resp_commands.h"

#include <cctype>
#include <charconv>

namespace sparsekv::server::resp {

namespace {
constexpr Group C = Group::kConnection, S = Group::kServer, G = Group::kGeneric, T = Group::kString;
}  // namespace

// Arity and keys as Redis 7.0's command table has them (COMMAND INFO on redis-server 7.0.15).
const std::array<CmdSpec, kCmdCount> kSpecs = {{
    {"ping", -1, false, C, 0, 0, 0},        {"echo", 2, false, C, 0, 0, 0},
    {"hello", -1, true, C, 0, 0, 0},        {"auth", -2, true, C, 0, 0, 0},
    {"client", -2, false, C, 0, 0, 0},      {"select", 2, false, C, 0, 0, 0},
    {"quit", -1, true, C, 0, 0, 0},         {"get", 2, false, T, 1, 1, 1},
    {"set", -3, false, T, 1, 1, 1},         {"mget", -2, false, T, 1, -1, 1},
    {"mset", -3, false, T, 1, -1, 2},       {"exists", -2, false, G, 1, -1, 1},
    {"del", -2, false, G, 1, -1, 1},        {"unlink", -2, false, G, 1, -1, 1},
    {"strlen", 2, false, T, 1, 1, 1},       {"getrange", 4, false, T, 1, 1, 1},
    {"dbsize", 1, false, S, 0, 0, 0},       {"scan", -2, false, G, 0, 0, 0},
    {"type", 2, false, G, 1, 1, 1},         {"ttl", 2, false, G, 1, 1, 1},
    {"pttl", 2, false, G, 1, 1, 1},         {"info", -1, false, S, 0, 0, 0},
    {"config", -2, false, S, 0, 0, 0},      {"command", -1, false, S, 0, 0, 0},
    {"flushdb", -1, false, S, 0, 0, 0},     {"reset", 1, true, C, 0, 0, 0},
    {"keys", 2, false, G, 0, 0, 0},         {"flushall", -1, false, S, 0, 0, 0},
    {"expire", -3, false, G, 1, 1, 1},      {"pexpire", -3, false, G, 1, 1, 1},
    {"expireat", -3, false, G, 1, 1, 1},    {"pexpireat", -3, false, G, 1, 1, 1},
    {"expiretime", 2, false, G, 1, 1, 1},   {"pexpiretime", 2, false, G, 1, 1, 1},
    {"persist", 2, false, G, 1, 1, 1},      {"getex", -2, false, T, 1, 1, 1},
    {"getdel", 2, false, T, 1, 1, 1},       {"getset", 3, false, T, 1, 1, 1},
    {"setnx", 3, false, T, 1, 1, 1},        {"setex", 4, false, T, 1, 1, 1},
    {"psetex", 4, false, T, 1, 1, 1},       {"msetnx", -3, false, T, 1, -1, 2},
    {"append", 3, false, T, 1, 1, 1},       {"setrange", 4, false, T, 1, 1, 1},
    {"copy", -3, false, G, 1, 2, 1},        {"rename", 3, false, G, 1, 2, 1},
    {"renamenx", 3, false, G, 1, 2, 1},     {"function", -2, false, S, 0, 0, 0},
    {"incr", 2, false, T, 1, 1, 1},         {"decr", 2, false, T, 1, 1, 1},
    {"incrby", 3, false, T, 1, 1, 1},       {"decrby", 3, false, T, 1, 1, 1},
    {"incrbyfloat", 3, false, T, 1, 1, 1},  {"touch", -2, false, G, 1, -1, 1},
    {"time", 1, false, S, 0, 0, 0},         {"randomkey", 1, false, G, 0, 0, 0},
    {"monitor", 1, false, S, 0, 0, 0},
    {"unknown", 0, true, C, 0, 0, 0},
}};

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool EqualsNoCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

Cmd Lookup(std::string_view name) {
  if (name.size() > 16) return kUnknown;
  for (int i = 0; i < kUnknown; ++i) {
    if (EqualsNoCase(name, kSpecs[i].name)) return static_cast<Cmd>(i);
  }
  return kUnknown;
}

bool ParseI64(std::string_view s, int64_t& out) {
  // Redis's rules: at most 20 characters, "0" alone or an optional '-' then a digit 1-9 and
  // digits (no '+', no leading zeros, no "-0", no spaces), within 64 bits.
  if (s.empty() || s.size() > 20) return false;
  if (s == "0") {
    out = 0;
    return true;
  }
  const size_t digits = s[0] == '-' ? 1 : 0;
  if (digits == s.size() || s[digits] < '1' || s[digits] > '9') return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::string Printable(std::string_view s, size_t max) {
  std::string out(s.substr(0, max));
  for (char& c : out) {
    if (c == '\r' || c == '\n') c = ' ';
  }
  return out;
}

}  // namespace sparsekv::server::resp
