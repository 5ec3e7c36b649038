// The commands on the connection and the server (resp_connection.h): HELLO, AUTH, CLIENT, CONFIG,
// COMMAND and INFO, which read and change the connection's own state, answered on its thread
// (INFO's text is built on a worker). Replies and errors are Redis 7.0's, word for word (read at
// redis/redis 7.0.15, f35f36a2: networking.c, config.c, server.c).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "server/resp_connection.h"

namespace sparsekv::server {

std::string RespConnection::InfoText() {
  const std::string_view section = args_.size() > 1 ? args_[1] : std::string_view("default");
  const bool all = EqualsNoCase(section, "all") || EqualsNoCase(section, "everything") ||
                   EqualsNoCase(section, "default");
  auto want = [&](std::string_view s) {
    if (all) return true;
    for (size_t i = 1; i < args_.size(); ++i) {
      if (EqualsNoCase(args_[i], s)) return true;
    }
    return false;
  };
  std::string out;
  const ServerOptions& o = *host_.options;
  const std::vector<DaemonStore::TierInfo> tiers = host_.store->Tiers();
  uint64_t host_bytes = 0, host_capacity = 0;
  for (const auto& t : tiers) {
    if (t.name == "host") {
      host_bytes = t.bytes;
      host_capacity = t.capacity_bytes;
    }
  }
  if (want("server")) {
    const auto up = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - fe_.started_at());
    out += fmt::format(
        "# Server\r\nredis_version:7.0.0\r\nsparsekv_version:{}\r\nredis_mode:standalone\r\nos:Linux\r\n"
        "arch_bits:64\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\nuptime_in_days:{}\r\n\r\n",
        SPARSEKV_SERVER_VERSION, ::getpid(), fe_.tcp_port(), up.count(), up.count() / 86400);
  }
  if (want("clients")) {
    out += fmt::format("# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n\r\n",
                       fe_.open_.load(std::memory_order_relaxed), o.max_connections);
  }
  if (want("memory")) {
    out += fmt::format(
        "# Memory\r\nused_memory:{0}\r\nused_memory_human:{1:.2f}M\r\nmaxmemory:{2}\r\nmaxmemory_human:{3:.2f}M\r\n"
        "maxmemory_policy:sparsekv-tiered\r\n\r\n",
        host_bytes, host_bytes / 1048576.0, host_capacity, host_capacity / 1048576.0);
  }
  if (want("stats")) {
    uint64_t evicted = 0;
    for (const auto& t : tiers) evicted += t.remote ? 0 : t.evictions;
    out += fmt::format(
        "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\nrejected_connections:{}\r\n"
        "keyspace_hits:{}\r\nkeyspace_misses:{}\r\nevicted_keys:{}\r\nexpired_keys:{}\r\n\r\n",
        fe_.accepted_.load(), fe_.commands_total_.load(), fe_.rejected_.load(), fe_.keyspace_hits_.load(),
        fe_.keyspace_misses_.load(), evicted, fe_.keyspace_.expired_keys());
  }
  if (want("keyspace")) {
    const size_t keys = host_.store->ListHashes(ns_).size();
    out += "# Keyspace\r\n";
    const auto [expires, avg_ttl] = fe_.keyspace_.Expiring(ns_, NowMs());
    if (keys > 0) out += fmt::format("db0:keys={},expires={},avg_ttl={}\r\n", keys, expires, avg_ttl);
    out += "\r\n";
  }
  if (want("sparsekv")) {
    out += fmt::format("# Sparsekv\r\nnamespace:{}\r\ntiers:{}\r\n", o.namespaces[ns_ - 1].name, tiers.size());
    for (size_t i = 0; i < tiers.size(); ++i) {
      const auto& t = tiers[i];
      out += fmt::format(
          "tier{}:name={},capacity_bytes={},bytes={},items={},hits={},misses={},evictions={},corrupt={},remote={}\r\n",
          i, t.name, t.capacity_bytes, t.bytes, t.items, t.hits, t.misses, t.evictions, t.corrupt, t.remote ? 1 : 0);
    }
    out += "\r\n";
  }
  if (out.size() >= 4 && out.compare(out.size() - 4, 4, "\r\n\r\n") == 0) out.resize(out.size() - 2);
  return out;
}

void RespConnection::Hello(Reply r) {
  size_t i = 1;
  int proto = protocol_;
  if (args_.size() > 1) {
    int64_t v = 0;
    if (!ParseI64(args_[1], v)) return Answer(std::move(r), "ERR Protocol version is not an integer or out of range");
    if (v < 2 || v > 3) return Answer(std::move(r), "NOPROTO unsupported protocol version");
    proto = static_cast<int>(v);
    i = 2;
  }
  std::string name = name_;
  uint32_t ns = ns_;
  for (; i < args_.size(); ++i) {
    if (EqualsNoCase(args_[i], "auth") && i + 2 < args_.size()) {
      ns = fe_.Authenticate(args_[i + 1], args_[i + 2]);
      if (ns == 0) {
        fe_.auth_failures_.fetch_add(1, std::memory_order_relaxed);
        host_.metrics->AuthFailure();
        return Answer(std::move(r), "WRONGPASS invalid username-password pair or user is disabled.");
      }
      i += 2;
    } else if (EqualsNoCase(args_[i], "setname") && i + 1 < args_.size()) {
      name = std::string(args_[i + 1]);
      ++i;
    } else {
      return Answer(std::move(r), fmt::format("ERR Syntax error in HELLO option '{}'", Printable(args_[i], 64)));
    }
  }
  if (ns == 0) return Answer(std::move(r), "NOAUTH HELLO must be called with the client already authenticated, "
                                           "otherwise the HELLO <proto> AUTH <user> <pass> option can be used to "
                                           "authenticate the client and select the RESP protocol version at the same "
                                           "time");
  if (!EnterNamespace(ns)) return Answer(std::move(r), QuotaError(ns));
  name_ = std::move(name);
  protocol_ = proto;
  shared_protocol_.store(proto, std::memory_order_relaxed);
  r.set_protocol(proto);
  auto w = r.W();
  w.Map(7);
  w.Bulk("server");
  w.Bulk("sparsekv");
  w.Bulk("version");
  w.Bulk("7.0.0");
  w.Bulk("proto");
  w.Integer(proto);
  w.Bulk("id");
  w.Integer(static_cast<int64_t>(id_));
  w.Bulk("mode");
  w.Bulk("standalone");
  w.Bulk("role");
  w.Bulk("master");
  w.Bulk("modules");
  w.Array(0);
  Answer(std::move(r));
}

void RespConnection::Auth(Reply r) {
  if (args_.size() > 3) return Answer(std::move(r), "ERR syntax error");
  std::string_view user = "default", pass = args_[1];
  if (args_.size() == 3) {
    user = args_[1];
    pass = args_[2];
  } else if (fe_.default_ns_ != 0 && host_.options->namespaces[fe_.default_ns_ - 1].token.empty()) {
    return Answer(std::move(r),
                  "ERR AUTH <password> called without any password configured for the default user. Are you sure "
                  "your configuration is correct?");
  }
  const uint32_t ns = fe_.Authenticate(user, pass);
  if (ns == 0) {
    fe_.auth_failures_.fetch_add(1, std::memory_order_relaxed);
    host_.metrics->AuthFailure();
    return Answer(std::move(r), "WRONGPASS invalid username-password pair or user is disabled.");
  }
  if (!EnterNamespace(ns)) return Answer(std::move(r), QuotaError(ns));
  r.W().Simple("OK");
  Answer(std::move(r));
}

void RespConnection::SubcommandError(Reply r, std::string_view cmd, const std::vector<std::pair<const char*, int>>& subs) {
  const std::string sub = Lower(args_[1]);
  for (const auto& [name, arity] : subs) {
    if (sub == name) {
      return Answer(std::move(r), fmt::format("ERR wrong number of arguments for '{}|{}' command", cmd, name));
    }
  }
  std::string upper(cmd);
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  Answer(std::move(r), fmt::format("ERR unknown subcommand '{}'. Try {} HELP.", Printable(args_[1], 128), upper));
}

void RespConnection::ClientCmd(Reply r) {
  const std::string sub = Lower(args_[1]);
  auto w = r.W();
  if (sub == "setname" && args_.size() == 3) {
    for (char c : args_[2]) {
      if (c < '!' || c > '~') {
        return Answer(std::move(r), "ERR Client names cannot contain spaces, newlines or special characters.");
      }
    }
    SetName(std::string(args_[2]));
    w.Simple("OK");
  } else if (sub == "getname" && args_.size() == 2) {
    if (name_.empty()) {
      w.Null();
    } else {
      w.Bulk(name_);
    }
  } else if (sub == "id" && args_.size() == 2) {
    w.Integer(static_cast<int64_t>(id_));
  } else if (sub == "setinfo" && args_.size() == 4) {
    const std::string attr = Lower(args_[2]);
    if (attr != "lib-name" && attr != "lib-ver") {
      return Answer(std::move(r), fmt::format("ERR Unrecognized option '{}'", Printable(args_[2], 64)));
    }
    w.Simple("OK");
  } else if (sub == "info" && args_.size() == 2) {
    w.Verbatim(InfoLine(/*caller=*/true, "client|info") + "\n");
  } else if (sub == "list") {
    return ClientList(std::move(r));
  } else if (sub == "kill" && args_.size() >= 3) {
    return ClientKill(std::move(r));
  } else if (sub == "reply" && args_.size() == 3) {
    // CLIENT REPLY ON|OFF|SKIP: OFF and SKIP are not answered.
    if (EqualsNoCase(args_[2], "on")) {
      reply_off_ = skip_next_ = skip_this_ = false;  // (ON after SKIP is answered, as in Redis)
      w.Simple("OK");
    } else if (EqualsNoCase(args_[2], "off")) {
      reply_off_ = true;
    } else if (EqualsNoCase(args_[2], "skip")) {
      if (!reply_off_) skip_next_ = true;
    } else {
      return Answer(std::move(r), kSyntaxError);
    }
  } else {
    return SubcommandError(std::move(r), "client",
                           {{"setname", 3}, {"getname", 2}, {"id", 2}, {"setinfo", 4}, {"info", 2}, {"kill", -3},
                            {"reply", 3}});
  }
  Answer(std::move(r));
}

bool RespConnection::KnownClientType(std::string_view t, bool& normal) {
  normal = EqualsNoCase(t, "normal");
  return normal || EqualsNoCase(t, "master") || EqualsNoCase(t, "replica") || EqualsNoCase(t, "slave") ||
         EqualsNoCase(t, "pubsub");
}

void RespConnection::ClientList(Reply r) {
  std::optional<std::vector<uint64_t>> ids;
  bool all = true;
  if (args_.size() == 4 && EqualsNoCase(args_[2], "type")) {
    if (!KnownClientType(args_[3], all)) {
      return Answer(std::move(r), fmt::format("ERR Unknown client type '{}'", Printable(args_[3], 128)));
    }
  } else if (args_.size() > 3 && EqualsNoCase(args_[2], "id")) {
    ids.emplace();
    for (size_t i = 3; i < args_.size(); ++i) {
      int64_t id = 0;
      if (!ParseI64(args_[i], id)) return Answer(std::move(r), "ERR Invalid client ID");
      ids->push_back(static_cast<uint64_t>(id));
    }
  } else if (args_.size() != 2) {
    return Answer(std::move(r), kSyntaxError);
  }
  std::string out;
  if (all) {
    for (const auto& c : fe_.Connections(ns_)) {
      if (ids && std::find(ids->begin(), ids->end(), c->id_) == ids->end()) continue;
      out += c.get() == this ? InfoLine(true, "client|list") : c->InfoLine(false, {});
      out += '\n';
    }
  }
  r.W().Verbatim(out);
  Answer(std::move(r));
}

void RespConnection::ClientKill(Reply r) {
  std::optional<std::string_view> addr, laddr, user;
  uint64_t id = 0;
  bool skipme = true, any_type = true;
  const bool old_form = args_.size() == 3;
  if (old_form) {
    addr = args_[2];
    skipme = false;  // the old form may close the caller itself
  } else {
    for (size_t i = 2; i < args_.size(); i += 2) {
      const bool more = i + 1 < args_.size();
      const std::string_view opt = args_[i];
      if (!more) return Answer(std::move(r), kSyntaxError);
      const std::string_view v = args_[i + 1];
      if (EqualsNoCase(opt, "id")) {
        int64_t n = 0;
        if (!ParseI64(v, n) || n < 1) return Answer(std::move(r), "ERR client-id should be greater than 0");
        id = static_cast<uint64_t>(n);
      } else if (EqualsNoCase(opt, "type")) {
        if (!KnownClientType(v, any_type)) {
          return Answer(std::move(r), fmt::format("ERR Unknown client type '{}'", Printable(v, 128)));
        }
      } else if (EqualsNoCase(opt, "addr")) {
        addr = v;
      } else if (EqualsNoCase(opt, "laddr")) {
        laddr = v;
      } else if (EqualsNoCase(opt, "user")) {
        bool known = false;
        for (const auto& n : host_.options->namespaces) known = known || n.name == v;
        if (!known) return Answer(std::move(r), fmt::format("ERR No such user '{}'", Printable(v, 128)));
        user = v;
      } else if (EqualsNoCase(opt, "skipme")) {
        if (EqualsNoCase(v, "yes")) {
          skipme = true;
        } else if (EqualsNoCase(v, "no")) {
          skipme = false;
        } else {
          return Answer(std::move(r), kSyntaxError);
        }
      } else {
        return Answer(std::move(r), kSyntaxError);
      }
    }
  }
  int64_t killed = 0;
  if (any_type) {
    const std::string my_ns = host_.options->namespaces[ns_ - 1].name;
    for (const auto& c : fe_.Connections(ns_)) {
      if (addr && c->addr_ != *addr) continue;
      if (laddr && c->laddr_ != *laddr) continue;
      if (id != 0 && c->id_ != id) continue;
      if (user && *user != my_ns) continue;
      if (c.get() == this) {
        if (skipme) continue;
        r.close_after = true;  // after this reply
      } else {
        c->Kill();
      }
      ++killed;
    }
  }
  if (old_form) {
    if (killed == 0) return Answer(std::move(r), "ERR No such client");
    r.W().Simple("OK");
  } else {
    r.W().Integer(killed);
  }
  Answer(std::move(r));
}

std::string RespConnection::InfoLine(bool caller, std::string_view current) const {
  const auto now = Clock::now();
  const auto secs = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::seconds>(now - t).count();
  };
  const int last = last_cmd_.load(std::memory_order_relaxed);
  std::string name, cmd;
  {
    std::lock_guard<std::mutex> l(info_mu_);
    name = shared_name_;
    if (last == kClient || last == kConfig || last == kCommand) cmd = shared_fullname_;
  }
  const uint32_t ns = shared_ns_.load(std::memory_order_relaxed);
  if (caller) {
    cmd = current;
  } else if (cmd.empty()) {
    cmd = last < 0 ? "NULL" : kSpecs[last].name;
  }
  const Clock::time_point active{Clock::duration(last_cmd_at_.load(std::memory_order_relaxed))};
  // The caller's own query buffer holds the request being served (as Redis's does); another
  // connection's is read only from what it shares (its buffer's size).
  uint64_t qbuf = 0, qbuf_free = 0, argv_mem = 0;
  if (caller) {
    qbuf = end_ - request_begin_;
    qbuf_free = cap_ - end_;
    for (std::string_view a : args_) argv_mem += a.size();
  }
  const uint64_t rbs = cap_shared_.load(std::memory_order_relaxed);
  return fmt::format(
      "id={} addr={} laddr={} fd={} name={} age={} idle={} flags={} db=0 sub=0 psub=0 ssub=0 multi=-1 qbuf={} "
      "qbuf-free={} argv-mem={} multi-mem=0 rbs={} rbp=0 obl=0 oll=0 omem=0 tot-mem={} events=r cmd={} user={} "
      "redir=-1 resp={}",
      id_, addr_, laddr_, fd_, name, secs(created_), secs(active), is_unix_ ? "U" : "N", qbuf, qbuf_free, argv_mem,
      rbs, rbs + 1024, cmd,
      ns == 0 ? "(none)" : host_.options->namespaces[ns - 1].name, shared_protocol_.load(std::memory_order_relaxed));
}

void RespConnection::SetName(std::string name) {
  name_ = name;
  std::lock_guard<std::mutex> l(info_mu_);
  shared_name_ = std::move(name);
}

void RespConnection::Config(Reply r) {
  const std::string sub = Lower(args_[1]);
  if (sub == "get" && args_.size() >= 3) {
    const ServerOptions& o = *host_.options;
    uint64_t host_capacity = 0;
    for (const auto& t : host_.store->Tiers()) {
      if (t.name == "host") host_capacity = t.capacity_bytes;
    }
    const std::vector<std::pair<std::string, std::string>> params = {
        {"save", ""},
        {"appendonly", "no"},
        {"databases", "1"},
        {"maxclients", std::to_string(o.max_connections)},
        {"maxmemory", std::to_string(host_capacity)},
        {"maxmemory-policy", "allkeys-lru"},
        {"proto-max-bulk-len", std::to_string(fe_.max_bulk_.load(std::memory_order_relaxed))},
        {"timeout", std::to_string(fe_.idle_timeout_ms_.load(std::memory_order_relaxed) / 1000)},
        {"port", std::to_string(fe_.tcp_port())},
    };
    std::vector<const std::pair<std::string, std::string>*> hits;
    for (const auto& p : params) {
      for (size_t i = 2; i < args_.size(); ++i) {
        if (resp::GlobMatch(args_[i], p.first, /*nocase=*/true)) {
          hits.push_back(&p);
          break;
        }
      }
    }
    auto w = r.W();
    w.Map(hits.size());
    for (const auto* p : hits) {
      w.Bulk(p->first);
      w.Bulk(p->second);
    }
    return Answer(std::move(r));
  }
  if (sub == "resetstat" && args_.size() == 2) {
    r.W().Simple("OK");
    return Answer(std::move(r));
  }
  if (sub == "set" && args_.size() >= 4) return ConfigSet(std::move(r));
  return SubcommandError(std::move(r), "config", {{"get", -3}, {"set", -4}, {"resetstat", 2}});
}

void RespConnection::ConfigSet(Reply r) {
  if (args_.size() % 2 == 1) return Answer(std::move(r), kSyntaxError);
  const uint64_t most = fe_.limits_.max_bulk_bytes;
  std::optional<uint32_t> timeout;
  std::optional<uint64_t> bulk;
  std::vector<std::string> seen;
  auto failed = [&](std::string_view name, std::string_view why) {
    return fmt::format("ERR CONFIG SET failed (possibly related to argument '{}') - {}", Printable(name, 128), why);
  };
  std::string error;
  for (size_t i = 2; i + 1 < args_.size() && error.empty(); i += 2) {
    const std::string name = Lower(args_[i]);
    const std::string_view v = args_[i + 1];
    if (std::find(seen.begin(), seen.end(), name) != seen.end()) {
      error = failed(args_[i], "duplicate parameter");
      break;
    }
    seen.push_back(name);
    int64_t n = 0;
    if (name == "timeout") {
      if (!ParseI64(v, n) || n < 0 || n > INT32_MAX / 1000) {
        error = failed(args_[i], "argument couldn't be parsed into an integer");
      } else {
        timeout = static_cast<uint32_t>(n * 1000);
      }
    } else if (name == "proto-max-bulk-len") {
      if (!ParseI64(v, n) || n < (1 << 20)) {
        error = failed(args_[i], "argument must be a memory value of at least 1mb");
      } else if (static_cast<uint64_t>(n) > most) {
        error = failed(args_[i], fmt::format("sparsekvd's tiers and max_frame_bytes take at most {}", most));
      } else {
        bulk = static_cast<uint64_t>(n);
      }
    } else if (name == "save") {
      if (!v.empty()) error = failed(args_[i], "sparsekvd writes no RDB snapshots: its tiers persist values");
    } else if (name == "appendonly") {
      if (!EqualsNoCase(v, "no")) error = failed(args_[i], "sparsekvd keeps no append-only file: its tiers persist values");
    } else if (name == "maxclients" || name == "maxmemory" || name == "maxmemory-policy" || name == "databases" ||
               name == "port") {
      error = failed(args_[i], "sparsekvd sets it in its configuration file, not at run time");
    } else {
      error = fmt::format("ERR Unknown option or number of arguments for CONFIG SET - '{}'", Printable(args_[i], 128));
    }
  }
  if (!error.empty()) return Answer(std::move(r), error);
  if (timeout) fe_.idle_timeout_ms_.store(*timeout, std::memory_order_relaxed);
  if (bulk) fe_.max_bulk_.store(*bulk, std::memory_order_relaxed);
  r.W().Simple("OK");
  Answer(std::move(r));
}

void RespConnection::CommandCmd(Reply r) {
  auto w = r.W();
  auto info = [&](const CmdSpec& s) {
    // name, arity, flags, first key, last key, step, ACL categories, tips, key specs, subcommands
    w.Array(10);
    w.Bulk(s.name);
    w.Integer(s.arity);
    w.Set(0);
    w.Integer(s.first_key);
    w.Integer(s.last_key);
    w.Integer(s.key_step);
    w.Set(0);
    w.Array(0);
    w.Array(0);
    w.Array(0);
  };
  const size_t known = kUnknown;
  if (args_.size() == 1) {
    w.Array(known);
    for (size_t i = 0; i < known; ++i) info(kSpecs[i]);
    return Answer(std::move(r));
  }
  const std::string sub = Lower(args_[1]);
  if (sub == "count") {
    w.Integer(static_cast<int64_t>(known));
  } else if (sub == "docs") {
    // A summary and group per command (redis-cli takes its hints from these).
    std::vector<const CmdSpec*> asked;
    if (args_.size() == 2) {
      for (size_t i = 0; i < known; ++i) asked.push_back(&kSpecs[i]);
    } else {
      for (size_t i = 2; i < args_.size(); ++i) {
        const Cmd c = Lookup(args_[i]);
        if (c != kUnknown) asked.push_back(&kSpecs[c]);
      }
    }
    w.Map(asked.size());
    for (const CmdSpec* s : asked) {
      static constexpr const char* kGroups[] = {"connection", "server", "generic", "string"};
      w.Bulk(s->name);
      w.Map(3);
      w.Bulk("summary");
      w.Bulk(fmt::format("{} as Redis serves it, over sparsekv's tiers", Lower(s->name)));
      w.Bulk("since");
      w.Bulk("1.0.0");
      w.Bulk("group");
      w.Bulk(kGroups[static_cast<int>(s->group)]);
    }
  } else if (sub == "info") {
    w.Array(args_.size() - 2);
    for (size_t i = 2; i < args_.size(); ++i) {
      const Cmd c = Lookup(args_[i]);
      if (c == kUnknown) {
        w.NullArray();
      } else {
        info(kSpecs[c]);
      }
    }
  } else if (sub == "list") {
    w.Array(known);
    for (size_t i = 0; i < known; ++i) w.Bulk(kSpecs[i].name);
  } else {
    return SubcommandError(std::move(r), "command", {});
  }
  Answer(std::move(r));
}

void RespConnection::FunctionCmd(Reply r) {
  const std::string sub = Lower(args_[1]);
  if (sub == "flush" && args_.size() <= 3) {
    if (args_.size() == 3 && !EqualsNoCase(args_[2], "async") && !EqualsNoCase(args_[2], "sync")) {
      return Answer(std::move(r), "ERR FUNCTION FLUSH only supports SYNC|ASYNC option");
    }
    r.W().Simple("OK");
    return Answer(std::move(r));
  }
  if (sub == "list") {
    r.W().Array(0);
    return Answer(std::move(r));
  }
  SubcommandError(std::move(r), "function", {{"flush", -2}});
}

}  // namespace sparsekv::server
