// Write leases (issue 47): a shared-memory PUT written by the client straight into the host
// arena (PUT_LEASE, then PUT_COMMIT), checked by the daemon before it is stored. One copy, and
// the hostile cases: a forged or torn commit is never stored, a lease never committed is taken
// back, a lease past the namespace's quota is refused, and a client killed holding one leaks
// nothing. Against an in-process daemon whose host tier lives in a memfd (one namespace).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "allocator/xxhash_dispatch.h"
#include "protocol/wire.h"
#include "server/server.h"
#include "server/tiered_store.h"
#include "sparsekv/client.h"
#include "tests/support/daemon_values.h"
#include "tests/support/in_process_daemon.h"
#include "tests/support/metrics_scrape.h"
#include "tests/support/raw_session.h"

namespace sparsekv::server {
namespace {

WireBlockHash H(uint64_t i) {
  return testing::TaggedHash(i, std::byte{0x5e});
}
std::vector<std::byte> Value(uint64_t seed, size_t n) {
  return testing::RandomValue(seed, n);
}

// A hand-made session over the Unix socket that asks for write leases, holding the arena it is
// passed mapped writable: what a client of its own (or a hostile one) does.
struct RawLeaseSession {
  int sock = -1;
  int staging_fd = -1, arena_fd = -1;
  std::byte* arena = nullptr;
  wire::HelloReply hello;
  uint64_t next_id = 1;

  ~RawLeaseSession() {
    if (arena != nullptr) munmap(arena, hello.shm_arena_bytes);
    for (int fd : {sock, staging_fd, arena_fd}) {
      if (fd >= 0) close(fd);
    }
  }

  void Open(const std::string& path, bool want_leases = true) {
    wire::HelloRequest req{wire::kProtocolVersion, "alpha", "alpha-token", "raw-lease", true};
    req.want_write_leases = want_leases;
    std::vector<int> fds;
    ASSERT_NO_FATAL_FAILURE(testing::RawHello(path, req, &sock, &fds, &hello));
    if (fds.size() > 0) staging_fd = fds[0];
    if (fds.size() > 1) arena_fd = fds[1];
    for (size_t i = 2; i < fds.size(); ++i) close(fds[i]);
    next_id = 2;  // HELLO took 1
    ASSERT_GE(arena_fd, 0) << "one namespace and a memfd host tier: the arena is passed";
    if (hello.write_leases.value_or(false)) {
      void* m =
          mmap(nullptr, hello.shm_arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, arena_fd, 0);
      ASSERT_NE(m, MAP_FAILED) << std::strerror(errno);
      arena = static_cast<std::byte*>(m);
    }
  }

  bool Send(wire::Opcode op, const std::vector<std::byte>& payload) {
    const auto frame = wire::EncodeFrame(op, 0, next_id++, payload);
    return send(sock, frame.data(), frame.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(frame.size());
  }
  Result<std::vector<std::byte>> Call(wire::Opcode op, const std::vector<std::byte>& payload) {
    if (!Send(op, payload)) return Status::Unavailable("send failed");
    std::array<std::byte, wire::kHeaderBytes> hb;
    if (!testing::RecvAll(sock, hb.data(), hb.size())) return Status::Unavailable("no reply");
    SPARSEKV_ASSIGN_OR_RETURN(wire::FrameHeader h, wire::DecodeHeader(hb, wire::kMaxPayloadBytes));
    std::vector<std::byte> p(h.payload_bytes);
    if (!testing::RecvAll(sock, p.data(), p.size())) return Status::Unavailable("no reply payload");
    if (h.opcode == wire::Opcode::kError) return Status::Internal("ERROR frame");
    if (h.opcode != op) return Status::Internal("a reply of another opcode");
    return p;
  }

  Result<wire::ShmViewReply> Lease(const std::vector<std::pair<WireBlockHash, uint32_t>>& items) {
    wire::PutLeaseRequest req;
    for (const auto& [h, n] : items) req.items.push_back({h, n});
    SPARSEKV_ASSIGN_OR_RETURN(auto p, Call(wire::Opcode::kPutLease, wire::Encode(req)));
    return wire::DecodeShmViewReply(p);
  }
  Result<std::vector<wire::ItemStatus>> Commit(uint64_t lease, uint32_t first,
                                               std::vector<uint64_t> sums) {
    SPARSEKV_ASSIGN_OR_RETURN(
        auto p, Call(wire::Opcode::kPutCommit,
                     wire::Encode(wire::PutCommitRequest{lease, first, std::move(sums)})));
    SPARSEKV_ASSIGN_OR_RETURN(auto r, wire::DecodeStatusListReply(p));
    return r.items;
  }
  // Writes `v` into the room `slot` names; returns its record's checksum (the 48 header bytes
  // before the value, then the value).
  uint64_t Write(const wire::ShmSlot& slot, const std::vector<std::byte>& v) {
    std::memcpy(arena + slot.offset, v.data(), v.size());
    return XXH3_64bits(arena + slot.offset - 48, 48 + v.size());
  }
};

class WriteLeaseTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kArena = 32ull << 20;

  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("skv_wl_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    Start();
  }
  void TearDown() override {
    server_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  virtual void Configure(TieredStoreOptions& so, ServerOptions& opts) {}
  void Start() {
    TieredStoreOptions so;
    so.offload.host.capacity_bytes = kArena;
    so.offload.host.max_record_bytes = 8ull << 20;
    so.offload.host.backing = ArenaBacking::kMemfd;
    ServerOptions opts;
    opts.tcp_listen = "127.0.0.1:0";
    opts.unix_path = (dir_ / "d.sock").string();
    opts.metrics_listen = "127.0.0.1:0";
    opts.staging_bytes = 4 << 20;
    opts.max_frame_bytes = 16u << 20;
    opts.write_timeout_ms = 400;  // the session's tick, which takes expired leases back: 100 ms
    opts.write_leases = true;     // off by default: the arena stays read-only to clients
    opts.namespaces = {{"alpha", "alpha-token"}};
    opts.namespaces[0].max_leased_bytes = kArena;
    Configure(so, opts);
    ASSERT_NO_FATAL_FAILURE(testing::StartInProcess(so, opts, store_, server_));
    unix_ = opts.unix_path;
  }

  std::unique_ptr<Client> Connect(bool shm) {
    ClientOptions o;
    o.address = shm ? "unix:" + unix_ : server_->tcp_address();
    o.namespace_name = "alpha";
    o.token = "alpha-token";
    o.shared_memory = shm;
    o.timeout = std::chrono::milliseconds(10000);
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  double Counter(const std::string& name) { return testing::MetricValue(server_->metrics_port(), name); }

  // The value of `h` over TCP: its bytes, or the status it was answered with.
  Result<std::vector<std::byte>> Read(const WireBlockHash& h) {
    auto c = Connect(false);
    if (!c) return Status::Internal("no client");
    auto got = c->Get(std::span<const WireBlockHash>(&h, 1));
    if (!got.ok()) return got.status();
    if (!(*got)[0].status.ok()) return (*got)[0].status;
    return (*got)[0].bytes;
  }

  // True when the whole arena can be leased at once again: no room of an earlier lease is
  // still held (a reserved room is neither evictable nor reusable). In rooms of one 4 KiB unit
  // each (a 4,032-byte value and its 64-byte header), so that no fragmentation gets in the way.
  bool WholeArenaLeasable() {
    RawLeaseSession s;
    s.Open(unix_);
    std::vector<std::pair<WireBlockHash, uint32_t>> items;
    for (uint64_t i = 0; i < kArena / 4096; ++i) items.push_back({H(100000 + i), 4032});
    auto r = s.Lease(items);
    if (!r.ok()) return false;
    for (const auto& st : r->items.status) {
      if (st.code != StatusCode::kOk) return false;
    }
    return true;  // the lease ends with the session, uncommitted
  }

  std::filesystem::path dir_;
  std::string unix_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<Server> server_;
};

// One-copy PUTs read back byte for byte, over shared memory and over TCP, for sizes around the
// arena's 4 KiB units and batches that span several commits.
TEST_F(WriteLeaseTest, LeasedPutsReadBackByteForByte) {
  auto shm = Connect(true);
  auto tcp = Connect(false);
  ASSERT_NE(shm, nullptr);
  ASSERT_NE(tcp, nullptr);
  ASSERT_TRUE(shm->shared_arena());
  const std::vector<size_t> sizes = {1, 4032, 4033, 65536, 100000, (1u << 20) + 7, 6u << 20};
  for (size_t round = 0; round < 2; ++round) {  // the second round overwrites the first
    std::vector<std::vector<std::byte>> values;
    std::vector<BundleRef> refs;
    std::vector<WireBlockHash> hashes;
    for (size_t i = 0; i < sizes.size(); ++i) values.push_back(Value(round * 100 + i, sizes[i]));
    for (size_t i = 0; i < 40; ++i)
      values.push_back(Value(round * 100 + 50 + i, 65536));  // 2.5 MiB: 3 commits
    for (size_t i = 0; i < values.size(); ++i) {
      hashes.push_back(H(i));
      refs.push_back({hashes[i], values[i]});
    }
    auto put = shm->Put(refs);
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    for (size_t i = 0; i < values.size(); ++i)
      ASSERT_TRUE((*put)[i].ok()) << i << ": " << (*put)[i].ToString();
    for (Client* c : {tcp.get(), shm.get()}) {
      auto got = c->Get(hashes);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_TRUE((*got)[i].status.ok()) << i << ": " << (*got)[i].status.ToString();
        EXPECT_TRUE((*got)[i].bytes == values[i])
            << "round " << round << " value " << i << " came back wrong";
      }
    }
  }
  EXPECT_GE(Counter("sparsekv_write_lease_items_total"), 2.0 * 47)
      << "the PUTs did not go through leases";
  EXPECT_EQ(Counter("sparsekv_write_lease_torn_total"), 0);
}

// A batch larger than one lease's group (16 MiB) goes under several leases, the next asked for
// while the one before is written; every value reads back.
TEST_F(WriteLeaseTest, ABatchOfSeveralLeasesReadsBack) {
  auto shm = Connect(true);
  ASSERT_NE(shm, nullptr);
  std::vector<std::vector<std::byte>> values;
  std::vector<BundleRef> refs;
  std::vector<WireBlockHash> hashes;
  for (uint64_t i = 0; i < 5; ++i) {
    values.push_back(Value(700 + i, (5u << 20) + 4096 * i));
    hashes.push_back(H(700 + i));
  }
  for (size_t i = 0; i < values.size(); ++i) refs.push_back({hashes[i], values[i]});
  auto put = shm->Put(refs);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  for (const Status& st : *put) ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(Counter("sparsekv_write_lease_items_total"), 5);
  for (size_t i = 0; i < values.size(); ++i) {
    auto got = Read(hashes[i]);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == values[i]) << "value " << i << " came back wrong";
  }
}

// Values in pieces (Client::PutPieces) are gathered straight into their leased rooms: 12 MiB in
// one lease, so with streaming stores (StreamingCopy), pieces cut at odd offsets.
TEST_F(WriteLeaseTest, ValuesInPiecesAreGatheredIntoTheirRooms) {
  auto shm = Connect(true);
  ASSERT_NE(shm, nullptr);
  ASSERT_TRUE(shm->write_leases());
  std::vector<std::vector<std::byte>> values;
  std::vector<std::vector<std::span<const std::byte>>> pieces(6);
  std::vector<PiecesRef> refs;
  std::vector<WireBlockHash> hashes;
  for (uint64_t i = 0; i < 6; ++i) {
    values.push_back(Value(800 + i, (2u << 20) + 977 * i));
    hashes.push_back(H(800 + i));
    const size_t cut = values[i].size() / 3 + i;
    pieces[i] = {std::span<const std::byte>(values[i]).first(cut), std::span<const std::byte>(values[i]).subspan(cut)};
  }
  for (size_t i = 0; i < values.size(); ++i) refs.push_back({hashes[i], pieces[i]});
  auto put = shm->PutPieces(refs);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  for (const Status& st : *put) ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(Counter("sparsekv_write_lease_items_total"), 6);
  for (size_t i = 0; i < values.size(); ++i) {
    auto got = Read(hashes[i]);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == values[i]) << "value " << i << " came back wrong";
  }
}

// The arena passed under write leases is writable, but still sealed against resizing; a client
// that does not ask for leases (as every client before them) gets the read-only descriptor and a
// HELLO reply without the write-lease byte.
TEST_F(WriteLeaseTest, TheArenaIsWritableOnlyToLeaseSessionsAndNeverResizable) {
  RawLeaseSession lease;
  ASSERT_NO_FATAL_FAILURE(lease.Open(unix_));
  ASSERT_EQ(lease.hello.write_leases, std::optional<bool>(true));
  const int seals = fcntl(lease.arena_fd, F_GET_SEALS);
  const int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  EXPECT_EQ(seals & want, want) << std::hex << seals;
  EXPECT_EQ(ftruncate(lease.arena_fd, 0), -1);
  EXPECT_EQ(errno, EPERM);

  RawLeaseSession old;
  ASSERT_NO_FATAL_FAILURE(old.Open(unix_, /*want_leases=*/false));
  EXPECT_FALSE(old.hello.write_leases.has_value());
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, old.arena_fd, 0), MAP_FAILED);
  // Without leases, PUT_LEASE is refused per item and nothing is leased.
  auto r = old.Lease({{H(1), 1000}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->lease, 0u);
  EXPECT_EQ(r->items.status[0].code, StatusCode::kFailedPrecondition);
}

// A commit whose checksum does not match the bytes (forged), a write that stopped half-way (torn)
// and a header the client changed: none is stored, the key keeps its earlier value, and the room
// goes back.
TEST_F(WriteLeaseTest, ForgedOrTornCommitsAreNeverStored) {
  auto tcp = Connect(false);
  ASSERT_NE(tcp, nullptr);
  const std::vector<std::byte> before = Value(7, 300000);
  BundleRef ref{H(1), before};
  ASSERT_TRUE((*tcp->Put(std::span<const BundleRef>(&ref, 1)))[0].ok());

  RawLeaseSession s;
  ASSERT_NO_FATAL_FAILURE(s.Open(unix_));
  const std::vector<std::byte> v = Value(8, 300000);
  for (int how = 0; how < 3; ++how) {
    SCOPED_TRACE(how == 0 ? "forged checksum" : how == 1 ? "torn write" : "header changed");
    auto lease = s.Lease({{H(1), static_cast<uint32_t>(v.size())}});
    ASSERT_TRUE(lease.ok()) << lease.status().ToString();
    ASSERT_NE(lease->lease, 0u);
    ASSERT_EQ(lease->items.slots.size(), 1u);
    const wire::ShmSlot& slot = lease->items.slots[0];
    uint64_t sum = s.Write(slot, v);
    if (how == 0) sum ^= 1;
    if (how == 1)
      std::memset(s.arena + slot.offset + v.size() / 2, 0,
                  v.size() / 2);                                   // the second half never came
    if (how == 2) s.arena[slot.offset - 64 + 24] ^= std::byte{1};  // the key's hash in the header
    auto st = s.Commit(lease->lease, 0, {sum});
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    ASSERT_EQ(st->size(), 1u);
    EXPECT_EQ((*st)[0].code, StatusCode::kCorruption) << (*st)[0].message;
    auto got = Read(H(1));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == before) << "a bad commit changed the stored value";
    // The lease ended with its only item: committing again finds nothing.
    auto again = s.Commit(lease->lease, 0, {sum});
    ASSERT_TRUE(again.ok());
    EXPECT_EQ((*again)[0].code, StatusCode::kNotFound);
  }
  EXPECT_EQ(Counter("sparsekv_write_lease_torn_total"), 3);
  // A good commit after all that is stored.
  auto lease = s.Lease({{H(1), static_cast<uint32_t>(v.size())}});
  ASSERT_TRUE(lease.ok());
  auto st = s.Commit(lease->lease, 0, {s.Write(lease->items.slots[0], v)});
  ASSERT_TRUE(st.ok());
  EXPECT_EQ((*st)[0].code, StatusCode::kOk) << (*st)[0].message;
  auto got = Read(H(1));
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(*got == v);
  EXPECT_TRUE(WholeArenaLeasable()) << "a refused commit kept its room";
}

// A lease never committed is taken back after write_lease_timeout_ms: its room is free again,
// nothing is stored, and a late commit finds no lease.
class WriteLeaseExpiryTest : public WriteLeaseTest {
  void Configure(TieredStoreOptions&, ServerOptions& opts) override {
    opts.write_lease_timeout_ms = 300;
  }
};

TEST_F(WriteLeaseExpiryTest, ALeaseNeverCommittedExpiresAndItsRoomIsFreed) {
  RawLeaseSession s;
  ASSERT_NO_FATAL_FAILURE(s.Open(unix_));
  const std::vector<std::byte> v = Value(9, 5u << 20);
  std::vector<std::pair<WireBlockHash, uint32_t>> items;
  for (uint64_t i = 0; i < 5; ++i) items.push_back({H(100 + i), static_cast<uint32_t>(v.size())});
  auto lease = s.Lease(items);  // 25 MiB of the 32 MiB arena
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->items.slots.size(), 5u);
  const uint64_t sum = s.Write(lease->items.slots[0], v);
  EXPECT_FALSE(WholeArenaLeasable()) << "the lease's rooms are held while it lives";
  for (int i = 0; i < 100 && Counter("sparsekv_write_lease_expired_total") < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(Counter("sparsekv_write_lease_expired_total"), 1);
  auto st = s.Commit(lease->lease, 0, {sum});
  ASSERT_TRUE(st.ok());
  EXPECT_EQ((*st)[0].code, StatusCode::kNotFound);
  EXPECT_EQ(Read(H(100)).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(WholeArenaLeasable()) << "the expired lease kept its rooms";
}

// A lease past the namespace's quota is refused whole (nothing leased); the client library then
// stores the values through the staging area, and they read back.
class WriteLeaseQuotaTest : public WriteLeaseTest {
  void Configure(TieredStoreOptions&, ServerOptions& opts) override {
    opts.namespaces[0].max_leased_bytes = 1 << 20;
  }
};

TEST_F(WriteLeaseQuotaTest, ALeasePastTheNamespaceQuotaIsRefused) {
  RawLeaseSession s;
  ASSERT_NO_FATAL_FAILURE(s.Open(unix_));
  auto small = s.Lease({{H(1), 600000}});  // within the quota: held
  ASSERT_TRUE(small.ok());
  ASSERT_NE(small->lease, 0u);
  auto big = s.Lease({{H(2), 300000}, {H(3), 300000}});  // with the first, past 1 MiB
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->lease, 0u);
  for (const auto& st : big->items.status)
    EXPECT_EQ(st.code, StatusCode::kResourceExhausted) << st.message;
  EXPECT_EQ(Counter("sparsekv_write_lease_refused_total"), 1);
  // Another session of the namespace is held to the same quota while the first lease lives.
  auto shm = Connect(true);
  ASSERT_NE(shm, nullptr);
  std::vector<std::vector<std::byte>> values = {Value(2, 300000), Value(3, 300000)};
  std::vector<BundleRef> refs = {{H(2), values[0]}, {H(3), values[1]}};
  auto put = shm->Put(refs);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  EXPECT_TRUE((*put)[0].ok() && (*put)[1].ok());
  EXPECT_EQ(Counter("sparsekv_write_lease_refused_total"), 2) << "the client's lease was refused";
  EXPECT_TRUE(*Read(H(2)) == values[0]);
  EXPECT_TRUE(*Read(H(3)) == values[1]);
  // The first lease committed, the quota is free again.
  const std::vector<std::byte> v = Value(1, 600000);
  auto st = s.Commit(small->lease, 0, {s.Write(small->items.slots[0], v)});
  ASSERT_TRUE(st.ok());
  EXPECT_EQ((*st)[0].code, StatusCode::kOk);
  auto again = s.Lease({{H(4), 900000}});
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->lease, 0u);
}

// A client killed (SIGKILL) in the middle of writing a leased value leaks nothing: the room
// goes back when its connection ends, the quota with it, and nothing is stored. The child
// process only makes system calls and writes memory (no allocation after fork).
TEST_F(WriteLeaseTest, AClientKilledMidWriteLeaksNothing) {
  RawLeaseSession s;
  ASSERT_NO_FATAL_FAILURE(s.Open(unix_));
  wire::PutLeaseRequest req;
  for (uint64_t i = 0; i < 3; ++i) req.items.push_back({H(200 + i), 7u << 20});  // 21 MiB of 32
  const auto frame = wire::EncodeFrame(wire::Opcode::kPutLease, 0, 77, wire::Encode(req));
  static std::array<std::byte, 4096> reply;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (send(s.sock, frame.data(), frame.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(frame.size()))
      _exit(2);
    if (!testing::RecvAll(s.sock, reply.data(), wire::kHeaderBytes)) _exit(3);
    uint32_t payload;
    std::memcpy(&payload, reply.data() + 20, 4);
    if (payload > reply.size() - wire::kHeaderBytes ||
        !testing::RecvAll(s.sock, reply.data() + wire::kHeaderBytes, payload)) {
      _exit(4);
    }
    // u64 lease, u32 count, then the first item: u8 status 0, 16-byte hash, u64 offset, u32 bytes.
    const std::byte* p = reply.data() + wire::kHeaderBytes + 12;
    if (p[0] != std::byte{0}) _exit(5);
    uint64_t offset;
    std::memcpy(&offset, p + 17, 8);
    std::memset(s.arena + offset, 0x5a, 3u << 20);  // half of the value, then the kill
    raise(SIGKILL);
    _exit(6);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "child exited with " << WEXITSTATUS(status);
  close(s.sock);  // the parent's copy: the connection ends with the child
  s.sock = -1;
  bool freed = false;
  for (int i = 0; i < 100 && !(freed = WholeArenaLeasable()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(freed) << "the killed client's rooms were not given back";
  EXPECT_GE(Counter("sparsekv_write_lease_items_total"), 3);
  for (uint64_t i = 0; i < 3; ++i)
    EXPECT_EQ(Read(H(200 + i)).status().code(), StatusCode::kNotFound);
}

// Leased PUTs survive a restart through the SSD tier (write-back: a graceful stop writes what
// only memory holds down first), read back byte for byte.
class WriteLeaseSsdTest : public WriteLeaseTest {
  void Configure(TieredStoreOptions& so, ServerOptions&) override {
    so.offload.ssd_enabled = true;
    so.offload.ssd.path = (dir_ / "ssd").string();
    so.offload.ssd.capacity_bytes = 256ull << 20;
    so.offload.ssd.read_arena_bytes = 16ull << 20;
    so.offload.ssd.slab_grow_bytes = 16ull << 20;
  }
};

TEST_F(WriteLeaseSsdTest, LeasedPutsSurviveARestart) {
  std::vector<std::vector<std::byte>> values;
  std::vector<BundleRef> refs;
  std::vector<WireBlockHash> hashes;
  for (uint64_t i = 0; i < 48; ++i) {  // 48 MiB through a 32 MiB host tier: some go down at once
    values.push_back(Value(500 + i, (1u << 20) - 64 * i));
    hashes.push_back(H(500 + i));
  }
  for (uint64_t i = 0; i < values.size(); ++i) refs.push_back({hashes[i], values[i]});
  {
    auto shm = Connect(true);
    ASSERT_NE(shm, nullptr);
    for (size_t at = 0; at < refs.size(); at += 8) {
      auto put = shm->Put(std::span<const BundleRef>(refs).subspan(at, 8));
      ASSERT_TRUE(put.ok()) << put.status().ToString();
      for (const Status& st : *put) ASSERT_TRUE(st.ok()) << st.ToString();
    }
    EXPECT_GE(Counter("sparsekv_write_lease_items_total"), 40);
  }
  server_.reset();
  store_.reset();
  ASSERT_NO_FATAL_FAILURE(Start());
  auto c = Connect(false);
  ASSERT_NE(c, nullptr);
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto got = c->Get(std::span<const WireBlockHash>(&hashes[i], 1));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_TRUE((*got)[0].status.ok()) << i << ": " << (*got)[0].status.ToString();
    EXPECT_TRUE((*got)[0].bytes == values[i])
        << "value " << i << " came back wrong after the restart";
  }
}

// What write leases give up: every client of the namespace maps the whole arena writable, so a
// buggy or hostile one can overwrite records it never leased, headers included. The daemon must
// not trust those bytes: it keeps serving, and no read (over TCP, over shared memory, a local
// read, from the SSD tier after the scribbled records were pushed down, after a restart) ever
// answers OK with bytes other than the ones PUT. A damaged record is an error or a miss.
TEST_F(WriteLeaseSsdTest, ScribblingOverTheArenaNeverServesOtherBytes) {
  std::vector<std::vector<std::byte>> values;
  std::vector<WireBlockHash> hashes;
  for (uint64_t i = 0; i < 96; ++i) {  // 4 KiB .. ~380 KiB: about 18 MiB of the 32 MiB arena
    values.push_back(Value(900 + i, 4096 + 4000 * i));
    hashes.push_back(H(900 + i));
  }
  {
    auto tcp = Connect(false);
    ASSERT_NE(tcp, nullptr);
    std::vector<BundleRef> refs;
    for (size_t i = 0; i < values.size(); ++i) refs.push_back({hashes[i], values[i]});
    auto put = tcp->Put(std::span<const BundleRef>(refs));
    ASSERT_TRUE(put.ok()) << put.status().ToString();
    for (const Status& st : *put) ASSERT_TRUE(st.ok()) << st.ToString();
  }
  // Every value read once over shared memory first, so that the client has learned where each
  // lies (its later reads of them are local reads, checked under leases).
  auto shm = Connect(true);
  ASSERT_NE(shm, nullptr);
  auto read_all_shm = [&](const char* when) {
    size_t same = 0;
    for (size_t i = 0; i < hashes.size(); ++i) {
      std::vector<std::byte> into(values[i].size());
      std::span<std::byte> dst(into);
      auto got = shm->GetInto(std::span<const WireBlockHash>(&hashes[i], 1), std::span<const std::span<std::byte>>(&dst, 1));
      if (!got.ok()) continue;  // the connection may break on a damaged lend: not a wrong answer
      if ((*got)[0].status.ok()) {
        EXPECT_TRUE(into == values[i]) << when << ": GetInto of value " << i << " answered OK with other bytes";
        ++same;
      }
    }
    return same;
  };
  EXPECT_EQ(read_all_shm("before"), hashes.size());
  EXPECT_EQ(read_all_shm("again"), hashes.size());
  EXPECT_GT(shm->local_reads(), 0u) << "the second pass should have read locally";

  // A lease session overwrites the arena. Records start on 4 KiB units with their 64-byte
  // header: in every third unit the header goes too (key, sizes, segment counts, sequence,
  // checksum); elsewhere the first 64 bytes are left alone, so that records whose header
  // survives whole have only their checksum to give them away. Some words keep what they held.
  {
    RawLeaseSession s;
    ASSERT_NO_FATAL_FAILURE(s.Open(unix_));
    ASSERT_NE(s.arena, nullptr);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (uint64_t at = 0; at + 8 <= s.hello.shm_arena_bytes; at += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      if ((x & 7) == 0) continue;
      if (at % 4096 < 64 && (at / 4096) % 3 != 0) continue;
      const uint64_t word = (x & 0x10) ? ~uint64_t{0} : x;
      std::memcpy(s.arena + at, &word, 8);
    }
  }
  // The first half is read right away (its first half by GetInto, local reads where the
  // client can, the rest by GetViews, lent in place); the second half is first pushed down to
  // the SSD tier (or out) by new values, as scribbled, and read from there.
  const size_t half = hashes.size() / 2;
  size_t shm_same = 0;
  {
    auto views = shm->GetViews(std::span<const WireBlockHash>(hashes).subspan(half / 2, half - half / 2));
    ASSERT_TRUE(views.ok()) << views.status().ToString();
    for (size_t k = 0; k < views->size(); ++k) {
      if (!views->status(k).ok()) continue;
      const auto b = views->bytes(k);
      EXPECT_TRUE(std::equal(b.begin(), b.end(), values[half / 2 + k].begin(), values[half / 2 + k].end()))
          << "GetViews of value " << half / 2 + k << " answered OK with other bytes";
      ++shm_same;
    }
  }
  for (size_t i = 0; i < half / 2; ++i) {
    std::vector<std::byte> into(values[i].size());
    std::span<std::byte> dst(into);
    auto got = shm->GetInto(std::span<const WireBlockHash>(&hashes[i], 1), std::span<const std::span<std::byte>>(&dst, 1));
    if (got.ok() && (*got)[0].status.ok()) {
      EXPECT_TRUE(into == values[i]) << "GetInto of value " << i << " answered OK with other bytes";
      ++shm_same;
    }
  }
  // How many of values [from, to) a GET over TCP answered OK (each of them byte for byte).
  auto check_tcp = [&](const char* when, size_t from, size_t to, size_t* same_out = nullptr) {
    auto tcp = Connect(false);
    ASSERT_NE(tcp, nullptr);
    size_t same = 0;
    for (size_t i = from; i < to; ++i) {
      auto got = tcp->Get(std::span<const WireBlockHash>(&hashes[i], 1));
      ASSERT_TRUE(got.ok()) << when << ": " << got.status().ToString();
      if ((*got)[0].status.ok()) {
        EXPECT_TRUE((*got)[0].bytes == values[i]) << when << ": GET of value " << i << " answered OK with other bytes";
        ++same;
      }
    }
    if (same_out != nullptr) *same_out = same;
  };
  size_t tcp_same = 0;
  ASSERT_NO_FATAL_FAILURE(check_tcp("after the scribble", 0, half, &tcp_same));
  // Nearly every record was overwritten: the reads must have noticed, not served them as is.
  EXPECT_LT(shm_same, half / 4);
  EXPECT_LT(tcp_same, half / 4);

  // New values push the second half down to the SSD tier (write-back) or out, as scribbled.
  {
    auto tcp = Connect(false);
    ASSERT_NE(tcp, nullptr);
    for (uint64_t i = 0; i < 48; ++i) {
      const auto v = Value(2000 + i, 1u << 20);
      const WireBlockHash h = H(2000 + i);
      auto put = tcp->Put(std::span<const BundleRef>(std::vector<BundleRef>{{h, v}}));
      ASSERT_TRUE(put.ok()) << put.status().ToString();
      ASSERT_TRUE((*put)[0].ok()) << (*put)[0].ToString();
    }
  }
  size_t down_same = 0;
  ASSERT_NO_FATAL_FAILURE(check_tcp("after eviction", half, hashes.size(), &down_same));
  EXPECT_LT(down_same, half / 4);
  shm.reset();
  server_.reset();
  store_.reset();
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_NO_FATAL_FAILURE(check_tcp("after a restart", 0, hashes.size()));
  // And the daemon still stores and serves.
  auto c = Connect(true);
  ASSERT_NE(c, nullptr);
  const auto v = Value(3000, 100000);
  const WireBlockHash h = H(3000);
  auto put = c->Put(std::span<const BundleRef>(std::vector<BundleRef>{{h, v}}));
  ASSERT_TRUE(put.ok() && (*put)[0].ok());
  auto got = c->Get(std::span<const WireBlockHash>(&h, 1));
  ASSERT_TRUE(got.ok() && (*got)[0].status.ok());
  EXPECT_TRUE((*got)[0].bytes == v);
}

// A record rewritten whole after its commit, value and header checksum alike (so that it is
// consistent in itself), is never served as the key's value: the host tier compares a record
// with the checksum it stored it with. Read over TCP, over shared memory (lent and then local),
// and after eviction hands it down (the SSD tier below must not get it either).
TEST_F(WriteLeaseSsdTest, ARecordRewrittenWholeAfterItsCommitIsNeverServed) {
  RawLeaseSession s;
  ASSERT_NO_FATAL_FAILURE(s.Open(unix_));
  const std::vector<std::byte> v = Value(41, 200000), forged = Value(42, 200000);
  // Rewrites the record of `slot` with `forged`, its checksum made to match.
  auto forge = [&](const wire::ShmSlot& slot) {
    std::memcpy(s.arena + slot.offset, forged.data(), forged.size());
    const uint64_t sum = XXH3_64bits(s.arena + slot.offset - 48, 48 + forged.size());
    std::memcpy(s.arena + slot.offset - 64 + 8, &sum, 8);
  };
  // Stores key `h` as `v` under a lease; returns where its value lies.
  auto store = [&](const WireBlockHash& h) -> wire::ShmSlot {
    auto lease = s.Lease({{h, static_cast<uint32_t>(v.size())}});
    EXPECT_TRUE(lease.ok() && lease->items.slots.size() == 1u);
    if (!lease.ok() || lease->items.slots.size() != 1u) return {};
    const wire::ShmSlot slot = lease->items.slots[0];
    auto st = s.Commit(lease->lease, 0, {s.Write(slot, v)});
    EXPECT_TRUE(st.ok() && (*st)[0].code == StatusCode::kOk);
    return slot;
  };
  auto not_forged = [&](const Result<std::vector<std::byte>>& got, const char* how) {
    if (got.ok()) {
      EXPECT_TRUE(*got != forged) << how << ": the rewritten record was served";
      EXPECT_TRUE(*got == v) << how << ": other bytes";
    } else {
      EXPECT_TRUE(got.status().code() == StatusCode::kCorruption || got.status().code() == StatusCode::kNotFound)
          << how << ": " << got.status().ToString();
    }
  };

  // Over TCP.
  const wire::ShmSlot a = store(H(60));
  ASSERT_NE(a.bytes, 0u);
  ASSERT_TRUE(Read(H(60)).ok());
  forge(a);
  not_forged(Read(H(60)), "TCP");

  // Over shared memory: read once (lent, and learned for local reads), then rewritten.
  auto shm = Connect(true);
  ASSERT_NE(shm, nullptr);
  auto get_into = [&](const WireBlockHash& h) -> Result<std::vector<std::byte>> {
    std::vector<std::byte> into(v.size());
    std::span<std::byte> dst(into);
    auto got = shm->GetInto(std::span<const WireBlockHash>(&h, 1), std::span<const std::span<std::byte>>(&dst, 1));
    if (!got.ok()) return got.status();
    if (!(*got)[0].status.ok()) return (*got)[0].status;
    return into;
  };
  const wire::ShmSlot b = store(H(61));
  ASSERT_NE(b.bytes, 0u);
  auto first = get_into(H(61));
  ASSERT_TRUE(first.ok() && *first == v);
  forge(b);
  not_forged(get_into(H(61)), "shared memory");
  auto views = shm->GetViews(std::vector<WireBlockHash>{H(61)});
  ASSERT_TRUE(views.ok());
  if (views->status(0).ok()) {
    const auto bytes = views->bytes(0);
    EXPECT_FALSE(std::equal(bytes.begin(), bytes.end(), forged.begin(), forged.end())) << "GetViews served it";
  }

  // Rewritten, then evicted by new values (nothing else reads it first).
  const wire::ShmSlot c = store(H(62));
  ASSERT_NE(c.bytes, 0u);
  forge(c);
  auto tcp = Connect(false);
  ASSERT_NE(tcp, nullptr);
  for (uint64_t i = 0; i < 40; ++i) {
    const auto x = Value(4000 + i, 1u << 20);
    BundleRef ref{H(4000 + i), x};
    ASSERT_TRUE((*tcp->Put(std::span<const BundleRef>(&ref, 1)))[0].ok());
  }
  not_forged(Read(H(62)), "after eviction");
  EXPECT_GE(Counter("sparsekv_write_lease_items_total"), 3);
}

}  // namespace
}  // namespace sparsekv::server
