// Engines that share a daemon: an OffloadedCache whose tier is sparsekvd (DaemonTier) suspends a
// sequence into it and logs its tokens there (LOG_*); a new engine (another cache, another L1)
// recovers the log from the daemon and resumes the sequence exactly, step for step with an
// uninterrupted run (the toy decoder, bench/toy_decoder.h). Another namespace finds nothing.
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "server/server.h"
#include "server/tiered_store.h"
#include "sparsekv/client.h"
#include "sparsekv/daemon_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offloaded_cache.h"
#include "toy_decoder.h"

namespace sparsekv::server {
namespace {

using bench::ToyDecoder;
constexpr uint32_t kBlockTokens = 128;

struct Engine {
  std::unique_ptr<CacheManager> manager;
  std::unique_ptr<TierChain> chain;
  std::unique_ptr<OffloadedCache> cache;
  std::unique_ptr<ToyDecoder> toy;
};

class DaemonSuspendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("sparsekv_dsusp_" + std::to_string(getpid()) + "_" +
                                                      ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    TieredStoreOptions so;
    so.offload.host.capacity_bytes = 256ull << 20;
    so.offload.host.max_record_bytes = 16ull << 20;
    store_ = TieredStore::Open(so).value();
    ServerOptions opts;
    opts.tcp_listen = "127.0.0.1:0";
    opts.unix_path = (dir_ / "d.sock").string();
    opts.metrics_listen = "127.0.0.1:0";
    opts.namespaces = {{"alpha", "a"}, {"beta", "b"}};
    opts.request_log_dir = (dir_ / "requests").string();
    server_ = Server::Start(opts, store_.get()).value();
  }
  void TearDown() override {
    server_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  ClientOptions Client(const std::string& ns) const {
    ClientOptions o;
    o.address = "unix:" + (dir_ / "d.sock").string();
    o.namespace_name = ns;
    o.token = ns == "alpha" ? "a" : "b";
    return o;
  }
  Engine Open(bool v4, const std::string& ns, WritePolicy policy = WritePolicy::kWriteThrough) {
    Engine e;
    ModelSpec spec = ModelPreset(v4 ? "deepseek-v4-flash" : "deepseek-v3.2-exp", KvPrecision::kFp8).value();
    spec.layers.resize(v4 ? 4 : 2);
    CacheManagerOptions mo;
    mo.block_tokens = kBlockTokens;
    mo.capacity_blocks = 8;
    mo.huge_pages = false;
    mo.check_invariants = true;
    e.manager = CacheManager::Create(spec, mo).value();
    DaemonTierOptions d;
    d.client = Client(ns);
    std::vector<std::unique_ptr<Tier>> tiers;
    auto tier = DaemonTier::Open(d);
    EXPECT_TRUE(tier.ok()) << tier.status().ToString();
    tiers.push_back(std::move(tier).value());
    TierChainOptions co;
    co.write_policy = WritePolicy::kWriteThrough;
    e.chain = std::make_unique<TierChain>(std::move(tiers), co);
    OffloadedCacheOptions oo;
    oo.write_policy = policy;
    e.cache = std::make_unique<OffloadedCache>(*e.manager, *e.chain, oo);
    e.toy = ToyDecoder::Create(*e.manager, 7).value();
    return e;
  }
  static Status Decode(Engine& e, SequenceId seq, uint64_t n, std::vector<TokenId>* tokens,
                       std::vector<uint64_t>* digests) {
    return e.toy->Run(
        *e.manager, seq, n, tokens, digests,
        [&](SequenceId q, std::span<const TokenId> t) { return e.cache->AppendTokens(q, t); },
        [&](SequenceId q, uint64_t k) { return e.cache->CommitComputed(q, k); });
  }

  std::filesystem::path dir_;
  std::unique_ptr<TieredStore> store_;
  std::unique_ptr<Server> server_;
};

std::span<const int32_t> Logged(std::span<const TokenId> t) {
  return {reinterpret_cast<const int32_t*>(t.data()), t.size()};
}

// Write-through: the daemon has the blocks as they fill. Write-back: they reach it when the
// request is suspended, V4's as history records (the window and state in the tail).
TEST_F(DaemonSuspendTest, AnotherEngineResumesFromTheDaemonExactly) {
  for (const bool write_back : {false, true})
  for (const bool v4 : {false, true}) {
    SCOPED_TRACE(fmt::format("{}, {}", v4 ? "V4" : "V3.2", write_back ? "write-back" : "write-through"));
    const WritePolicy policy = write_back ? WritePolicy::kWriteBack : WritePolicy::kWriteThrough;
    const uint64_t p = 2 * kBlockTokens + 3, more = 10;
    const uint64_t request = (v4 ? 2 : 1) + (write_back ? 2 : 0);
    const TokenId first = write_back ? 6 : 5;  // blocks of their own
    std::vector<uint64_t> ref;
    {
      Engine e = Open(v4, "beta");  // the uninterrupted run, in another namespace
      SequenceId seq = e.cache->CreateSequence().value();
      std::vector<TokenId> tokens{first};
      ASSERT_TRUE(e.cache->AppendTokens(seq, tokens).ok());
      ASSERT_TRUE(Decode(e, seq, p + more, &tokens, &ref).ok());
    }
    WireBlockHash tail{};
    {
      Engine e = Open(v4, "alpha", policy);
      auto log = sparsekv::Client::Connect(Client("alpha")).value();
      SequenceId seq = e.cache->CreateSequence().value();
      std::vector<TokenId> tokens{first};
      ASSERT_TRUE(e.cache->AppendTokens(seq, tokens).ok());
      std::vector<uint64_t> digests;
      ASSERT_TRUE(Decode(e, seq, p, &tokens, &digests).ok());
      ASSERT_TRUE(log->LogAppend(request, 0, Logged(tokens)).ok());
      SuspendInfo info = e.cache->Suspend(seq).value();
      EXPECT_EQ(info.tokens, p);
      // Write-through: the daemon had them as they filled.
      EXPECT_EQ(info.written_blocks, write_back ? 2u : 0u);
      EXPECT_EQ(info.history_blocks, write_back && v4 ? 2u : 0u);
      std::memcpy(tail.data(), &info.tail, 16);
      ASSERT_TRUE(log->LogSuspended(request, p, tail).ok());
    }  // the engine goes; the daemon keeps its blocks, its tail and its log

    Engine e = Open(v4, "alpha");
    auto log = sparsekv::Client::Connect(Client("alpha")).value();
    auto recovered = log->LogRecover();
    ASSERT_TRUE(recovered.ok()) << recovered.status().ToString();
    const sparsekv::Client::LoggedRequest* mine = nullptr;
    for (const auto& r : *recovered) {
      if (r.id == request) mine = &r;
    }
    ASSERT_NE(mine, nullptr);
    ASSERT_TRUE(mine->suspended);
    EXPECT_EQ(mine->state_tokens, p);
    EXPECT_EQ(mine->tail, tail);
    std::vector<TokenId> tokens(mine->tokens.begin(), mine->tokens.end());
    auto res = e.cache->Resume({}, tokens, mine->state_tokens);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
    EXPECT_TRUE(res->tail_restored);
    EXPECT_EQ(res->lower_blocks, 2u);
    std::vector<uint64_t> after;
    ASSERT_TRUE(Decode(e, res->seq, more, &tokens, &after).ok());
    EXPECT_EQ(after, std::vector<uint64_t>(ref.begin() + static_cast<long>(p), ref.end()));
    ASSERT_TRUE(e.cache->Free(res->seq).ok());
    ASSERT_TRUE(log->LogFinish(request).ok());

    // Another namespace sees neither the tail nor the log.
    Engine other = Open(v4, "beta");
    auto r2 = other.cache->Resume({}, tokens, p);
    ASSERT_TRUE(r2.ok());
    EXPECT_FALSE(r2->tail_restored);
    auto beta_log = sparsekv::Client::Connect(Client("beta")).value();
    EXPECT_TRUE(beta_log->LogRecover().value().empty());
    ASSERT_TRUE(other.cache->Free(r2->seq).ok());
  }
}

TEST_F(DaemonSuspendTest, ADamagedValueUnderATailKeyIsNotUsed) {
  Engine e = Open(false, "alpha");
  SequenceId seq = e.cache->CreateSequence().value();
  std::vector<TokenId> tokens{9};
  ASSERT_TRUE(e.cache->AppendTokens(seq, tokens).ok());
  ASSERT_TRUE(Decode(e, seq, kBlockTokens + 7, &tokens, nullptr).ok());
  SuspendInfo info = e.cache->Suspend(seq).value();
  // Another client overwrites the tail's value with bytes that are no record of it.
  auto c = sparsekv::Client::Connect(Client("alpha")).value();
  WireBlockHash key{};
  std::memcpy(key.data(), &info.tail, 16);
  std::vector<std::byte> junk(4096, std::byte{7});
  BundleRef ref{key, junk};
  ASSERT_TRUE(c->Put(std::span<const BundleRef>(&ref, 1)).ok());
  auto res = e.cache->Resume({}, tokens, info.tokens);
  ASSERT_TRUE(res.ok());
  EXPECT_FALSE(res->tail_restored);
  EXPECT_EQ(res->restored_tokens, kBlockTokens);
  EXPECT_EQ(res->recompute_tokens, 7u);
  EXPECT_GE(e.chain->tier(0).Stats().corrupt, 1u);
}

TEST(DaemonRequestLog, AServerWithoutALogDirectorySaysSo) {
  const auto dir = std::filesystem::temp_directory_path() / ("sparsekv_nolog_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto store = TieredStore::Open({}).value();
  ServerOptions opts;
  opts.tcp_listen = "127.0.0.1:0";
  opts.metrics_listen = "127.0.0.1:0";
  auto server = Server::Start(opts, store.get()).value();
  ClientOptions o;
  o.address = server->tcp_address();
  auto c = sparsekv::Client::Connect(o).value();
  const int32_t t[] = {1, 2};
  const Status st = c->LogAppend(1, 0, t);
  EXPECT_TRUE(st.Is(StatusCode::kNotSupported)) << st.ToString();
  EXPECT_TRUE(c->Ping().ok());  // the connection stays
  server.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sparsekv::server
