// Local reads (issue 47): a GetInto of a value lent to the client before is copied straight
// from the daemon's host arena, without a request, while the lend table shows its record
// unchanged. What must hold: the bytes are the key's newest acknowledged value or the daemon is
// asked (an overwrite, a DELETE or an eviction by anyone is seen at once, never a stale or
// reused record); the table cannot be written by a client; with write leases on (clients can
// write the arena) a record changed in place is never returned; the daemon hears of the reads.
// Against an in-process daemon whose host tier lives in a memfd (one namespace).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

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
  return testing::TaggedHash(i, std::byte{0x10});
}
std::vector<std::byte> Value(uint64_t seed, size_t n) {
  return testing::RandomValue(seed, n);
}

class LocalReadTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kArena = 16ull << 20;

  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("skv_lr_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    server_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Start(bool write_leases = false, uint64_t arena = kArena,
             EvictionPolicyKind policy = kDefaultEvictionPolicy, bool ssd = false) {
    TieredStoreOptions so;
    if (ssd) {  // below the host tier (write-back): what host memory lets go of stays readable
      so.offload.ssd_enabled = true;
      so.offload.ssd.path = (dir_ / "ssd").string();
      so.offload.ssd.capacity_bytes = 128ull << 20;
      so.offload.ssd.read_arena_bytes = 16ull << 20;
      so.offload.ssd.slab_grow_bytes = 16ull << 20;
    }
    so.offload.host.capacity_bytes = arena;
    so.offload.host.eviction = policy;
    so.offload.host.max_record_bytes = 4ull << 20;
    so.offload.host.backing = ArenaBacking::kMemfd;
    ServerOptions opts;
    opts.tcp_listen = "127.0.0.1:0";
    opts.unix_path = (dir_ / "d.sock").string();
    opts.metrics_listen = "127.0.0.1:0";
    opts.staging_bytes = 8 << 20;
    opts.max_frame_bytes = 16u << 20;
    opts.write_leases = write_leases;
    opts.namespaces = {{"alpha", "alpha-token"}};
    ASSERT_NO_FATAL_FAILURE(testing::StartInProcess(so, opts, store_, server_));
    unix_ = opts.unix_path;
  }

  std::unique_ptr<Client> Connect(bool shm, bool local_reads = true) {
    ClientOptions o;
    o.address = shm ? "unix:" + unix_ : server_->tcp_address();
    o.namespace_name = "alpha";
    o.token = "alpha-token";
    o.shared_memory = shm;
    o.local_reads = local_reads;
    o.timeout = std::chrono::milliseconds(10000);
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  double Counter(const std::string& name) { return testing::MetricValue(server_->metrics_port(), name); }

  static void PutAll(Client& c, const std::vector<WireBlockHash>& hashes, const std::vector<std::vector<std::byte>>& v) {
    std::vector<BundleRef> refs;
    for (size_t i = 0; i < hashes.size(); ++i) refs.push_back({hashes[i], v[i]});
    auto st = c.Put(refs);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    for (size_t i = 0; i < st->size(); ++i) ASSERT_TRUE((*st)[i].ok()) << i << ": " << (*st)[i].ToString();
  }

  // GetInto of `hashes` into fresh zeroed buffers of `cap` bytes each.
  static std::vector<GetIntoResult> GetInto(Client& c, const std::vector<WireBlockHash>& hashes,
                                            std::vector<std::vector<std::byte>>& bufs, size_t cap) {
    bufs.assign(hashes.size(), std::vector<std::byte>(cap));
    std::vector<std::span<std::byte>> dests;
    for (auto& b : bufs) dests.push_back(b);
    auto got = c.GetInto(hashes, dests);
    EXPECT_TRUE(got.ok()) << got.status().ToString();
    return got.ok() ? *got : std::vector<GetIntoResult>{};
  }

  std::filesystem::path dir_;
  std::string unix_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<Server> server_;
};

// The second GetInto of the same values asks nothing, and every byte is right; the daemon is
// told (sparsekv_local_reads_total, and the host tier's hits).
TEST_F(LocalReadTest, ASecondGetIntoReadsLocallyByteForByte) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto c = Connect(true);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->shared_arena());
  const std::vector<size_t> sizes = {1, 4031, 4032, 4033, 65536, 100000, (1u << 20) + 7};
  std::vector<WireBlockHash> hashes;
  std::vector<std::vector<std::byte>> values;
  for (size_t i = 0; i < sizes.size(); ++i) {
    hashes.push_back(H(i));
    values.push_back(Value(i, sizes[i]));
  }
  ASSERT_NO_FATAL_FAILURE(PutAll(*c, hashes, values));
  const uint64_t hits0 = store_->chain().tier(0).Stats().hits;
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<std::byte>> bufs;
    auto got = GetInto(*c, hashes, bufs, 2u << 20);
    ASSERT_EQ(got.size(), hashes.size());
    for (size_t i = 0; i < hashes.size(); ++i) {
      ASSERT_TRUE(got[i].status.ok()) << round << "/" << i << ": " << got[i].status.ToString();
      ASSERT_EQ(got[i].bytes, sizes[i]);
      ASSERT_EQ(std::memcmp(bufs[i].data(), values[i].data(), sizes[i]), 0) << round << "/" << i;
      ASSERT_EQ(bufs[i][sizes[i]], std::byte{0}) << "nothing past the value is written";
    }
    EXPECT_EQ(c->local_reads(), round * hashes.size()) << "round " << round;
  }
  // Two rounds of local reads reach the daemon (TOUCH, sent as they happen at most once per
  // millisecond: the first at once, the second at the next read a millisecond later).
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::vector<std::vector<std::byte>> bufs;
  GetInto(*c, {hashes[0]}, bufs, 16);
  const double want = 2.0 * static_cast<double>(hashes.size()) + 1;
  for (int i = 0; i < 200 && Counter("sparsekv_local_reads_total") < want; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Counter("sparsekv_local_reads_total"), want);
  EXPECT_GE(store_->chain().tier(0).Stats().hits, hits0 + hashes.size() * 3 + 1);

  // A destination too small is answered by the daemon (OutOfRange), untouched.
  auto small = GetInto(*c, {hashes[4]}, bufs, 100);
  ASSERT_EQ(small.size(), 1u);
  EXPECT_EQ(small[0].status.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(bufs[0], std::vector<std::byte>(100));

  // A client that does not ask for local reads always asks the daemon.
  auto plain = Connect(true, /*local_reads=*/false);
  ASSERT_NE(plain, nullptr);
  for (int round = 0; round < 2; ++round) GetInto(*plain, hashes, bufs, 2u << 20);
  EXPECT_EQ(plain->local_reads(), 0u);
}

// A batch with a value only the SSD tier holds is served by a worker; the values of it that
// host memory holds are lent all the same, so the next GetInto of those reads them locally.
TEST_F(LocalReadTest, ABatchServedByAWorkerLendsWhatHostMemoryHolds) {
  ASSERT_NO_FATAL_FAILURE(Start(false, 8ull << 20, EvictionPolicyKind::kLru, /*ssd=*/true));
  auto c = Connect(true);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->shared_arena());
  // Key 0 first, then 12 MiB more through an 8 MiB host tier (LRU): key 0 goes down to the
  // SSD tier; the last few stay in host memory.
  std::vector<WireBlockHash> hashes;
  std::vector<std::vector<std::byte>> values;
  for (size_t i = 0; i < 25; ++i) {
    hashes.push_back(H(700 + i));
    values.push_back(Value(700 + i, 500000));
  }
  for (size_t i = 0; i < hashes.size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(PutAll(*c, {hashes[i]}, {values[i]}));
  }
  const std::vector<WireBlockHash> hot = {hashes[22], hashes[23], hashes[24]};
  const uint64_t ssd_hits = store_->chain().tier(1).Stats().hits;
  std::vector<std::vector<std::byte>> bufs;
  // The SSD's value between two of host memory's: each answer must still land at its item.
  auto first = GetInto(*c, {hot[0], hashes[0], hot[1], hot[2]}, bufs, 1u << 20);
  EXPECT_EQ(store_->chain().tier(1).Stats().hits, ssd_hits + 1) << "key 0 should have come from the SSD tier";
  ASSERT_EQ(first.size(), 4u);
  const size_t of_item[] = {22, 0, 23, 24};
  for (size_t k = 0; k < 4; ++k) {
    ASSERT_TRUE(first[k].status.ok()) << k << ": " << first[k].status.ToString();
    const size_t i = of_item[k];
    ASSERT_EQ(std::memcmp(bufs[k].data(), values[i].data(), values[i].size()), 0) << "item " << k;
  }
  EXPECT_EQ(c->local_reads(), 0u);
  auto second = GetInto(*c, hot, bufs, 1u << 20);
  ASSERT_EQ(second.size(), 3u);
  for (size_t k = 0; k < 3; ++k) {
    ASSERT_TRUE(second[k].status.ok()) << k << ": " << second[k].status.ToString();
    ASSERT_EQ(std::memcmp(bufs[k].data(), values[22 + k].data(), values[22 + k].size()), 0) << k;
  }
  EXPECT_EQ(c->local_reads(), 3u) << "the worker's reply lent the three values held in host memory";
}

// Whatever another client does to a key is seen by the next local read: an overwrite gives the
// new bytes, a DELETE NotFound, and a record evicted (its room reused by other keys) is never
// read again. LRU, so that a scan of new keys evicts the ones read before (ARC would keep them).
TEST_F(LocalReadTest, OverwritesDeletesAndEvictionsAreSeenAtOnce) {
  ASSERT_NO_FATAL_FAILURE(Start(false, 8ull << 20, EvictionPolicyKind::kLru));
  auto reader = Connect(true);
  auto writer = Connect(false);
  ASSERT_NE(reader, nullptr);
  ASSERT_NE(writer, nullptr);
  const size_t n = 8, size = 65536;
  std::vector<WireBlockHash> hashes;
  std::vector<std::vector<std::byte>> v1, v2;
  for (size_t i = 0; i < n; ++i) {
    hashes.push_back(H(100 + i));
    v1.push_back(Value(1000 + i, size));
    v2.push_back(Value(2000 + i, size));
  }
  ASSERT_NO_FATAL_FAILURE(PutAll(*writer, hashes, v1));
  std::vector<std::vector<std::byte>> bufs;
  GetInto(*reader, hashes, bufs, size);
  GetInto(*reader, hashes, bufs, size);
  ASSERT_EQ(reader->local_reads(), n);

  // Overwrite by another client: the new bytes, then read locally again.
  ASSERT_NO_FATAL_FAILURE(PutAll(*writer, hashes, v2));
  for (int round = 0; round < 2; ++round) {
    auto got = GetInto(*reader, hashes, bufs, size);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(got[i].status.ok()) << got[i].status.ToString();
      ASSERT_EQ(bufs[i], v2[i]) << "round " << round << ", item " << i << ": an older version came back";
    }
  }
  EXPECT_EQ(reader->local_reads(), 2 * n);

  // DELETE by another client.
  auto del = writer->Delete(std::vector<WireBlockHash>(hashes.begin(), hashes.begin() + n / 2));
  ASSERT_TRUE(del.ok());
  auto got = GetInto(*reader, hashes, bufs, size);
  for (size_t i = 0; i < n; ++i) {
    if (i < n / 2) {
      EXPECT_EQ(got[i].status.code(), StatusCode::kNotFound) << i;
    } else {
      EXPECT_TRUE(got[i].status.ok()) << i;
      EXPECT_EQ(bufs[i], v2[i]);
    }
  }
  EXPECT_EQ(reader->local_reads(), 2 * n + n / 2);

  // Eviction: other keys fill the 8 MiB arena twice over (host tier only: evicted is gone).
  for (uint64_t k = 0; k < 2 * (8ull << 20) / size; ++k) {
    ASSERT_NO_FATAL_FAILURE(PutAll(*writer, {H(5000 + k)}, {Value(5000 + k, size)}));
  }
  got = GetInto(*reader, hashes, bufs, size);
  for (size_t i = n / 2; i < n; ++i) {
    EXPECT_EQ(got[i].status.code(), StatusCode::kNotFound) << i << ": an evicted record was read";
  }
  EXPECT_EQ(reader->local_reads(), 2 * n + n / 2);
}

// A daemon that goes away stops local reads: its arena and table stay mapped in the client and
// never change again, so the client must not go on serving from them. The first TOUCH after it
// is gone fails (at most a millisecond of calls later) and breaks the connection; every call
// after that reports the error.
TEST_F(LocalReadTest, NoLocalReadOutlivesTheDaemon) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto c = Connect(true);
  ASSERT_NE(c, nullptr);
  const std::vector<WireBlockHash> hashes = {H(700), H(701)};
  ASSERT_NO_FATAL_FAILURE(PutAll(*c, hashes, {Value(700, 65536), Value(701, 65536)}));
  std::vector<std::vector<std::byte>> bufs;
  GetInto(*c, hashes, bufs, 65536);
  GetInto(*c, hashes, bufs, 65536);
  ASSERT_EQ(c->local_reads(), 2u);
  server_.reset();  // the store (and so the arena) lives on in this process
  bool failed = false;
  int served = 0;
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::vector<std::span<std::byte>> dests;
    for (auto& b : bufs) dests.push_back(b);
    auto got = c->GetInto(hashes, dests);
    if (got.ok()) {
      ASSERT_FALSE(failed) << "a call succeeded after one had failed";
      ++served;
    } else {
      failed = true;
    }
  }
  EXPECT_TRUE(failed);
  EXPECT_LE(served, 1) << "local reads went on after the daemon was gone";
}

// Values that say what they are: key i's version v is 8-byte words (i << 32 | v), so a torn or
// misplaced read shows.
std::vector<std::byte> Stamped(uint64_t i, uint64_t v, size_t n) {
  std::vector<std::byte> out(n);
  const uint64_t w = (i << 32) | v;
  for (size_t k = 0; k + 8 <= n; k += 8) std::memcpy(out.data() + k, &w, 8);
  return out;
}

// Writers overwrite and delete a few keys as fast as they can, in an arena small enough that
// rooms are reused all the time, while a reader reads them in a loop with local reads: every
// value it gets is whole, one version of its own key; the loop reads locally most of the time.
TEST_F(LocalReadTest, ConcurrentOverwritesNeverTearALocalRead) {
  ASSERT_NO_FATAL_FAILURE(Start(false, 8ull << 20));
  const size_t n = 8, size = 256 << 10;
  std::vector<WireBlockHash> hashes;
  for (size_t i = 0; i < n; ++i) hashes.push_back(H(300 + i));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> writes{0};
  std::vector<std::thread> writers;
  for (int t = 0; t < 2; ++t) {
    writers.emplace_back([&, t] {
      auto w = Connect(t == 0);  // one over shared memory, one over TCP
      if (w == nullptr) return;
      uint64_t v = 1;
      while (!stop.load()) {
        for (size_t i = 0; i < n && !stop.load(); ++i) {
          const std::vector<std::byte> value = Stamped(i, v * 2 + t, size);
          BundleRef ref{hashes[i], value};
          (void)w->Put(std::span<const BundleRef>(&ref, 1));
          if ((v + i) % 7 == 0) (void)w->Delete(std::span<const WireBlockHash>(&hashes[i], 1));
          writes.fetch_add(1);
        }
        ++v;
      }
    });
  }
  auto reader = Connect(true);
  ASSERT_NE(reader, nullptr);
  std::vector<std::byte> buf(n * size);
  std::vector<std::span<std::byte>> dests;
  for (size_t i = 0; i < n; ++i) dests.push_back({buf.data() + i * size, size});
  uint64_t reads = 0, ok = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  // Key i's answer: NotFound, or all of one of its versions.
  auto check = [&](size_t i, const GetIntoResult& r) {
    ++reads;
    if (!r.status.ok()) {
      ASSERT_EQ(r.status.code(), StatusCode::kNotFound) << r.status.ToString();
      return;
    }
    ++ok;
    ASSERT_EQ(r.bytes, size);
    uint64_t first;
    std::memcpy(&first, dests[i].data(), 8);
    ASSERT_EQ(first >> 32, i) << "another key's bytes";
    for (size_t k = 8; k < size; k += 8) {
      uint64_t word;
      std::memcpy(&word, dests[i].data() + k, 8);
      ASSERT_EQ(word, first) << "a torn value: key " << i << " at byte " << k;
    }
  };
  // Mostly one key at a time, each four times running (the later reads mostly local); then the
  // whole batch, which a key deleted meanwhile sends to a worker that lends the others. A local
  // read that copies while a writer reuses the room is the case the table must catch.
  while (std::chrono::steady_clock::now() < until && !::testing::Test::HasFailure()) {
    for (size_t j = 0; j < 4 * n; ++j) {
      const size_t i = j / 4;
      auto got = reader->GetInto(std::span<const WireBlockHash>(&hashes[i], 1),
                                 std::span<const std::span<std::byte>>(&dests[i], 1));
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_NO_FATAL_FAILURE(check(i, (*got)[0]));
    }
    auto all = reader->GetInto(hashes, dests);
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    for (size_t i = 0; i < n; ++i) ASSERT_NO_FATAL_FAILURE(check(i, (*all)[i]));
  }
  stop.store(true);
  for (auto& t : writers) t.join();
  EXPECT_GT(writes.load(), 100u);
  EXPECT_GT(ok, 100u);
  EXPECT_GT(reader->local_reads(), 0u) << "the loop never read locally";
  std::printf("%llu reads (%llu found), %llu local, %llu writes\n", static_cast<unsigned long long>(reads),
              static_cast<unsigned long long>(ok), static_cast<unsigned long long>(reader->local_reads()),
              static_cast<unsigned long long>(writes.load()));
}

// A hand-made HELLO asking for the lend table (flag 5 or 7): the reply and the descriptors.
struct RawHello {
  int sock = -1;
  std::vector<int> fds;
  wire::HelloReply reply;
  ~RawHello() {
    for (int fd : fds) close(fd);
    if (sock >= 0) close(sock);
  }
  void Open(const std::string& path, bool leases) {
    wire::HelloRequest req{wire::kProtocolVersion, "alpha", "alpha-token", "raw", true};
    req.want_write_leases = leases;
    req.want_lend_table = true;
    ASSERT_NO_FATAL_FAILURE(testing::RawHello(path, req, &sock, &fds, &reply));
  }
};

// The lend table is passed read-only and sealed: a client can neither map it writable (not
// even through a descriptor reopened read-write) nor resize it. The reply says whether clients
// can write the arena (2 with write leases on: local reads are checked).
TEST_F(LocalReadTest, TheLendTableCannotBeWrittenByAClient) {
  ASSERT_NO_FATAL_FAILURE(Start());
  RawHello h;
  ASSERT_NO_FATAL_FAILURE(h.Open(unix_, false));
  ASSERT_EQ(h.reply.lend_table, std::optional<uint8_t>(1));
  ASSERT_EQ(h.fds.size(), 3u) << "staging, arena, table";
  const int table = h.fds[2];
  struct stat st{};
  ASSERT_EQ(fstat(table, &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_size), kArena / 4096 * 4);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, table, 0), MAP_FAILED);
  const int rw = open(("/proc/self/fd/" + std::to_string(table)).c_str(), O_RDWR | O_CLOEXEC);
  if (rw >= 0) {  // reopened read-write: the seals still refuse writes and resizing
    EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0), MAP_FAILED);
    EXPECT_NE(ftruncate(rw, 0), 0);
    const char byte = 1;
    EXPECT_NE(pwrite(rw, &byte, 1, 0), 1);
    close(rw);
  }
  void* ro = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, table, 0);
  EXPECT_NE(ro, MAP_FAILED);
  if (ro != MAP_FAILED) munmap(ro, 4096);

  server_.reset();
  store_.reset();
  ASSERT_NO_FATAL_FAILURE(Start(/*write_leases=*/true));
  RawHello l;
  ASSERT_NO_FATAL_FAILURE(l.Open(unix_, true));
  EXPECT_EQ(l.reply.lend_table, std::optional<uint8_t>(2));
  EXPECT_EQ(l.reply.write_leases, std::optional<bool>(true));
  EXPECT_EQ(l.fds.size(), 3u);
}

// With write leases on, any client of the namespace can write the arena: a record changed in
// place after the reader learned it is never returned by a local read (the reader checks the
// record's checksum, which the daemon gave it); the daemon, asked instead, finds it damaged.
TEST_F(LocalReadTest, WithWriteLeasesARecordChangedInPlaceIsNeverReturned) {
  ASSERT_NO_FATAL_FAILURE(Start(/*write_leases=*/true));
  auto reader = Connect(true);
  ASSERT_NE(reader, nullptr);
  ASSERT_TRUE(reader->write_leases());
  const size_t size = 65536;
  const std::vector<std::byte> v = Value(7, size);
  ASSERT_NO_FATAL_FAILURE(PutAll(*reader, {H(900)}, {v}));
  std::vector<std::vector<std::byte>> bufs;
  GetInto(*reader, {H(900)}, bufs, size);
  auto again = GetInto(*reader, {H(900)}, bufs, size);
  ASSERT_TRUE(again[0].status.ok());
  ASSERT_EQ(bufs[0], v);
  ASSERT_EQ(reader->local_reads(), 1u);
  // Another client with the arena mapped writable flips one byte of the value in place.
  RawHello forger;
  ASSERT_NO_FATAL_FAILURE(forger.Open(unix_, true));
  ASSERT_GE(forger.fds.size(), 2u);
  void* m = mmap(nullptr, forger.reply.shm_arena_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, forger.fds[1], 0);
  ASSERT_NE(m, MAP_FAILED) << std::strerror(errno);
  auto* arena = static_cast<std::byte*>(m);
  std::byte* at = static_cast<std::byte*>(memmem(arena, forger.reply.shm_arena_bytes, v.data(), 256));
  ASSERT_NE(at, nullptr) << "the value lies in the arena";
  at[1000] ^= std::byte{0x40};
  auto forged = GetInto(*reader, {H(900)}, bufs, size);
  EXPECT_EQ(reader->local_reads(), 1u) << "the changed record was read locally";
  EXPECT_EQ(forged[0].status.code(), StatusCode::kCorruption) << forged[0].status.ToString();
  munmap(m, forger.reply.shm_arena_bytes);
}

// TOUCH is answered with nothing when well formed (the session goes on: a PING after it is
// answered), counts only keys of the session's own namespace that the host tier holds, and a
// malformed one is a bad frame (ERROR, then the connection closes) that changes nothing.
TEST_F(LocalReadTest, TouchHasNoReplyAndAMalformedOneClosesTheConnection) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto c = Connect(true);
  ASSERT_NE(c, nullptr);
  ASSERT_NO_FATAL_FAILURE(PutAll(*c, {H(800), H(801)}, {Value(800, 4096), Value(801, 4096)}));
  const uint64_t hits0 = store_->chain().tier(0).Stats().hits;
  RawHello raw;
  ASSERT_NO_FATAL_FAILURE(raw.Open(unix_, false));
  auto send = [&](wire::Opcode op, uint64_t id, const std::vector<std::byte>& payload) {
    const auto f = wire::EncodeFrame(op, 0, id, payload);
    return ::send(raw.sock, f.data(), f.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(f.size());
  };
  // Two held keys and one never stored: two hits, and no reply to the TOUCH itself.
  ASSERT_TRUE(send(wire::Opcode::kTouch, 2, wire::Encode(wire::HashList{{H(800), H(801), H(802)}})));
  ASSERT_TRUE(send(wire::Opcode::kPing, 3, {}));
  std::array<std::byte, wire::kHeaderBytes> hb;
  ASSERT_TRUE(testing::RecvAll(raw.sock, hb.data(), hb.size()));
  auto h = wire::DecodeHeader(hb, wire::kMaxPayloadBytes);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->opcode, wire::Opcode::kPing) << "the first reply after a TOUCH is the PING's";
  EXPECT_EQ(h->request_id, 3u);
  EXPECT_EQ(store_->chain().tier(0).Stats().hits, hits0 + 2);
  EXPECT_EQ(Counter("sparsekv_local_reads_total"), 2);
  // A count past the bytes that follow.
  wire::PayloadWriter bad;
  bad.U32(1000);
  bad.Bytes(H(800));
  ASSERT_TRUE(send(wire::Opcode::kTouch, 4, bad.Take()));
  ASSERT_TRUE(testing::RecvAll(raw.sock, hb.data(), hb.size()));
  h = wire::DecodeHeader(hb, wire::kMaxPayloadBytes);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->opcode, wire::Opcode::kError);
  std::vector<std::byte> p(h->payload_bytes);
  ASSERT_TRUE(testing::RecvAll(raw.sock, p.data(), p.size()));
  char byte;
  EXPECT_EQ(recv(raw.sock, &byte, 1, 0), 0) << "the connection is closed after a bad frame";
  EXPECT_EQ(store_->chain().tier(0).Stats().hits, hits0 + 2);
  // The keys are intact for everyone else.
  std::vector<std::vector<std::byte>> bufs;
  auto got = GetInto(*c, {H(800), H(801)}, bufs, 4096);
  EXPECT_TRUE(got[0].status.ok() && got[1].status.ok());
  EXPECT_EQ(bufs[0], Value(800, 4096));
}

// A daemon from before local reads refuses HELLO's flags 5 and 7 as it did ("must be 0, 1 or
// 3"): the client says HELLO again without bit 2 and keeps what it asked for besides (write
// leases, flag 3). A daemon from before write leases too refuses 3: then flag 1.
TEST(LocalReadCompatibility, AnOlderDaemonGetsHelloAgainWithoutTheNewBit) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("skv_lr_old_" + std::to_string(getpid()) + ".sock")).string();
  for (const uint8_t newest : {uint8_t{3}, uint8_t{1}}) {  // the largest flag the old daemon takes
    std::filesystem::remove(path);
    const int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(ls, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
    ASSERT_EQ(bind(ls, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    ASSERT_EQ(listen(ls, 4), 0);
    std::vector<uint8_t> flags_seen;
    std::thread old_daemon([&] {
      for (int k = 0; k < 3; ++k) {
        const int c = accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) return;
        std::array<std::byte, wire::kHeaderBytes> hb;
        auto h = testing::RecvAll(c, hb.data(), hb.size()) ? wire::DecodeHeader(hb, wire::kMaxPayloadBytes)
                                                   : Result<wire::FrameHeader>(Status::IOError("no header"));
        std::vector<std::byte> p(h.ok() ? h->payload_bytes : 0);
        if (!h.ok() || p.empty() || !testing::RecvAll(c, p.data(), p.size())) {
          close(c);
          return;
        }
        const uint8_t flag = static_cast<uint8_t>(p.back());
        flags_seen.push_back(flag);
        std::vector<std::byte> reply;
        if (flag > newest) {
          reply = wire::EncodeFrame(
              wire::Opcode::kError, wire::kFlagResponse, h->request_id,
              wire::Encode(wire::ErrorReply{StatusCode::kInvalidArgument,
                                            newest == 3 ? "HELLO shared-memory flag must be 0, 1 or 3"
                                                        : "HELLO shared-memory flag must be 0 or 1"}));
        } else {
          wire::HelloReply r{9, 1u << 20, 64, 0, "old sparsekvd", 0};  // no shared memory granted
          if (flag & 2) r.write_leases = false;  // a daemon with leases answers the lease byte
          reply = wire::EncodeFrame(wire::Opcode::kHello, wire::kFlagResponse, h->request_id, wire::Encode(r));
        }
        (void)send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
        if (flag <= newest) {  // the session: held until the client goes
          char b;
          while (recv(c, &b, 1, 0) > 0) {
          }
          close(c);
          return;
        }
        close(c);
      }
    });
    {
      ClientOptions o;
      o.address = "unix:" + path;
      o.timeout = std::chrono::milliseconds(5000);
      auto c = Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      EXPECT_FALSE((*c)->shared_memory());
    }
    shutdown(ls, SHUT_RDWR);
    old_daemon.join();
    close(ls);
    if (newest == 3) {
      EXPECT_EQ(flags_seen, (std::vector<uint8_t>{7, 3}));
    } else {
      EXPECT_EQ(flags_seen, (std::vector<uint8_t>{7, 3, 1}));
    }
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace sparsekv::server
