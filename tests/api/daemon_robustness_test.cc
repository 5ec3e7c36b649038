// A shared daemon that no client, and no second daemon, can take down (issue 14):
// - a client cannot resize the shared memory the daemon maps (sealed memfds), so it cannot make
//   the daemon die of SIGBUS, and the daemon keeps serving everyone else;
// - a second sparsekvd on the same data dir or the same Unix socket path is refused, with the
//   path and the first daemon's pid, and leaves the first reachable; a daemon removes its socket
//   at shutdown only while it is still its own.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "protocol/wire.h"
#include "server/server.h"
#include "server/tiered_store.h"
#include "sparsekv/client.h"
#include "tests/support/daemon_values.h"
#include "sparsekv/host_tier.h"

namespace sparsekv::server {
namespace {

WireBlockHash H(uint64_t i) { return testing::TaggedHash(i, std::byte{0x7c}); }
std::vector<std::byte> Value(uint64_t seed, size_t n) { return testing::RandomValue(seed, n); }

std::filesystem::path ScratchDir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name();
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  // Short: a Unix socket path must fit sun_path (108 bytes).
  const auto dir = std::filesystem::temp_directory_path() /
                   ("skv_" + tag + "_" + std::to_string(getpid()) + "_" +
                    std::to_string(std::hash<std::string>{}(name) % 100000));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

bool ReadAll(int fd, void* p, size_t n) {
  auto* b = static_cast<std::byte*>(p);
  size_t got = 0;
  while (got < n) {
    const ssize_t k = recv(fd, b + got, n - got, 0);
    if (k <= 0) return false;
    got += static_cast<size_t>(k);
  }
  return true;
}

// Reads one frame; an error when the peer closed.
Result<std::pair<wire::FrameHeader, std::vector<std::byte>>> ReadFrame(int fd) {
  std::array<std::byte, wire::kHeaderBytes> hb;
  if (!ReadAll(fd, hb.data(), hb.size()))
    return Status::Unavailable("the daemon closed the connection");
  SPARSEKV_ASSIGN_OR_RETURN(auto h, wire::DecodeHeader(hb, wire::kMaxPayloadBytes));
  std::vector<std::byte> p(h.payload_bytes);
  if (!ReadAll(fd, p.data(), p.size()))
    return Status::Unavailable("the daemon closed the connection");
  return std::make_pair(h, std::move(p));
}

// A hand-made shared-memory session over the Unix socket, holding the descriptors the daemon
// passes at HELLO, as a hostile client would.
struct RawShmSession {
  int sock = -1;
  int staging_fd = -1;
  int arena_fd = -1;
  wire::HelloReply hello;

  ~RawShmSession() {
    for (int fd : {sock, staging_fd, arena_fd}) {
      if (fd >= 0) close(fd);
    }
  }

  void Open(const std::string& path, const std::string& ns, const std::string& token) {
    sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(sock, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
    ASSERT_EQ(connect(sock, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0)
        << std::strerror(errno);
    timeval tv{10, 0};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    const auto frame = wire::EncodeFrame(
        wire::Opcode::kHello, 0, 1,
        wire::Encode(wire::HelloRequest{wire::kProtocolVersion, ns, token, "raw", true}));
    ASSERT_EQ(send(sock, frame.data(), frame.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(frame.size()));
    // The descriptors ride with the reply's first bytes: receive the header with them.
    std::array<std::byte, wire::kHeaderBytes> hb;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
    iovec iov{hb.data(), hb.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t k = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    ASSERT_GT(k, 0);
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      std::vector<int> fds(n);
      std::memcpy(fds.data(), CMSG_DATA(c), n * sizeof(int));
      if (n > 0) staging_fd = fds[0];
      if (n > 1) arena_fd = fds[1];
    }
    ASSERT_TRUE(ReadAll(sock, hb.data() + k, hb.size() - static_cast<size_t>(k)));
    auto h = wire::DecodeHeader(hb, wire::kMaxPayloadBytes);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    ASSERT_EQ(h->opcode, wire::Opcode::kHello);
    std::vector<std::byte> p(h->payload_bytes);
    ASSERT_TRUE(ReadAll(sock, p.data(), p.size()));
    auto r = wire::DecodeHelloReply(p);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    hello = *r;
    ASSERT_GE(staging_fd, 0) << "no staging area passed";
    ASSERT_GT(hello.shm_staging_bytes, 0u);
  }

  // Sends a request and returns its reply (request ids count from 2).
  Result<std::pair<wire::FrameHeader, std::vector<std::byte>>> Call(
      wire::Opcode op, std::vector<std::byte> payload) {
    const auto frame = wire::EncodeFrame(op, 0, ++next_id, payload);
    if (send(sock, frame.data(), frame.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(frame.size())) {
      return Status::Unavailable("send failed");
    }
    return ReadFrame(sock);
  }
  uint64_t next_id = 1;
};

int Seals(int fd) {
  return fcntl(fd, F_GET_SEALS);
}

// A client's every way of resizing a memfd the daemon maps fails with EPERM, through the
// descriptor it was given and through a read-write reopening of it.
void ExpectCannotResize(int fd, off_t size, const char* what) {
  SCOPED_TRACE(what);
  errno = 0;
  EXPECT_EQ(ftruncate(fd, off_t{1} << 40), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(fallocate(fd, 0, 0, size + 4096), -1);
  EXPECT_EQ(errno, EPERM);
  // Shrinking last: where it succeeded, the daemon's next access past the new end would fault.
  errno = 0;
  EXPECT_EQ(ftruncate(fd, size / 2), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(ftruncate(fd, 0), -1);
  EXPECT_EQ(errno, EPERM);
  // Nor can it add a seal of its own (F_SEAL_SEAL).
  errno = 0;
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), -1);
  EXPECT_EQ(errno, EPERM);
  struct stat st {};
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(st.st_size, size);
}

// ---------------------------------------------------------------------------------------------
// Sealed shared memory, against an in-process daemon with one namespace (the host arena is lent)
// and with two (GETs are copied into the staging area).

class SealedSharedMemoryTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    dir_ = ScratchDir("shm");
    TieredStoreOptions so;
    so.offload.host.capacity_bytes = 64ull << 20;
    so.offload.host.max_record_bytes = 256 * 1024;
    so.offload.host.backing = ArenaBacking::kMemfd;
    ServerOptions opts;
    opts.tcp_listen = "127.0.0.1:0";
    opts.unix_path = (dir_ / "d.sock").string();
    opts.metrics_listen = "";
    opts.staging_bytes = 1 << 20;
    opts.namespaces = {{"alpha", "alpha-token"}};
    if (GetParam() == 2) opts.namespaces.push_back({"beta", "beta-token"});
    auto store = TieredStore::Open(so);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(store).value();
    auto srv = Server::Start(opts, store_.get());
    ASSERT_TRUE(srv.ok()) << srv.status().ToString();
    server_ = std::move(srv).value();
    unix_ = opts.unix_path;
  }
  void TearDown() override {
    server_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::unique_ptr<Client> Connect(const std::string& ns, bool unix_socket) {
    ClientOptions o;
    o.address = unix_socket ? "unix:" + unix_ : server_->tcp_address();
    o.namespace_name = ns;
    o.token = ns + "-token";
    o.shared_memory = true;
    o.timeout = std::chrono::milliseconds(10000);
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  std::filesystem::path dir_;
  std::string unix_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<Server> server_;
};

TEST_P(SealedSharedMemoryTest, ThroughTheClientLibrarySharedPutAndGetStillWork) {
  auto c = Connect("alpha", true);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->shared_memory());
  EXPECT_EQ(c->shared_arena(), GetParam() == 1);
  std::vector<std::vector<std::byte>> values;
  std::vector<BundleRef> refs;
  std::vector<WireBlockHash> hashes;
  for (uint64_t i = 0; i < 8; ++i) values.push_back(Value(i, 30000 + 1000 * i));
  for (uint64_t i = 0; i < 8; ++i) {
    refs.push_back({H(i), values[i]});
    hashes.push_back(H(i));
  }
  auto put = c->Put(refs);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  for (const Status& st : *put) EXPECT_TRUE(st.ok()) << st.ToString();
  for (int round = 0; round < 3; ++round) {
    auto got = c->Get(hashes);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    for (size_t i = 0; i < hashes.size(); ++i) {
      ASSERT_TRUE((*got)[i].status.ok()) << (*got)[i].status.ToString();
      EXPECT_EQ((*got)[i].bytes, values[i]) << i;
    }
  }
}

// Issue 14, case 1: a client shrank its staging memfd and sent SHM_PUT or SHM_GET, and the
// daemon died of SIGBUS. Now the memfd is sealed: the resize fails, the requests are served,
// and the daemon keeps serving another client. (With the seals removed, the ftruncate succeeds
// and this process, the daemon's, dies of SIGBUS at the SHM_PUT.)
TEST_P(SealedSharedMemoryTest, AClientCannotResizeSharedMemoryAndTheDaemonSurvives) {
  const std::string ns = GetParam() == 1 ? "alpha" : "beta";
  auto bystander = Connect("alpha", true);  // another engine, connected before the attack
  ASSERT_NE(bystander, nullptr);
  auto before = Value(99, 20000);
  BundleRef before_ref{H(99), before};
  ASSERT_TRUE((*bystander->Put(std::span<const BundleRef>(&before_ref, 1)))[0].ok());

  RawShmSession raw;
  ASSERT_NO_FATAL_FAILURE(raw.Open(unix_, ns, ns + "-token"));
  const uint64_t staging = raw.hello.shm_staging_bytes;
  EXPECT_EQ(staging, 1u << 20);
  // The bundles go in first, as a client's would; then the attempts to shrink the area under
  // the daemon (after which this test touches the area only once the daemon has answered).
  void* m = mmap(nullptr, staging, PROT_READ | PROT_WRITE, MAP_SHARED, raw.staging_fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  auto* area = static_cast<std::byte*>(m);
  const uint64_t half = staging / 2;
  std::vector<std::pair<uint64_t, std::vector<std::byte>>> slots = {
      {0, Value(1, 200000)}, {200000, Value(2, 200000)}, {half - 60000, Value(3, 60000)}};
  wire::ShmPutRequest put;
  for (size_t i = 0; i < slots.size(); ++i) {
    std::memcpy(area + slots[i].first, slots[i].second.data(), slots[i].second.size());
    put.slots.push_back({H(1 + i), slots[i].first, static_cast<uint32_t>(slots[i].second.size())});
  }
  const int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  EXPECT_EQ(Seals(raw.staging_fd) & kSizeSeals, kSizeSeals) << std::hex << Seals(raw.staging_fd);
  ExpectCannotResize(raw.staging_fd, static_cast<off_t>(staging), "staging area");
  const int rw_staging =
      open(("/proc/self/fd/" + std::to_string(raw.staging_fd)).c_str(), O_RDWR | O_CLOEXEC);
  if (rw_staging >= 0) {
    ExpectCannotResize(rw_staging, static_cast<off_t>(staging), "staging area reopened read-write");
    close(rw_staging);
  }
  if (GetParam() == 1) {
    ASSERT_GE(raw.arena_fd, 0) << "one namespace: the host arena is lent";
    const int want = F_SEAL_FUTURE_WRITE | kSizeSeals;
    EXPECT_EQ(Seals(raw.arena_fd) & want, want) << std::hex << Seals(raw.arena_fd);
    struct stat st {};
    ASSERT_EQ(fstat(raw.arena_fd, &st), 0);
    const int rw_arena =
        open(("/proc/self/fd/" + std::to_string(raw.arena_fd)).c_str(), O_RDWR | O_CLOEXEC);
    if (rw_arena >= 0) {
      ExpectCannotResize(rw_arena, st.st_size, "host arena reopened read-write");
      close(rw_arena);
    }
  } else {
    EXPECT_LT(raw.arena_fd, 0) << "two namespaces: no arena is passed";
  }

  // The attack's requests anyway: SHM_PUT naming the PUT area from its first byte to its last
  // (the daemon reads them), then SHM_GET (with two namespaces the daemon copies into the GET
  // area, up to its last byte).
  auto put_reply = raw.Call(wire::Opcode::kShmPut, wire::Encode(put));
  ASSERT_TRUE(put_reply.ok()) << put_reply.status().ToString();
  ASSERT_EQ(put_reply->first.opcode, wire::Opcode::kShmPut);
  auto statuses = wire::DecodeStatusListReply(put_reply->second);
  ASSERT_TRUE(statuses.ok());
  ASSERT_EQ(statuses->items.size(), slots.size());
  for (const auto& s : statuses->items) EXPECT_EQ(s.code, StatusCode::kOk) << s.message;

  wire::HashList get;
  for (size_t i = 0; i < slots.size(); ++i) get.hashes.push_back(H(1 + i));
  auto get_reply = raw.Call(wire::Opcode::kShmGet, wire::Encode(get));
  ASSERT_TRUE(get_reply.ok()) << get_reply.status().ToString();
  ASSERT_EQ(get_reply->first.opcode, wire::Opcode::kShmGet);
  auto where = wire::DecodeShmGetReply(get_reply->second);
  ASSERT_TRUE(where.ok());
  ASSERT_EQ(where->slots.size(), slots.size());
  const std::byte* arena = nullptr;
  if (raw.hello.shm_arena_bytes > 0) {
    void* a = mmap(nullptr, raw.hello.shm_arena_bytes, PROT_READ, MAP_SHARED, raw.arena_fd, 0);
    ASSERT_NE(a, MAP_FAILED);
    arena = static_cast<const std::byte*>(a);
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const wire::ShmSlot& s = where->slots[i];
    ASSERT_EQ(s.bytes, slots[i].second.size());
    const std::byte* at = s.offset >= staging ? arena + (s.offset - staging) : area + s.offset;
    ASSERT_TRUE(s.offset < staging || arena != nullptr);
    EXPECT_EQ(std::memcmp(at, slots[i].second.data(), s.bytes), 0) << i;
  }
  if (arena != nullptr) munmap(const_cast<std::byte*>(arena), raw.hello.shm_arena_bytes);
  munmap(m, staging);

  // The daemon is alive: the bystander reads what it stored before, and what the raw client
  // stored (in its own namespace); a new client connects.
  auto got = bystander->Get(std::span<const WireBlockHash>(&before_ref.hash, 1));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_TRUE((*got)[0].status.ok());
  EXPECT_EQ((*got)[0].bytes, before);
  auto fresh = Connect(ns, false);
  ASSERT_NE(fresh, nullptr);
  EXPECT_TRUE(fresh->Ping().ok());
  const WireBlockHash h1 = H(1);
  auto stored = fresh->Get(std::span<const WireBlockHash>(&h1, 1));
  ASSERT_TRUE(stored.ok());
  ASSERT_TRUE((*stored)[0].status.ok()) << (*stored)[0].status.ToString();
  EXPECT_EQ((*stored)[0].bytes, slots[0].second);
}

// The other direction: descriptors a client sends (here a memfd it has shrunk to nothing) are
// never taken in. The daemon reads without a control buffer, so the kernel drops them; this
// process is the daemon's, so its descriptor table shows whether one was kept.
TEST_P(SealedSharedMemoryTest, DescriptorsAClientSendsAreDroppedUnread) {
  const int hostile = memfd_create("sparsekv-hostile-fd", MFD_CLOEXEC);
  ASSERT_GE(hostile, 0);
  ASSERT_EQ(ftruncate(hostile, 0), 0);
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, unix_.c_str(), unix_.size() + 1);
  ASSERT_EQ(connect(sock, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  timeval tv{10, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  auto send_with_fd = [&](const std::vector<std::byte>& frame) {
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    iovec iov{const_cast<std::byte*>(frame.data()), frame.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &hostile, sizeof(int));
    return sendmsg(sock, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(frame.size());
  };
  const std::string ns = GetParam() == 1 ? "alpha" : "beta";
  ASSERT_TRUE(send_with_fd(wire::EncodeFrame(
      wire::Opcode::kHello, 0, 1,
      wire::Encode(wire::HelloRequest{wire::kProtocolVersion, ns, ns + "-token", "raw", false}))));
  auto hello = ReadFrame(sock);
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->first.opcode, wire::Opcode::kHello);
  const std::vector<std::byte> ping_payload(8, std::byte{7});
  ASSERT_TRUE(send_with_fd(wire::EncodeFrame(wire::Opcode::kPing, 0, 2, ping_payload)));
  close(hostile);
  auto pong = ReadFrame(sock);
  ASSERT_TRUE(pong.ok()) << pong.status().ToString();
  EXPECT_EQ(pong->first.opcode, wire::Opcode::kPing);
  EXPECT_EQ(pong->second, ping_payload);
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec);
    EXPECT_EQ(target.string().find("sparsekv-hostile-fd"), std::string::npos)
        << "the daemon kept a descriptor a client sent: " << e.path() << " -> " << target;
  }
  close(sock);
}

INSTANTIATE_TEST_SUITE_P(Namespaces, SealedSharedMemoryTest, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return i.param == 1 ? std::string("OneLendsTheArena")
                                               : std::string("TwoCopy");
                         });

// ---------------------------------------------------------------------------------------------
// The Unix socket path, against in-process servers.

std::unique_ptr<TieredStore> SmallStore() {
  TieredStoreOptions so;
  so.offload.host.capacity_bytes = 16ull << 20;
  auto store = TieredStore::Open(so);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return store.ok() ? std::move(store).value() : nullptr;
}

ServerOptions UnixOnly(const std::string& path) {
  ServerOptions opts;
  opts.tcp_listen = "";
  opts.metrics_listen = "";
  opts.unix_path = path;
  opts.staging_bytes = 1 << 20;
  return opts;
}

Status PingUnix(const std::string& path) {
  ClientOptions o;
  o.address = "unix:" + path;
  o.timeout = std::chrono::milliseconds(5000);
  auto c = Client::Connect(o);
  if (!c.ok()) return c.status();
  return (*c)->Ping();
}

TEST(UnixSocketPath, ALiveSocketIsNeverTakenOverAndAStaleOneIs) {
  const auto dir = ScratchDir("path");
  const std::string path = (dir / "d.sock").string();
  auto store = SmallStore();
  ASSERT_NE(store, nullptr);
  auto first = Server::Start(UnixOnly(path), store.get());
  ASSERT_TRUE(first.ok()) << first.status().ToString();

  auto store2 = SmallStore();
  auto second = Server::Start(UnixOnly(path), store2.get());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(second.status().message().find(path), std::string::npos) << second.status().ToString();
  EXPECT_NE(second.status().message().find("pid " + std::to_string(getpid())), std::string::npos)
      << second.status().ToString();
  EXPECT_TRUE(PingUnix(path).ok()) << "the first server must still answer";

  // Its shutdown removes its socket file.
  first->reset();
  EXPECT_FALSE(std::filesystem::exists(path));

  // A stale socket file (nobody accepts on it) is replaced.
  const int stale = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(bind(stale, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  close(stale);
  ASSERT_TRUE(std::filesystem::exists(path));
  auto third = Server::Start(UnixOnly(path), store2.get());
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_TRUE(PingUnix(path).ok());
  third->reset();

  // Something that is not a socket is left alone.
  std::ofstream(path) << "not a socket";
  auto fourth = Server::Start(UnixOnly(path), store2.get());
  ASSERT_FALSE(fourth.ok());
  EXPECT_NE(fourth.status().message().find("is not a socket"), std::string::npos)
      << fourth.status().ToString();
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "not a socket");
  std::filesystem::remove_all(dir);
}

TEST(UnixSocketPath, AtShutdownASocketThatIsNoLongerOursIsLeftInPlace) {
  const auto dir = ScratchDir("own");
  const std::string path = (dir / "d.sock").string();
  auto store = SmallStore();
  ASSERT_NE(store, nullptr);
  auto srv = Server::Start(UnixOnly(path), store.get());
  ASSERT_TRUE(srv.ok()) << srv.status().ToString();
  // Someone removes the path and another listener takes it (an operator, an older daemon).
  ASSERT_EQ(unlink(path.c_str()), 0);
  const int other = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(bind(other, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(listen(other, 4), 0);
  srv->reset();
  EXPECT_TRUE(std::filesystem::exists(path)) << "the other listener's socket was removed";
  const int probe = socket(AF_UNIX, SOCK_STREAM, 0);
  EXPECT_EQ(connect(probe, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0)
      << std::strerror(errno);
  close(probe);
  close(other);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Two real sparsekvd processes.

struct Daemon {
  pid_t pid = -1;
  std::filesystem::path log;
};

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A small daemon: a 64 MiB host tier, the SSD tier on (small) or off, TCP on a free port,
// no metrics.
std::filesystem::path WriteConfig(const std::filesystem::path& dir, const std::string& name,
                                  const std::filesystem::path& data_dir,
                                  const std::string& unix_socket, bool ssd) {
  const auto path = dir / (name + ".json");
  std::ofstream(path) << R"({"listen": "127.0.0.1:0", "metrics_listen": "", "busy_poll_us": 0,
    "unix_socket": ")" << unix_socket
                      << R"(", "data_dir": ")" << data_dir.string() << R"(",
    "offload": {"host": {"capacity_bytes": "64MiB"},
                "ssd": {"enabled": )"
                      << (ssd ? R"(true, "capacity_bytes": "64MiB", "slab_grow_bytes": "16MiB")"
                              : "false")
                      << "}}}";
  return path;
}

Daemon Spawn(const std::filesystem::path& config, const std::filesystem::path& log) {
  Daemon d;
  d.log = log;
  d.pid = fork();
  if (d.pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    execl(SPARSEKVD_PATH, SPARSEKVD_PATH, "--config", config.c_str(), nullptr);
    _exit(127);
  }
  return d;
}

// The daemon's exit status (as waitpid gives it), or nullopt if it still runs after `seconds`.
std::optional<int> WaitExit(pid_t pid, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  do {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < until);
  return std::nullopt;
}

Status AnswersWithin(const std::string& unix_path, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  Status st;
  do {
    st = PingUnix(unix_path);
    if (st.ok()) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < until);
  return st;
}

// Stops a daemon with SIGTERM; its exit status.
int Stop(const Daemon& d) {
  kill(d.pid, SIGTERM);
  auto st = WaitExit(d.pid, 60);
  if (!st) {
    kill(d.pid, SIGKILL);
    waitpid(d.pid, nullptr, 0);
    return -1;
  }
  return *st;
}

// Kills whatever the test left running, however it ends.
struct Reaper {
  std::vector<pid_t> pids;
  ~Reaper() {
    for (pid_t p : pids) {
      if (kill(p, 0) == 0) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
      }
    }
  }
};

// The second daemon is refused and says why; the first answers over its socket throughout,
// and after it stops (SIGTERM) its socket is gone and a new daemon starts there.
void SecondDaemonIsRefused(bool same_data_dir, bool ssd) {
  const auto dir = ScratchDir(same_data_dir ? "dd" : "sp");
  Reaper reaper;
  const std::string sock = (dir / "d.sock").string();
  const auto first_config = WriteConfig(dir, "first", dir / "a", sock, ssd);
  const auto second_config =
      same_data_dir ? first_config : WriteConfig(dir, "second", dir / "b", sock, ssd);

  Daemon first = Spawn(first_config, dir / "first.log");
  ASSERT_GT(first.pid, 0);
  reaper.pids.push_back(first.pid);
  ASSERT_TRUE(AnswersWithin(sock, 60).ok()) << ReadFile(first.log);
  // Something stored before, to read back after the second daemon's attempt.
  {
    ClientOptions o;
    o.address = "unix:" + sock;
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto v = Value(7, 10000);
    BundleRef ref{H(7), v};
    ASSERT_TRUE((*(*c)->Put(std::span<const BundleRef>(&ref, 1)))[0].ok());
  }

  const auto t0 = std::chrono::steady_clock::now();
  Daemon second = Spawn(second_config, dir / "second.log");
  ASSERT_GT(second.pid, 0);
  reaper.pids.push_back(second.pid);
  const auto status = WaitExit(second.pid, 30);
  ASSERT_TRUE(status.has_value()) << "the second daemon is still running:\n"
                                  << ReadFile(second.log);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string err = ReadFile(second.log);
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_NE(WEXITSTATUS(*status), 0) << err;
  EXPECT_LT(took, 10.0) << err;
  const std::string pid = "pid " + std::to_string(first.pid);
  EXPECT_NE(err.find(pid), std::string::npos) << err;
  if (same_data_dir) {
    EXPECT_NE(err.find((dir / "a").string()), std::string::npos) << err;
    EXPECT_NE(err.find("sparsekvd.lock"), std::string::npos) << err;
    EXPECT_EQ(err.find("RocksDB"), std::string::npos) << err;
    EXPECT_EQ(ReadFile(dir / "a" / "sparsekvd.lock"), std::to_string(first.pid) + "\n");
  } else {
    EXPECT_NE(err.find(sock), std::string::npos) << err;
  }

  // The first still answers over its socket, with what it stored.
  {
    ClientOptions o;
    o.address = "unix:" + sock;
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString() << "\n" << ReadFile(first.log);
    EXPECT_TRUE((*c)->Ping().ok());
    const WireBlockHash h = H(7);
    auto got = (*c)->Get(std::span<const WireBlockHash>(&h, 1));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_TRUE((*got)[0].status.ok()) << (*got)[0].status.ToString();
    EXPECT_EQ((*got)[0].bytes, Value(7, 10000));
  }

  const int first_exit = Stop(first);
  EXPECT_TRUE(WIFEXITED(first_exit) && WEXITSTATUS(first_exit) == 0) << ReadFile(first.log);
  EXPECT_FALSE(std::filesystem::exists(sock)) << "the first daemon left its socket behind";

  // The path (and data dir) are free again.
  Daemon next = Spawn(second_config, dir / "next.log");
  ASSERT_GT(next.pid, 0);
  reaper.pids.push_back(next.pid);
  ASSERT_TRUE(AnswersWithin(sock, 60).ok()) << ReadFile(next.log);
  const int next_exit = Stop(next);
  EXPECT_TRUE(WIFEXITED(next_exit) && WEXITSTATUS(next_exit) == 0) << ReadFile(next.log);
  std::filesystem::remove_all(dir);
}

TEST(SecondSparsekvd, OnTheSameDataDirIsRefusedWithTheFirstsPid) {
  SecondDaemonIsRefused(true, false);
}

TEST(SecondSparsekvd, OnTheSameDataDirWithTheSsdTierIsRefusedBeforeRocksDb) {
  SecondDaemonIsRefused(true, true);
}

TEST(SecondSparsekvd, OnTheSameSocketPathIsRefusedWithThePathAndPid) {
  SecondDaemonIsRefused(false, false);
}

// A daemon killed with SIGKILL leaves its socket file and lock file; neither stops the next.
TEST(SecondSparsekvd, AfterAKillTheStaleSocketAndLockDoNotStopTheNext) {
  const auto dir = ScratchDir("kill");
  Reaper reaper;
  const std::string sock = (dir / "d.sock").string();
  const auto config = WriteConfig(dir, "d", dir / "a", sock, false);
  Daemon first = Spawn(config, dir / "first.log");
  reaper.pids.push_back(first.pid);
  ASSERT_TRUE(AnswersWithin(sock, 60).ok()) << ReadFile(first.log);
  kill(first.pid, SIGKILL);
  waitpid(first.pid, nullptr, 0);
  ASSERT_TRUE(std::filesystem::exists(sock));
  Daemon next = Spawn(config, dir / "next.log");
  reaper.pids.push_back(next.pid);
  ASSERT_TRUE(AnswersWithin(sock, 60).ok()) << ReadFile(next.log);
  EXPECT_NE(ReadFile(next.log).find("removed the stale socket file"), std::string::npos)
      << ReadFile(next.log);
  EXPECT_EQ(ReadFile(dir / "a" / "sparsekvd.lock"), std::to_string(next.pid) + "\n");
  const int next_exit = Stop(next);
  EXPECT_TRUE(WIFEXITED(next_exit) && WEXITSTATUS(next_exit) == 0) << ReadFile(next.log);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sparsekv::server
