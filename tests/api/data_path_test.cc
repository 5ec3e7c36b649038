// The client's data path into caller memory (issue 32): GetInto over every transport, Get into
// reused buffers, zero-copy views and their pins, SHM_GET_OVERLAP's late checks, and clients
// that die holding views or in the middle of a GET, against one in-process daemon whose host
// tier lives in a memfd (so shared-memory clients get its arena).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
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
#include "sparsekv/host_tier.h"
#include "tests/support/daemon_values.h"
#include "tests/support/in_process_daemon.h"
#include "tests/support/metrics_scrape.h"

namespace sparsekv::server {
namespace {

WireBlockHash H(uint64_t i) { return testing::TaggedHash(i, std::byte{0x3c}); }
std::vector<std::byte> Value(uint64_t seed, size_t n) { return testing::RandomValue(seed, n); }
constexpr std::byte kSentinel{0xab};

enum class Transport { kTcp, kUnixSocket, kSharedMemory };
const char* Name(Transport t) {
  return t == Transport::kTcp ? "tcp" : t == Transport::kUnixSocket ? "unix socket" : "shared memory";
}

class DataPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("skv_dp_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    TieredStoreOptions so;
    so.offload.host.capacity_bytes = 64ull << 20;
    so.offload.host.max_record_bytes = 256 * 1024;
    so.offload.host.backing = ArenaBacking::kMemfd;
    ServerOptions opts;
    opts.tcp_listen = "127.0.0.1:0";
    opts.unix_path = (dir_ / "d.sock").string();
    opts.metrics_listen = "127.0.0.1:0";
    opts.staging_bytes = 1 << 20;       // GETs of more than 512 KiB take several SHM_GETs
    opts.max_frame_bytes = 1u << 20;    // and over a socket several frames, or deferrals
    opts.namespaces = {{"alpha", "alpha-token"}};
    // A peer that half-closed and stopped reading is let go after this at worst (scenario 3 of
    // AClientThatDies...).
    opts.write_timeout_ms = 2000;
    ASSERT_NO_FATAL_FAILURE(testing::StartInProcess(so, opts, store_, server_));
    unix_ = opts.unix_path;
  }
  void TearDown() override {
    server_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::unique_ptr<Client> Connect(Transport t) {
    ClientOptions o;
    o.address = t == Transport::kTcp ? server_->tcp_address() : "unix:" + unix_;
    o.namespace_name = "alpha";
    o.token = "alpha-token";
    o.shared_memory = t == Transport::kSharedMemory;
    o.timeout = std::chrono::milliseconds(10000);
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (c.ok() && t == Transport::kSharedMemory) {
      EXPECT_TRUE((*c)->shared_arena());
    }
    return c.ok() ? std::move(c).value() : nullptr;
  }

  void PutAll(Client& c, uint64_t first, const std::vector<std::vector<std::byte>>& values) {
    for (size_t i = 0; i < values.size(); ++i) {
      BundleRef ref{H(first + i), values[i]};
      auto r = c.Put(std::span<const BundleRef>(&ref, 1));
      ASSERT_TRUE(r.ok() && (*r)[0].ok()) << (r.ok() ? (*r)[0].ToString() : r.status().ToString());
    }
  }
  // `count` values of `bytes` each stored through `c` under H(first)...: the values and the keys.
  struct Stored {
    std::vector<std::vector<std::byte>> values;
    std::vector<WireBlockHash> hashes;
  };
  Stored Store(Client& c, uint64_t first, size_t count, size_t bytes) {
    Stored s;
    for (uint64_t i = 0; i < count; ++i) {
      s.values.push_back(Value(first + i, bytes));
      s.hashes.push_back(H(first + i));
    }
    PutAll(c, first, s.values);
    return s;
  }

  // A gauge's value from /metrics (-1 when absent).
  double Gauge(const std::string& name) { return testing::MetricValue(server_->metrics_port(), name); }
  // Waits up to 5 s for a gauge to reach `want`; returns its last value.
  double WaitGauge(const std::string& name, double want) {
    double v = Gauge(name);
    for (int i = 0; i < 250 && v != want; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      v = Gauge(name);
    }
    return v;
  }

  void CorruptStored(const WireBlockHash& h) {
    auto* host = dynamic_cast<HostTier*>(&store_->chain().tier(0));
    ASSERT_NE(host, nullptr);
    ASSERT_TRUE(host->CorruptForTesting(BundleKey{1, FromWire(h)}, 200).ok());
  }

  int RawUnix() {
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, unix_.c_str(), unix_.size() + 1);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
  }
  int RawTcp() {
    const std::string addr = server_->tcp_address();
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1))));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
  }
  // HELLO on a raw connection; the descriptors passed with the reply go to `fds`.
  void RawHello(int fd, bool shm, std::vector<int>* fds) {
    const auto hello = wire::EncodeFrame(
        wire::Opcode::kHello, 0, 1, wire::Encode(wire::HelloRequest{wire::kProtocolVersion, "alpha", "alpha-token", "raw", shm}));
    ASSERT_EQ(send(fd, hello.data(), hello.size(), MSG_NOSIGNAL), static_cast<ssize_t>(hello.size()));
    std::array<std::byte, wire::kHeaderBytes> hb;
    ssize_t got = wire::RecvWithFds(fd, hb.data(), hb.size(), MSG_WAITALL, fds);
    ASSERT_EQ(got, static_cast<ssize_t>(hb.size()));
    auto h = wire::DecodeHeader(hb, wire::kMaxPayloadBytes);
    ASSERT_TRUE(h.ok());
    std::vector<std::byte> payload(h->payload_bytes);
    ASSERT_EQ(recv(fd, payload.data(), payload.size(), MSG_WAITALL), static_cast<ssize_t>(payload.size()));
    ASSERT_EQ(h->opcode, wire::Opcode::kHello);
  }
  // One reply frame on a raw connection.
  std::pair<wire::FrameHeader, std::vector<std::byte>> RawReply(int fd) {
    std::array<std::byte, wire::kHeaderBytes> hb;
    EXPECT_EQ(recv(fd, hb.data(), hb.size(), MSG_WAITALL), static_cast<ssize_t>(hb.size()));
    auto h = wire::DecodeHeader(hb, wire::kMaxPayloadBytes);
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    if (!h.ok()) return {};
    std::vector<std::byte> payload(h->payload_bytes);
    EXPECT_EQ(recv(fd, payload.data(), payload.size(), MSG_WAITALL), static_cast<ssize_t>(payload.size()));
    return {*h, std::move(payload)};
  }

  std::filesystem::path dir_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<Server> server_;
  std::string unix_;
};

TEST_F(DataPathTest, GetIntoLandsInTheCallersMemoryOverEveryTransport) {
  auto writer = Connect(Transport::kTcp);
  ASSERT_NE(writer, nullptr);
  // 40 values of 1 byte to 200,000 bytes: 3.4 MB in all, several times the 512 KiB GET area and
  // the 1 MiB frame, so every path cuts the batch.
  std::vector<std::vector<std::byte>> values;
  for (uint64_t i = 0; i < 40; ++i) values.push_back(Value(100 + i, i == 0 ? 1 : 5000 * i));
  PutAll(*writer, 100, values);
  constexpr size_t kRoom = 200000;
  for (Transport t : {Transport::kTcp, Transport::kUnixSocket, Transport::kSharedMemory}) {
    SCOPED_TRACE(Name(t));
    auto c = Connect(t);
    ASSERT_NE(c, nullptr);
    // Items: the 40 values, two keys never stored, and value 30 (150,000 bytes) again into a
    // destination 1 byte short.
    std::vector<WireBlockHash> hashes;
    for (uint64_t i = 0; i < 40; ++i) hashes.push_back(H(100 + i));
    hashes.push_back(H(5000));
    hashes.push_back(H(5001));
    hashes.push_back(H(130));
    std::vector<std::byte> memory(hashes.size() * kRoom, kSentinel);
    std::vector<std::span<std::byte>> dests;
    for (size_t i = 0; i < hashes.size(); ++i) dests.push_back({memory.data() + i * kRoom, kRoom});
    dests.back() = dests.back().first(values[30].size() - 1);
    for (int round = 0; round < 2; ++round) {  // the second into memory already written
      auto got = c->GetInto(hashes, dests);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_EQ(got->size(), hashes.size());
      for (size_t i = 0; i < 40; ++i) {
        ASSERT_TRUE((*got)[i].status.ok()) << i << ": " << (*got)[i].status.ToString();
        ASSERT_EQ((*got)[i].bytes, values[i].size());
        ASSERT_EQ(std::memcmp(dests[i].data(), values[i].data(), values[i].size()), 0) << "value " << i;
        // Not a byte past the value.
        for (size_t k = values[i].size(); k < kRoom; k += 997) ASSERT_EQ(dests[i][k], kSentinel) << i;
      }
      for (size_t i : {40, 41}) {
        EXPECT_EQ((*got)[i].status.code(), StatusCode::kNotFound) << (*got)[i].status.ToString();
        EXPECT_EQ(dests[i][0], kSentinel);
      }
      EXPECT_EQ((*got)[42].status.code(), StatusCode::kOutOfRange) << (*got)[42].status.ToString();
      EXPECT_EQ((*got)[42].bytes, values[30].size());
      for (size_t k = 0; k < dests[42].size(); k += 499) ASSERT_EQ(dests[42][k], kSentinel);
    }
    // The connection still serves ordinary calls in step afterwards.
    auto again = c->Get(std::span<const WireBlockHash>(hashes.data() + 7, 1));
    ASSERT_TRUE(again.ok());
    EXPECT_EQ((*again)[0].bytes, values[7]);
    // Counts that differ are refused whole.
    EXPECT_EQ(c->GetInto(hashes, std::span<const std::span<std::byte>>(dests).first(3)).status().code(),
              StatusCode::kInvalidArgument);
  }
}

// A GetInto of more than the last-level cache holds (32 MiB or more in all) copies with
// streaming stores (StreamingCopy): 150 values of about 230 KB, 35 MB, into destinations at odd
// offsets, each a little larger than its value. Every byte lands, and not one past a value.
TEST_F(DataPathTest, ALargeGetIntoWithStreamingStoresLandsEveryByteAndNoMore) {
  auto writer = Connect(Transport::kTcp);
  ASSERT_NE(writer, nullptr);
  std::vector<std::vector<std::byte>> values;
  for (uint64_t i = 0; i < 150; ++i) values.push_back(Value(3000 + i, 230000 + 7 * i));
  PutAll(*writer, 3000, values);
  auto c = Connect(Transport::kSharedMemory);
  ASSERT_NE(c, nullptr);
  std::vector<WireBlockHash> hashes;
  std::vector<size_t> at;
  size_t total = 0;
  for (uint64_t i = 0; i < values.size(); ++i) {
    hashes.push_back(H(3000 + i));
    at.push_back(total + 1 + i % 61);  // every alignment within a cache line, more or less
    total = at.back() + values[i].size() + 13;
  }
  ASSERT_GE(total, size_t{32} << 20);
  std::vector<std::byte> memory(total, kSentinel);
  std::vector<std::span<std::byte>> dests;
  for (size_t i = 0; i < values.size(); ++i) dests.push_back({memory.data() + at[i], values[i].size() + 13});
  auto got = c->GetInto(hashes, dests);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  size_t end = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_TRUE((*got)[i].status.ok()) << i << ": " << (*got)[i].status.ToString();
    ASSERT_EQ((*got)[i].bytes, values[i].size());
    ASSERT_EQ(std::memcmp(memory.data() + at[i], values[i].data(), values[i].size()), 0) << "value " << i;
    for (size_t k = end; k < at[i]; ++k) ASSERT_EQ(memory[k], kSentinel) << "before value " << i;
    end = at[i] + values[i].size();
  }
  for (size_t k = end; k < total; ++k) ASSERT_EQ(memory[k], kSentinel) << "after the last value";
}

// A PUT batch goes in parts sent without waiting for the one before (client.cc, PutShared and
// PutSocket). With a 512 KiB PUT area and 1 MiB frames, a 6 MiB batch wraps the area a dozen
// times and spans a dozen frames: every value must land whole, none overwritten by the next
// part while the daemon still read it, and a key named twice keeps its later value.
TEST_F(DataPathTest, PipelinedPutPartsLandWholeAndAKeyNamedTwiceKeepsItsLastValue) {
  for (Transport t : {Transport::kTcp, Transport::kUnixSocket, Transport::kSharedMemory}) {
    SCOPED_TRACE(Name(t));
    auto c = Connect(t);
    ASSERT_NE(c, nullptr);
    const uint64_t first = 900000 + 1000 * static_cast<uint64_t>(t);
    for (int round = 0; round < 3; ++round) {
      std::vector<std::vector<std::byte>> values;
      std::vector<WireBlockHash> hashes;
      std::vector<BundleRef> refs;
      for (uint64_t i = 0; i < 48; ++i) {
        // Sizes from 1 KiB to 250 KiB, not multiples of 64: parts end at odd places.
        const size_t bytes = 1000 + ((i * 7919 + static_cast<uint64_t>(round) * 104729) % (250 * 1024));
        values.push_back(Value(first + i + 100 * static_cast<uint64_t>(round), bytes));
        hashes.push_back(H(first + i));
      }
      for (uint64_t i = 0; i < values.size(); ++i) refs.push_back({hashes[i], values[i]});
      auto st = c->Put(refs);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      ASSERT_EQ(st->size(), values.size());
      for (const Status& x : *st) ASSERT_TRUE(x.ok()) << x.ToString();
      auto got = c->Get(hashes);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_TRUE((*got)[i].status.ok()) << i << ": " << (*got)[i].status.ToString();
        ASSERT_TRUE((*got)[i].bytes == values[i]) << "round " << round << ", value " << i << " came back different";
      }
    }
    // The same through PutPieces: each value in 1 to 7 pieces of odd sizes, gathered as sent.
    {
      std::vector<std::vector<std::byte>> values;
      std::vector<WireBlockHash> hashes;
      std::vector<std::vector<std::span<const std::byte>>> pieces(40);
      std::vector<PiecesRef> refs;
      for (uint64_t i = 0; i < 40; ++i) {
        values.push_back(Value(first + 300 + i, 1000 + (i * 15013) % (240 * 1024)));
        hashes.push_back(H(first + 300 + i));
        const size_t cuts = 1 + i % 7;
        size_t at = 0;
        for (size_t k = 0; k < cuts; ++k) {
          const size_t len = k + 1 == cuts ? values[i].size() - at : values[i].size() / (cuts + 1) + k;
          pieces[i].push_back(std::span<const std::byte>(values[i]).subspan(at, len));
          at += len;
        }
      }
      for (uint64_t i = 0; i < 40; ++i) refs.push_back({hashes[i], pieces[i]});
      auto st = c->PutPieces(refs);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      ASSERT_EQ(st->size(), refs.size());
      for (const Status& x : *st) ASSERT_TRUE(x.ok()) << x.ToString();
      auto got = c->Get(hashes);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_TRUE((*got)[i].status.ok()) << i << ": " << (*got)[i].status.ToString();
        ASSERT_TRUE((*got)[i].bytes == values[i]) << "PutPieces: value " << i << " came back different";
      }
    }
    // One key three times among others, each time with other bytes: the last one stays.
    std::vector<std::vector<std::byte>> values;
    std::vector<BundleRef> refs;
    const WireBlockHash twice = H(first + 500);
    for (uint64_t i = 0; i < 30; ++i) values.push_back(Value(first + 600 + i, 200 * 1024 + i));
    for (uint64_t i = 0; i < values.size(); ++i) {
      refs.push_back({(i == 3 || i == 17 || i == 29) ? twice : H(first + 700 + i), values[i]});
    }
    auto st = c->Put(refs);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    for (const Status& x : *st) ASSERT_TRUE(x.ok()) << x.ToString();
    auto got = c->Get(std::vector<WireBlockHash>{twice});
    ASSERT_TRUE(got.ok() && (*got)[0].status.ok());
    EXPECT_TRUE((*got)[0].bytes == values[29]) << "a key named twice in a batch kept an earlier value";
  }
}

// Parts too large for the network thread (an SHM_PUT of more than 1 MiB, a PUT frame of more
// than 8 MiB) are stored by the daemon's workers, several at once: a batch that names one key
// in every item must still leave its last value, over shared memory and over TCP.
TEST(PipelinedPuts, AKeyNamedInEveryItemOfABatchStoredOnWorkersKeepsTheLastValue) {
  const auto dir = std::filesystem::temp_directory_path() / ("skv_dp_dup_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TieredStoreOptions so;
  so.offload.host.capacity_bytes = 512ull << 20;
  so.offload.host.max_record_bytes = 12ull << 20;
  so.offload.host.backing = ArenaBacking::kMemfd;
  ServerOptions opts;
  opts.tcp_listen = "127.0.0.1:0";
  opts.unix_path = (dir / "d.sock").string();
  opts.metrics_listen = "";
  opts.staging_bytes = 64ull << 20;
  opts.max_frame_bytes = 64u << 20;
  opts.worker_threads = 4;
  std::unique_ptr<TieredStore> store;
  std::unique_ptr<Server> server;
  ASSERT_NO_FATAL_FAILURE(testing::StartInProcess(so, opts, store, server));
  for (const bool shm : {true, false}) {
    SCOPED_TRACE(shm ? "shared memory" : "tcp");
    ClientOptions o;
    o.address = shm ? "unix:" + opts.unix_path : server->tcp_address();
    o.shared_memory = shm;
    o.timeout = std::chrono::milliseconds(20000);
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    // 1.5 MiB values go one to an SHM_PUT (a worker's); over TCP 9 MiB values, one to a frame.
    const size_t bytes = shm ? (3u << 19) : (9u << 20);
    const int items = shm ? 16 : 5;
    const WireBlockHash key = H(shm ? 77 : 78);
    // Values made once: the rounds store them again and again (a race needs many tries).
    std::vector<std::vector<std::byte>> made;
    for (int i = 0; i < items + 3; ++i) made.push_back(Value(1000 + static_cast<uint64_t>(i), bytes));
    for (int round = 0; round < (shm ? 40 : 8); ++round) {
      std::vector<std::vector<std::byte>> values;
      std::vector<BundleRef> refs;
      for (int i = 0; i < items; ++i) values.push_back(made[(i + round) % made.size()]);
      for (const auto& v : values) refs.push_back({key, v});
      auto st = (*c)->Put(refs);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      for (const Status& x : *st) ASSERT_TRUE(x.ok()) << x.ToString();
      auto got = (*c)->Get(std::vector<WireBlockHash>{key});
      ASSERT_TRUE(got.ok() && (*got)[0].status.ok());
      ASSERT_TRUE((*got)[0].bytes == values.back()) << "round " << round << ": an earlier item's value was kept";
    }
  }
  // The daemon's own order, without the client's care: two PUTs of one key sent back to back
  // over TCP, the first too large for the network thread (a worker stores it), the second
  // small (the network thread could store it at once). The second must win.
  {
    ClientOptions o;
    o.address = server->tcp_address();
    o.shared_memory = false;
    o.timeout = std::chrono::milliseconds(20000);
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    const auto big = Value(5, 9u << 20);
    for (int round = 0; round < 6; ++round) {
      const WireBlockHash key = H(90 + static_cast<uint64_t>(round));
      const auto small = Value(6 + static_cast<uint64_t>(round), 1000);
      std::atomic<int> answered{0};
      std::atomic<bool> all_ok{true};
      auto done = [&](Result<std::vector<Status>> r) {
        if (!r.ok() || !(*r)[0].ok()) all_ok = false;
        ++answered;
      };
      const BundleRef first{key, big}, second{key, small};
      (*c)->PutAsync(std::span<const BundleRef>(&first, 1), done);
      (*c)->PutAsync(std::span<const BundleRef>(&second, 1), done);
      for (int i = 0; i < 2000 && answered < 2; ++i) {
        ASSERT_TRUE((*c)->ProcessReplies().ok());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ASSERT_EQ(answered, 2);
      ASSERT_TRUE(all_ok);
      auto got = (*c)->Get(std::vector<WireBlockHash>{key});
      ASSERT_TRUE(got.ok() && (*got)[0].status.ok());
      ASSERT_TRUE((*got)[0].bytes == small) << "round " << round << ": the PUT sent first was stored last";
    }
  }
  server.reset();
  store.reset();
  std::filesystem::remove_all(dir);
}

TEST_F(DataPathTest, GetIntoFromManyThreadsOnOneClientKeepsEveryReplyWithItsCaller) {
  // Replies are read by whichever thread holds the reader role: each must land in its own
  // caller's memory.
  auto writer = Connect(Transport::kTcp);
  std::vector<std::vector<std::byte>> values;
  for (uint64_t i = 0; i < 16; ++i) values.push_back(Value(300 + i, 60000 + 1000 * i));
  PutAll(*writer, 300, values);
  for (Transport t : {Transport::kTcp, Transport::kSharedMemory}) {
    SCOPED_TRACE(Name(t));
    auto c = Connect(t);
    ASSERT_NE(c, nullptr);
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int th = 0; th < 4; ++th) {
      threads.emplace_back([&, th] {
        std::vector<std::byte> memory(4 * 80000);
        for (int round = 0; round < 25; ++round) {
          std::vector<WireBlockHash> hashes;
          std::vector<std::span<std::byte>> dests;
          for (int k = 0; k < 4; ++k) {
            hashes.push_back(H(300 + (th * 4 + k + round) % 16));
            dests.push_back({memory.data() + k * 80000, 80000});
          }
          auto got = c->GetInto(hashes, dests);
          if (!got.ok()) {
            wrong.fetch_add(1);
            continue;
          }
          for (int k = 0; k < 4; ++k) {
            const auto& v = values[(th * 4 + k + round) % 16];
            if (!(*got)[k].status.ok() || (*got)[k].bytes != v.size() ||
                std::memcmp(dests[k].data(), v.data(), v.size()) != 0) {
              wrong.fetch_add(1);
            }
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(wrong.load(), 0);
  }
}

TEST_F(DataPathTest, GetIntoReusedResultsKeepsTheirBuffers) {
  auto writer = Connect(Transport::kTcp);
  auto [values, hashes] = Store(*writer, 400, 12, 100000);
  hashes.push_back(H(6000));  // a miss
  for (Transport t : {Transport::kTcp, Transport::kSharedMemory}) {
    SCOPED_TRACE(Name(t));
    auto c = Connect(t);
    ASSERT_NE(c, nullptr);
    std::vector<GetResult> results;
    ASSERT_TRUE(c->Get(hashes, results).ok());
    ASSERT_EQ(results.size(), hashes.size());
    std::vector<const std::byte*> where;
    for (size_t i = 0; i < 12; ++i) {
      ASSERT_TRUE(results[i].status.ok()) << results[i].status.ToString();
      EXPECT_EQ(results[i].bytes, values[i]);
      where.push_back(results[i].bytes.data());
    }
    EXPECT_EQ(results[12].status.code(), StatusCode::kNotFound);
    for (int round = 0; round < 3; ++round) {
      ASSERT_TRUE(c->Get(hashes, results).ok());
      for (size_t i = 0; i < 12; ++i) {
        EXPECT_EQ(results[i].bytes, values[i]);
        EXPECT_EQ(results[i].bytes.data(), where[i]) << "item " << i << " was given a new buffer";
      }
      EXPECT_EQ(results[12].status.code(), StatusCode::kNotFound);
      EXPECT_TRUE(results[12].bytes.empty());
    }
  }
}

TEST_F(DataPathTest, DamagedBundlesAreCaughtOnEveryIntoPath) {
  // Over shared memory the bundles are lent before they are checked (SHM_GET_OVERLAP): the
  // verdicts that follow the reply must turn a damaged one into Corruption.
  uint64_t base = 700;
  for (Transport t : {Transport::kTcp, Transport::kSharedMemory}) {
    SCOPED_TRACE(Name(t));
    auto c = Connect(t);
    ASSERT_NE(c, nullptr);
    std::vector<std::vector<std::byte>> values;
    for (uint64_t i = 0; i < 3; ++i) values.push_back(Value(base + i, 90000));
    PutAll(*c, base, values);
    CorruptStored(H(base + 1));
    std::vector<WireBlockHash> hashes = {H(base), H(base + 1), H(base + 2)};
    std::vector<std::byte> memory(3 * 90000);
    std::vector<std::span<std::byte>> dests;
    for (size_t i = 0; i < 3; ++i) dests.push_back({memory.data() + i * 90000, 90000});
    auto got = c->GetInto(hashes, dests);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE((*got)[0].status.ok());
    EXPECT_EQ((*got)[1].status.code(), StatusCode::kCorruption) << (*got)[1].status.ToString();
    EXPECT_TRUE((*got)[2].status.ok());
    EXPECT_EQ(std::memcmp(dests[2].data(), values[2].data(), values[2].size()), 0);
    auto again = c->GetInto(std::span<const WireBlockHash>(&hashes[1], 1), std::span<const std::span<std::byte>>(&dests[1], 1));
    ASSERT_TRUE(again.ok());
    EXPECT_EQ((*again)[0].status.code(), StatusCode::kNotFound);
    // The value-returning Get takes the same path over shared memory.
    CorruptStored(H(base + 2));
    auto plain = c->Get(std::span<const WireBlockHash>(&hashes[2], 1));
    ASSERT_TRUE(plain.ok());
    EXPECT_EQ((*plain)[0].status.code(), StatusCode::kCorruption) << (*plain)[0].status.ToString();
    EXPECT_TRUE((*plain)[0].bytes.empty());
    base += 100;
  }
}

TEST_F(DataPathTest, ViewsAreLentInPlacePinnedAndGivenBack) {
  auto c = Connect(Transport::kSharedMemory);
  ASSERT_NE(c, nullptr);
  std::vector<std::vector<std::byte>> values;
  for (uint64_t i = 0; i < 4; ++i) values.push_back(Value(800 + i, 50000));
  PutAll(*c, 800, values);
  std::vector<WireBlockHash> hashes = {H(800), H(801), H(9999), H(802), H(803)};
  EXPECT_EQ(Gauge("sparsekv_pinned_reply_bytes"), 0);
  {
    auto views = c->GetViews(hashes);
    ASSERT_TRUE(views.ok()) << views.status().ToString();
    ASSERT_EQ(views->size(), 5u);
    EXPECT_EQ(views->status(2).code(), StatusCode::kNotFound);
    for (size_t i : {0, 1, 3, 4}) {
      ASSERT_TRUE(views->status(i).ok());
      EXPECT_TRUE(views->lent(i)) << i;
      const auto& v = values[i < 2 ? i : i - 1];
      ASSERT_EQ(views->bytes(i).size(), v.size());
      EXPECT_EQ(std::memcmp(views->bytes(i).data(), v.data(), v.size()), 0);
    }
    EXPECT_EQ(views->lent_bytes(), 4u * 50000);
    EXPECT_EQ(Gauge("sparsekv_pinned_reply_bytes"), 4 * 50000);
    // Other calls go on meanwhile, the views untouched; a second lease adds its own pins.
    auto more = c->GetViews(std::span<const WireBlockHash>(hashes.data(), 1));
    ASSERT_TRUE(more.ok());
    EXPECT_EQ(Gauge("sparsekv_pinned_reply_bytes"), 5 * 50000);
    more->Release();
    EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 4 * 50000), 4 * 50000);
    // (Read over TCP: a shared-memory Get keeps its own lend until the next one.)
    auto reader = Connect(Transport::kTcp);
    auto plain = reader->Get(std::span<const WireBlockHash>(hashes.data() + 1, 1));
    ASSERT_TRUE(plain.ok());
    EXPECT_EQ((*plain)[0].bytes, values[1]);
    // Overwritten while viewed: the view keeps the old version's bytes; a new GET sees the new.
    auto v2 = Value(8800, 50000);
    BundleRef ref{H(800), v2};
    ASSERT_TRUE(c->Put(std::span<const BundleRef>(&ref, 1)).ok());
    EXPECT_EQ(std::memcmp(views->bytes(0).data(), values[0].data(), values[0].size()), 0);
    auto fresh = reader->Get(std::span<const WireBlockHash>(hashes.data(), 1));
    ASSERT_TRUE(fresh.ok());
    EXPECT_EQ((*fresh)[0].bytes, v2);
  }  // released
  EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 0), 0);

  // A client destroyed while its views are held: the connection lives on for them, and goes
  // with the last.
  auto views = c->GetViews(hashes);
  ASSERT_TRUE(views.ok());
  c.reset();
  EXPECT_EQ(std::memcmp(views->bytes(1).data(), values[1].data(), values[1].size()), 0);
  EXPECT_GT(Gauge("sparsekv_pinned_reply_bytes"), 0);
  views->Release();
  EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 0), 0);
}

TEST_F(DataPathTest, TinyViewedValuesCountAPageEachAgainstThePinBudget) {
  // The pin budget is a quarter of the 64 MiB host tier, about 4,096 pages. Values of 10 bytes
  // lent over and over under new leases stop being lent (and are copied) once that many are
  // held, however few bytes they are.
  auto c = Connect(Transport::kSharedMemory);
  auto [values, hashes] = Store(*c, 1500, 64, 10);
  std::vector<ValueViews> held;
  uint64_t lent = 0, copied = 0;
  for (int round = 0; round < 80; ++round) {
    auto v = c->GetViews(hashes);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    for (size_t i = 0; i < v->size(); ++i) {
      ASSERT_TRUE(v->status(i).ok());
      ASSERT_TRUE(std::equal(v->bytes(i).begin(), v->bytes(i).end(), values[i].begin(), values[i].end()));
      ++(v->lent(i) ? lent : copied);
    }
    held.push_back(std::move(*v));
  }
  const uint64_t fit = static_cast<uint64_t>(Gauge("sparsekv_pinned_reply_bytes_limit")) / 4096;
  ASSERT_GT(fit, 1000u);
  ASSERT_LT(fit, 80u * 64);
  EXPECT_EQ(lent, fit);
  EXPECT_EQ(copied, 80u * 64 - fit);
  EXPECT_EQ(Gauge("sparsekv_pinned_reply_bytes"), static_cast<double>(fit) * 4096);
  held.clear();
  EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 0), 0);
}

TEST_F(DataPathTest, ViewsFallBackToCopiesWhereNothingCanBeLent) {
  // Over TCP there is no arena: every item is copied, and nothing is pinned.
  auto c = Connect(Transport::kTcp);
  std::vector<std::vector<std::byte>> values = {Value(900, 30000), Value(901, 70000)};
  PutAll(*c, 900, values);
  std::vector<WireBlockHash> hashes = {H(900), H(901), H(9998)};
  auto views = c->GetViews(hashes);
  ASSERT_TRUE(views.ok()) << views.status().ToString();
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(views->status(i).ok());
    EXPECT_FALSE(views->lent(i));
    EXPECT_TRUE(std::equal(views->bytes(i).begin(), views->bytes(i).end(), values[i].begin(), values[i].end()));
  }
  EXPECT_EQ(views->status(2).code(), StatusCode::kNotFound);
  EXPECT_EQ(Gauge("sparsekv_pinned_reply_bytes"), 0);
}

TEST_F(DataPathTest, AClientThatDiesHoldingViewsOrMidGetLeavesNothingHeld) {
  auto c = Connect(Transport::kTcp);
  const auto [values, hashes] = Store(*c, 1000, 40, 200000);
  const double staging0 = Gauge("sparsekv_shared_staging_bytes");
  ASSERT_EQ(Gauge("sparsekv_pinned_reply_bytes"), 0);

  // 1. Views taken over a raw shared-memory session, then the process's descriptors closed.
  {
    std::vector<int> fds;
    const int fd = RawUnix();
    RawHello(fd, true, &fds);
    ASSERT_EQ(fds.size(), 2u);
    EXPECT_GT(Gauge("sparsekv_shared_staging_bytes"), staging0);
    const auto view = wire::EncodeFrame(wire::Opcode::kShmView, 0, 2,
                                        wire::Encode(wire::HashList{{hashes.begin(), hashes.begin() + 8}}));
    ASSERT_EQ(send(fd, view.data(), view.size(), MSG_NOSIGNAL), static_cast<ssize_t>(view.size()));
    auto [h, payload] = RawReply(fd);
    ASSERT_EQ(h.opcode, wire::Opcode::kShmView);
    auto r = wire::DecodeShmViewReply(payload);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_NE(r->lease, 0u);
    EXPECT_EQ(r->items.slots.size(), 8u);
    EXPECT_EQ(Gauge("sparsekv_pinned_reply_bytes"), 8 * 200000);
    // An SHM_GET_OVERLAP too, whose reply and verdicts are never read.
    const auto get = wire::EncodeFrame(wire::Opcode::kShmGetOverlap, 0, 3,
                                       wire::Encode(wire::HashList{{hashes.begin() + 8, hashes.begin() + 10}}));
    ASSERT_EQ(send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
    for (int f : fds) close(f);
    close(fd);
  }
  EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 0), 0);
  EXPECT_EQ(WaitGauge("sparsekv_shared_staging_bytes", staging0), staging0);

  // 2. A GET of 8 MB over TCP, its reply read for 64 KiB, then the connection dropped.
  {
    const int fd = RawTcp();
    std::vector<int> none;
    RawHello(fd, false, &none);
    const auto get = wire::EncodeFrame(wire::Opcode::kGet, 0, 2, wire::Encode(wire::HashList{hashes}));
    ASSERT_EQ(send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
    std::vector<std::byte> some(64 * 1024);
    EXPECT_EQ(recv(fd, some.data(), some.size(), MSG_WAITALL), static_cast<ssize_t>(some.size()));
    close(fd);
  }
  EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 0), 0);
  EXPECT_EQ(WaitGauge("sparsekv_buffered_bytes", 0), 0);

  // 3. A client library GetInto cut off in the middle: its connection shut under it from
  // another thread. The call returns an error, and nothing is written to its memory afterwards.
  // (The daemon lets the connection go when the peer's reset arrives, or after the write timeout
  // when the half-closed peer left its window full.)
  {
    auto victim = Connect(Transport::kTcp);
    std::vector<std::byte> memory(40 * 200000);
    std::vector<std::span<std::byte>> dests;
    for (size_t i = 0; i < 40; ++i) dests.push_back({memory.data() + i * 200000, 200000});
    std::thread cutter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      shutdown(victim->native_handle(), SHUT_RDWR);
    });
    for (int k = 0; k < 20; ++k) {
      auto got = victim->GetInto(hashes, dests);
      if (!got.ok()) break;
    }
    cutter.join();
    EXPECT_FALSE(victim->GetInto(hashes, dests).ok());
    const std::vector<std::byte> after = memory;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_TRUE(after == memory);
  }
  EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 0), 0);
  EXPECT_EQ(WaitGauge("sparsekv_buffered_bytes", 0), 0);
  // And the daemon serves everyone as before.
  auto fresh = Connect(Transport::kSharedMemory);
  auto got = fresh->Get(std::span<const WireBlockHash>(hashes.data() + 5, 1));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)[0].bytes, values[5]);
}

TEST_F(DataPathTest, RawLeaseMisuseIsAnsweredNotObeyed) {
  // SHM_VIEW_END of a lease this session never held, a lease ended twice, a malformed one, and
  // SHM_VERDICTS sent by a client.
  auto c = Connect(Transport::kTcp);
  auto v = Value(1200, 10000);
  BundleRef ref{H(1200), v};
  ASSERT_TRUE(c->Put(std::span<const BundleRef>(&ref, 1)).ok());
  std::vector<int> fds;
  const int fd = RawUnix();
  RawHello(fd, true, &fds);
  auto send_frame = [&](wire::Opcode op, uint64_t id, const std::vector<std::byte>& payload) {
    const auto f = wire::EncodeFrame(op, 0, id, payload);
    ASSERT_EQ(send(fd, f.data(), f.size(), MSG_NOSIGNAL), static_cast<ssize_t>(f.size()));
  };
  send_frame(wire::Opcode::kShmViewEnd, 2, wire::EncodeLease(77));
  auto [h1, p1] = RawReply(fd);
  auto r1 = wire::DecodeStatusListReply(p1);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->items[0].code, StatusCode::kNotFound);
  send_frame(wire::Opcode::kShmView, 3, wire::Encode(wire::HashList{{H(1200)}}));
  auto [h2, p2] = RawReply(fd);
  auto lease = wire::DecodeShmViewReply(p2);
  ASSERT_TRUE(lease.ok());
  ASSERT_NE(lease->lease, 0u);
  for (StatusCode want : {StatusCode::kOk, StatusCode::kNotFound}) {
    send_frame(wire::Opcode::kShmViewEnd, 4, wire::EncodeLease(lease->lease));
    auto [h, p] = RawReply(fd);
    auto r = wire::DecodeStatusListReply(p);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->items[0].code, want);
  }
  EXPECT_EQ(WaitGauge("sparsekv_pinned_reply_bytes", 0), 0);
  // A lease of 3 bytes is a malformed frame: an error, then the connection closes.
  std::vector<std::byte> short_lease(3);
  send_frame(wire::Opcode::kShmViewEnd, 5, short_lease);
  auto [h3, p3] = RawReply(fd);
  EXPECT_EQ(h3.opcode, wire::Opcode::kError);
  for (int f : fds) close(f);
  close(fd);
  // SHM_VERDICTS from a client: refused the same way.
  const int fd2 = RawTcp();
  std::vector<int> none;
  RawHello(fd2, false, &none);
  const std::vector<uint8_t> zero = {0};
  const auto f = wire::EncodeFrame(wire::Opcode::kShmVerdicts, 0, 2, wire::EncodeVerdicts(zero));
  ASSERT_EQ(send(fd2, f.data(), f.size(), MSG_NOSIGNAL), static_cast<ssize_t>(f.size()));
  auto [h4, p4] = RawReply(fd2);
  EXPECT_EQ(h4.opcode, wire::Opcode::kError);
  close(fd2);
  // Nothing stored was touched.
  auto got = c->Get(std::span<const WireBlockHash>(&ref.hash, 1));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)[0].bytes, v);
}

}  // namespace
}  // namespace sparsekv::server
