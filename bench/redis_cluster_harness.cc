#include "redis_cluster_harness.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

namespace sparsekv::bench {
namespace {

using Clock = std::chrono::steady_clock;

bool PortFree(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// Runs argv (found on PATH) with stdout and stderr to `log`; returns its pid. The child gets
// SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG), so a test killed halfway
// leaves no server behind.
Result<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return Status::Unavailable(fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    // Only async-signal-safe calls from here on.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);  // the parent is gone already
    const int out = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const int in = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (out < 0 || in < 0 || dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0) _exit(126);
    execvp(args[0], args.data());
    _exit(127);
  }
  return pid;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ReplyText(const redisReply* r) {
  switch (r->type) {
    case REDIS_REPLY_NIL:
      return "(nil)";
    case REDIS_REPLY_INTEGER:
      return ":" + std::to_string(r->integer);
    case REDIS_REPLY_STATUS:
      return "+" + std::string(r->str, r->len);
    case REDIS_REPLY_ERROR:
      return "-" + std::string(r->str, r->len);
    case REDIS_REPLY_STRING:
      return std::string(r->str, r->len);
    case REDIS_REPLY_ARRAY: {
      std::string out;
      for (size_t i = 0; i < r->elements; ++i) out += (i ? "\n" : "") + ReplyText(r->element[i]);
      return out;
    }
    default:
      return "";
  }
}

// "field:value" from INFO-style text.
std::string Field(const std::string& text, const std::string& name) {
  const size_t at = text.find(name + ":");
  if (at == std::string::npos) return "";
  const size_t from = at + name.size() + 1;
  return text.substr(from, text.find_first_of("\r\n", from) - from);
}

}  // namespace

std::vector<uint16_t> RedisClusterHarness::FreePorts(size_t n) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(20000, 22767);
  std::vector<uint16_t> out;
  for (int attempt = 0; attempt < 2000 && out.size() < n; ++attempt) {
    const auto p = static_cast<uint16_t>(pick(rng));
    if (std::find(out.begin(), out.end(), p) == out.end() && PortFree(p) && PortFree(static_cast<uint16_t>(p + 10000))) {
      out.push_back(p);
    }
  }
  return out;
}

Result<std::unique_ptr<RedisClusterHarness>> RedisClusterHarness::Start(const RedisClusterHarnessOptions& options) {
  if (options.primaries < 3) return Status::InvalidArgument("a Redis Cluster needs at least 3 primaries");
  if (options.replicas < 0) return Status::InvalidArgument("replicas must be 0 or more");
  std::unique_ptr<RedisClusterHarness> h(new RedisClusterHarness(options));
  std::string base = options.dir.empty() ? std::filesystem::temp_directory_path().string() : options.dir;
  std::string tmpl = base + "/sparsekv-redis-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    return Status::IOError(fmt::format("mkdtemp under {}: {}", base, std::strerror(errno)));
  }
  h->dir_ = tmpl;
  SPARSEKV_RETURN_IF_ERROR(h->StartNodes());
  SPARSEKV_RETURN_IF_ERROR(h->CreateCluster());
  return h;
}

RedisClusterHarness::~RedisClusterHarness() {
  for (Node& n : nodes_) {
    if (n.pid > 0 && n.alive) {
      kill(n.pid, SIGKILL);
      waitpid(n.pid, nullptr, 0);
    }
  }
  if (!options_.keep && !dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

std::vector<std::string> RedisClusterHarness::Seeds() const {
  std::vector<std::string> out;
  for (const Node& n : nodes_) out.push_back(n.address());
  return out;
}

Status RedisClusterHarness::StartNodes() {
  const int count = options_.primaries * (1 + options_.replicas);
  if (!options_.ports.empty() && options_.ports.size() != static_cast<size_t>(count)) {
    return Status::InvalidArgument(fmt::format("{} ports given for {} nodes", options_.ports.size(), count));
  }
  const std::vector<uint16_t> ports = options_.ports.empty() ? FreePorts(static_cast<size_t>(count)) : options_.ports;
  if (ports.size() != static_cast<size_t>(count)) return Status::Unavailable("no free port pairs for the redis nodes");
  for (int i = 0; i < count; ++i) {
    Node n;
    n.port = ports[static_cast<size_t>(i)];
    SPARSEKV_RETURN_IF_ERROR(StartNode(n));
    nodes_.push_back(n);
  }
  // Each answers PING. A node that lost its port to someone else between the check and its
  // bind (another test's cluster starting at the same moment) moves to other free ports.
  const auto deadline = Clock::now() + options_.start_timeout;
  int moves = 0;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    for (;;) {
      Result<std::string> r = Command(i, {"PING"});
      if (r.ok() && *r == "+PONG") break;
      int status = 0;
      if (waitpid(nodes_[i].pid, &status, WNOHANG) == nodes_[i].pid) {
        nodes_[i].alive = false;
        const std::string log = ReadFile(fmt::format("{}/{}/redis.log", dir_, nodes_[i].port));
        std::vector<uint16_t> other;
        if (options_.ports.empty() && moves < 10 && log.find("Address already in use") != std::string::npos) {
          other = FreePorts(1);
        }
        if (other.empty() || std::any_of(nodes_.begin(), nodes_.end(), [&](const Node& n) { return n.port == other[0]; })) {
          return Status::Unavailable(fmt::format("redis-server on port {} exited: {}", nodes_[i].port, log));
        }
        ++moves;
        nodes_[i].port = other[0];
        SPARSEKV_RETURN_IF_ERROR(StartNode(nodes_[i]));
        continue;
      }
      if (Clock::now() > deadline) {
        return Status::Unavailable(fmt::format("redis-server on port {} does not answer", nodes_[i].port));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return Status::OK();
}

Status RedisClusterHarness::StartNode(Node& n) {
  const std::string ndir = fmt::format("{}/{}", dir_, n.port);
  std::filesystem::create_directories(ndir);
  std::vector<std::string> argv = {options_.redis_server,
                                   "--port", std::to_string(n.port),
                                   "--bind", "127.0.0.1",
                                   "--dir", ndir,
                                   "--cluster-enabled", "yes",
                                   "--cluster-config-file", "nodes.conf",
                                   "--cluster-node-timeout", std::to_string(options_.node_timeout_ms),
                                   "--cluster-require-full-coverage", "no",
                                   "--appendonly", "no",
                                   "--save", "",
                                   "--maxmemory", std::to_string(options_.maxmemory_bytes),
                                   "--maxmemory-policy", "allkeys-lru",
                                   "--protected-mode", "no",
                                   "--daemonize", "no"};
  SPARSEKV_ASSIGN_OR_RETURN(n.pid, Spawn(argv, ndir + "/redis.log"));
  n.alive = true;
  return Status::OK();
}

Status RedisClusterHarness::CreateCluster() {
  std::vector<std::string> argv = {options_.redis_cli, "--cluster", "create"};
  for (const Node& n : nodes_) argv.push_back(n.address());
  argv.push_back("--cluster-replicas");
  argv.push_back(std::to_string(options_.replicas));
  argv.push_back("--cluster-yes");
  const std::string log = dir_ + "/cluster-create.log";
  SPARSEKV_ASSIGN_OR_RETURN(pid_t pid, Spawn(argv, log));
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Status::Unavailable(fmt::format("redis-cli --cluster create failed: {}", ReadFile(log)));
  }
  SPARSEKV_RETURN_IF_ERROR(WaitHealthy(options_.start_timeout));
  return WaitReplicated(options_.start_timeout);
}

Result<std::string> RedisClusterHarness::Command(size_t i, const std::vector<std::string>& args) {
  if (i >= nodes_.size()) return Status::InvalidArgument("no such node");
  const timeval tv{2, 0};
  redisContext* c = redisConnectWithTimeout("127.0.0.1", nodes_[i].port, tv);
  if (c == nullptr || c->err) {
    const std::string e = c ? c->errstr : "out of memory";
    if (c) redisFree(c);
    return Status::Unavailable(fmt::format("node {}: {}", nodes_[i].address(), e));
  }
  redisSetTimeout(c, tv);
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const std::string& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  auto* r = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
  if (r == nullptr) {
    const std::string e = c->errstr;
    redisFree(c);
    return Status::Unavailable(fmt::format("node {}: {}", nodes_[i].address(), e));
  }
  std::string out = ReplyText(r);
  freeReplyObject(r);
  redisFree(c);
  return out;
}

Status RedisClusterHarness::Kill(size_t i) {
  if (i >= nodes_.size() || !nodes_[i].alive) return Status::InvalidArgument("no such live node");
  kill(nodes_[i].pid, SIGKILL);
  waitpid(nodes_[i].pid, nullptr, 0);
  nodes_[i].alive = false;
  return Status::OK();
}

Status RedisClusterHarness::Pause(size_t i) {
  if (i >= nodes_.size() || !nodes_[i].alive) return Status::InvalidArgument("no such live node");
  kill(nodes_[i].pid, SIGSTOP);
  return Status::OK();
}

Status RedisClusterHarness::Resume(size_t i) {
  if (i >= nodes_.size() || !nodes_[i].alive) return Status::InvalidArgument("no such live node");
  kill(nodes_[i].pid, SIGCONT);
  return Status::OK();
}

Status RedisClusterHarness::Refresh() {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (!nodes_[i].alive) continue;
    SPARSEKV_ASSIGN_OR_RETURN(std::string role, Command(i, {"ROLE"}));
    nodes_[i].primary = role.rfind("master", 0) == 0;
    SPARSEKV_ASSIGN_OR_RETURN(std::string id, Command(i, {"CLUSTER", "MYID"}));
    nodes_[i].id = id;
  }
  return Status::OK();
}

Status RedisClusterHarness::WaitHealthy(std::chrono::milliseconds within) {
  const auto deadline = Clock::now() + within;
  std::string last;
  for (;;) {
    bool ok = true;
    for (size_t i = 0; i < nodes_.size() && ok; ++i) {
      if (!nodes_[i].alive) continue;
      Result<std::string> info = Command(i, {"CLUSTER", "INFO"});
      ok = info.ok() && Field(*info, "cluster_state") == "ok" && Field(*info, "cluster_slots_ok") == "16384";
      if (!ok) last = info.ok() ? fmt::format("{}: {}", nodes_[i].address(), *info) : info.status().ToString();
    }
    if (ok) {
      // Every slot served by a node of ours that is alive (right after a kill the others still
      // count the dead node's slots as ok, until they flag it).
      Result<std::vector<int>> owners = SlotOwners();
      ok = owners.ok() && std::all_of(owners->begin(), owners->end(), [&](int n) {
             return n >= 0 && nodes_[static_cast<size_t>(n)].alive;
           });
      if (!ok) last = owners.ok() ? "a slot is served by a node that is down" : owners.status().ToString();
    }
    if (ok) return Refresh();
    if (Clock::now() > deadline) return Status::Unavailable("the redis cluster is not healthy: " + last);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Status RedisClusterHarness::WaitReplicated(std::chrono::milliseconds within) {
  const auto deadline = Clock::now() + within;
  for (;;) {
    bool ok = true;
    std::string last;
    for (size_t i = 0; i < nodes_.size() && ok; ++i) {
      if (!nodes_[i].alive || nodes_[i].primary) continue;
      Result<std::string> info = Command(i, {"INFO", "replication"});
      if (!info.ok()) return info.status();
      const std::string host = Field(*info, "master_host"), port = Field(*info, "master_port");
      size_t primary = nodes_.size();
      for (size_t p = 0; p < nodes_.size(); ++p) {
        if (nodes_[p].alive && std::to_string(nodes_[p].port) == port) primary = p;
      }
      if (primary == nodes_.size()) continue;  // its primary is gone: nothing to catch up with
      Result<std::string> pinfo = Command(primary, {"INFO", "replication"});
      if (!pinfo.ok()) return pinfo.status();
      ok = Field(*info, "master_link_status") == "up" &&
           Field(*info, "slave_repl_offset") == Field(*pinfo, "master_repl_offset");
      if (!ok) last = nodes_[i].address();
    }
    if (ok) return Status::OK();
    if (Clock::now() > deadline) return Status::Unavailable("redis replicas have not caught up: " + last);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Result<size_t> RedisClusterHarness::NodeOfSlot(uint32_t slot) {
  SPARSEKV_ASSIGN_OR_RETURN(std::vector<int> owners, SlotOwners());
  if (slot >= owners.size() || owners[slot] < 0) return Status::NotFound(fmt::format("no node serves slot {}", slot));
  return static_cast<size_t>(owners[slot]);
}

Result<std::vector<int>> RedisClusterHarness::SlotOwners() {
  // Lines of CLUSTER NODES: id, address, flags, primary, ping, pong, epoch, link, slot ranges.
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (!nodes_[i].alive) continue;
    Result<std::string> r = Command(i, {"CLUSTER", "NODES"});
    if (!r.ok()) continue;
    std::vector<int> owners(16384, -1);
    std::istringstream lines(*r);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream f(line);
      std::string id, addr, flags, master, ping, pong, epoch, link, range;
      f >> id >> addr >> flags >> master >> ping >> pong >> epoch >> link;
      if (flags.find("master") == std::string::npos || flags.find("fail") != std::string::npos) continue;
      const std::string port = addr.substr(addr.find(':') + 1, addr.find('@') - addr.find(':') - 1);
      int node = -1;
      for (size_t n = 0; n < nodes_.size(); ++n) {
        if (std::to_string(nodes_[n].port) == port) node = static_cast<int>(n);
      }
      while (f >> range) {
        if (range[0] == '[') continue;  // a slot being migrated
        const size_t dash = range.find('-');
        const auto lo = static_cast<uint32_t>(std::stoul(range.substr(0, dash)));
        const auto hi = dash == std::string::npos ? lo : static_cast<uint32_t>(std::stoul(range.substr(dash + 1)));
        for (uint32_t s = lo; s <= hi && s < owners.size(); ++s) owners[s] = node;
      }
    }
    return owners;
  }
  return Status::Unavailable("no redis node answers CLUSTER NODES");
}

Status RedisClusterHarness::MoveSlot(uint32_t slot, size_t to, bool leave_migrating) {
  SPARSEKV_RETURN_IF_ERROR(Refresh());
  SPARSEKV_ASSIGN_OR_RETURN(size_t from, NodeOfSlot(slot));
  if (from == to) return Status::OK();
  if (!nodes_[to].primary) return Status::InvalidArgument("MoveSlot: the target is not a primary");
  const std::string s = std::to_string(slot);
  auto expect_ok = [](const Result<std::string>& r, const char* what) -> Status {
    if (!r.ok()) return r.status();
    if (*r != "+OK" && *r != "+NOKEY") return Status::Unavailable(fmt::format("{}: {}", what, *r));
    return Status::OK();
  };
  SPARSEKV_RETURN_IF_ERROR(expect_ok(Command(to, {"CLUSTER", "SETSLOT", s, "IMPORTING", nodes_[from].id}), "IMPORTING"));
  SPARSEKV_RETURN_IF_ERROR(expect_ok(Command(from, {"CLUSTER", "SETSLOT", s, "MIGRATING", nodes_[to].id}), "MIGRATING"));
  for (;;) {
    SPARSEKV_ASSIGN_OR_RETURN(std::string keys, Command(from, {"CLUSTER", "GETKEYSINSLOT", s, "100"}));
    if (keys.empty()) break;
    std::vector<std::string> args = {"MIGRATE", "127.0.0.1", std::to_string(nodes_[to].port), "", "0", "5000", "KEYS"};
    std::istringstream ks(keys);
    std::string k;
    while (std::getline(ks, k)) args.push_back(k);
    SPARSEKV_RETURN_IF_ERROR(expect_ok(Command(from, args), "MIGRATE"));
  }
  if (leave_migrating) return Status::OK();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (!nodes_[i].alive || !nodes_[i].primary) continue;
    SPARSEKV_RETURN_IF_ERROR(expect_ok(Command(i, {"CLUSTER", "SETSLOT", s, "NODE", nodes_[to].id}), "SETSLOT NODE"));
  }
  return Status::OK();
}

}  // namespace sparsekv::bench
