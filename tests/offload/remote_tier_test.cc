// The remote tier against a real Redis Cluster on loopback (3 primaries, 3 replicas, started by
// RedisClusterHarness): key slots as Redis computes them, round trips of 1 KiB to 6 MiB
// records, the version rule across 64-bit sequences, size limits, damaged values caught and
// dropped, namespaces shared by name, MOVED and ASK followed, a chain writing behind, and a
// primary killed or stalled: its keys miss within the timeout, never an error, and hit again
// once its replica has taken over.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include "bench/redis_cluster_harness.h"
#include "offload/redis_cluster.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/remote_tier.h"
#include "sparsekv/tier_chain.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using bench::RedisClusterHarness;
using bench::RedisClusterHarnessOptions;
using testing::KeyOf;
using testing::MakeBundle;
using testing::MakeBundleOfBytes;
using testing::SameBytes;
using Clock = std::chrono::steady_clock;

TEST(RedisKeySlot, Crc16AndHashTagsFollowTheSpecification) {
  EXPECT_EQ(offload::RedisCrc16("123456789"), 0x31C3);  // the specification's check value
  EXPECT_EQ(offload::RedisKeySlot("{user1000}.following"), offload::RedisKeySlot("{user1000}.followers"));
  EXPECT_EQ(offload::RedisKeySlot("{user1000}.following"), offload::RedisKeySlot("user1000"));
  EXPECT_EQ(offload::RedisKeySlot("foo{}{bar}"), offload::RedisCrc16("foo{}{bar}") % 16384);  // empty tag: whole key
  EXPECT_EQ(offload::RedisKeySlot("foo{{bar}}zap"), offload::RedisKeySlot("{bar"));
  EXPECT_EQ(offload::RedisKeySlot("foo{bar}{zap}"), offload::RedisKeySlot("bar"));
  EXPECT_EQ(offload::RedisKeySlot("foo"), 12182);  // CLUSTER KEYSLOT foo
}

// Tests of behaviour rather than timing give the nodes a second: on a loaded 2-core machine a
// node running 48 MiB of puts, or sending 48 MiB of replies, can be silent for over 50 ms.
RemoteTierOptions TierOptions(const RedisClusterHarness& h, uint32_t timeout_ms = 1000) {
  RemoteTierOptions o;
  o.nodes = h.Seeds();
  o.key_prefix = "test" + std::to_string(getpid());
  o.timeout_ms = timeout_ms;
  return o;
}

std::unique_ptr<RemoteTier> OpenTier(const RemoteTierOptions& o) {
  auto t = RemoteTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (!t.ok()) return nullptr;
  EXPECT_TRUE((*t)->WaitHealthy(std::chrono::seconds(10)));
  return std::move(*t);
}

class RemoteTierTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto h = RedisClusterHarness::Start(RedisClusterHarnessOptions{});
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    harness_ = std::move(*h);
  }
  static void TearDownTestSuite() { harness_.reset(); }
  void SetUp() override { ASSERT_NE(harness_, nullptr) << "no cluster"; }

  static std::unique_ptr<RedisClusterHarness> harness_;
};
std::unique_ptr<RedisClusterHarness> RemoteTierTest::harness_;

TEST_F(RemoteTierTest, KeySlotsAreTheClustersOwn) {
  std::mt19937_64 rng(5);
  auto tier = OpenTier(TierOptions(*harness_));
  ASSERT_NE(tier, nullptr);
  for (int i = 0; i < 200; ++i) {
    std::string key = i % 2 ? tier->RedisKey(KeyOf(rng(), static_cast<uint32_t>(rng() % 5)))
                            : "k{" + std::to_string(rng() % 1000) + "}" + std::to_string(rng());
    auto r = harness_->Command(0, {"CLUSTER", "KEYSLOT", key});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*r, ":" + std::to_string(offload::RedisKeySlot(key))) << key;
  }
}

TEST_F(RemoteTierTest, RecordsFrom1KiBTo6MiBComeBackByteForByte) {
  auto tier = OpenTier(TierOptions(*harness_));
  ASSERT_NE(tier, nullptr);
  std::vector<BundlePtr> bundles;
  const uint64_t sizes[] = {1024, 65536, 6u << 20, 3, 200000};
  for (uint64_t i = 0; i < 40; ++i) bundles.push_back(MakeBundleOfBytes(1000 + i, sizes[i % 5], 0, i + 1));
  const std::vector<Status> put = tier->Put(bundles).get();
  for (const Status& s : put) ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<BundleKey> keys;
  for (const BundlePtr& b : bundles) keys.push_back(b->key());
  keys.push_back(KeyOf(999999));  // never stored
  const auto got = tier->Get(keys).get();
  for (size_t i = 0; i < bundles.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got[i], *bundles[i])) << i;
    EXPECT_EQ((*got[i])->key(), bundles[i]->key());
  }
  EXPECT_TRUE(got.back().status().Is(StatusCode::kNotFound));
  const std::vector<bool> has = tier->Contains(keys).get();
  EXPECT_EQ(std::count(has.begin(), has.end(), true), 40);
  EXPECT_FALSE(has.back());
  const TierStats st = tier->Stats();
  EXPECT_EQ(st.puts, 40u);
  EXPECT_EQ(st.hits, 40u);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.corrupt, 0u);
  // Erase: gone, and gone for a fresh tier too (it is the cluster's state, not ours).
  const std::vector<BundleKey> first(keys.begin(), keys.begin() + 5);
  for (const Status& s : tier->Erase(first).get()) EXPECT_TRUE(s.ok()) << s.ToString();
  auto again = OpenTier(TierOptions(*harness_));
  const auto after = again->Get(first).get();
  for (const auto& r : after) EXPECT_TRUE(r.status().Is(StatusCode::kNotFound));
}

TEST_F(RemoteTierTest, ANewerVersionWinsWhicheverArrivesLast) {
  auto tier = OpenTier(TierOptions(*harness_));
  ASSERT_NE(tier, nullptr);
  const uint64_t id = 77;
  auto seq_of = [&]() {
    auto r = tier->Get({KeyOf(id)}).get();
    return r[0].ok() ? (*r[0])->sequence() : 0;
  };
  // Sequences past 2^32, as a chain's clock draws them; the low halves order the other way.
  const uint64_t older = (5ull << 32) | 0xfffffff0u, newer = (6ull << 32) | 3u, newest = (6ull << 32) | 9u;
  ASSERT_TRUE(tier->Put({MakeBundle(id, {4000}, 1, 7, newer)}).get()[0].ok());
  EXPECT_TRUE(tier->Put({MakeBundle(id, {4000}, 2, 7, older)}).get()[0].ok());  // skipped, answered OK
  EXPECT_EQ(seq_of(), newer);
  EXPECT_EQ(tier->Stats().superseded, 1u);
  ASSERT_TRUE(tier->Put({MakeBundle(id, {4000}, 3, 7, newest)}).get()[0].ok());
  EXPECT_EQ(seq_of(), newest);
  auto got = tier->Get({KeyOf(id)}).get();
  ASSERT_TRUE(got[0].ok());
  EXPECT_TRUE(SameBytes(**got[0], *MakeBundle(id, {4000}, 3, 7, newest)));
  // Erasing older copies keeps one at or above the bound and takes one below it.
  EXPECT_TRUE(tier->EraseOlder({KeyOf(id)}, {newest}).get()[0].ok());
  EXPECT_EQ(seq_of(), newest);
  EXPECT_TRUE(tier->EraseOlder({KeyOf(id)}, {newest + 1}).get()[0].ok());
  EXPECT_EQ(seq_of(), 0u);
  // Unversioned bundles replace whatever is there.
  ASSERT_TRUE(tier->Put({MakeBundle(id, {100}, 4, 7, newest)}).get()[0].ok());
  ASSERT_TRUE(tier->Put({MakeBundle(id, {100}, 5, 7, 0)}).get()[0].ok());
  EXPECT_EQ(seq_of(), 0u);
}

TEST_F(RemoteTierTest, RecordsAboveTheLimitAreRefusedAndNothingIsStored) {
  RemoteTierOptions o = TierOptions(*harness_);
  o.max_record_bytes = 64 << 10;
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const auto st = tier->Put({MakeBundleOfBytes(5, 100 << 10), MakeBundleOfBytes(6, 10 << 10)}).get();
  EXPECT_TRUE(st[0].Is(StatusCode::kInvalidArgument)) << st[0].ToString();
  EXPECT_NE(st[0].message().find("max_record_bytes"), std::string::npos);
  EXPECT_TRUE(st[1].ok());
  const auto has = tier->Contains({KeyOf(5), KeyOf(6)}).get();
  EXPECT_FALSE(has[0]);
  EXPECT_TRUE(has[1]);
  EXPECT_EQ(tier->Stats().put_failures, 1u);
}

TEST_F(RemoteTierTest, DamagedValuesAreReportedNeverReturnedAndDropped) {
  auto tier = OpenTier(TierOptions(*harness_));
  ASSERT_NE(tier, nullptr);
  auto set_raw = [&](const BundleKey& k, const std::string& value) {
    const std::string name = tier->RedisKey(k);
    auto node = harness_->NodeOfSlot(offload::RedisKeySlot(name));
    ASSERT_TRUE(node.ok()) << node.status().ToString();
    auto r = harness_->Command(*node, {"SET", name, value});
    ASSERT_TRUE(r.ok() && *r == "+OK") << (r.ok() ? *r : r.status().ToString());
  };
  const BundlePtr good = MakeBundleOfBytes(300, 8192, 0, 42);
  std::string flipped(reinterpret_cast<const char*>(good->record().data()), good->record_bytes());
  flipped[flipped.size() / 2] ^= 0x10;
  const BundlePtr other = MakeBundleOfBytes(301, 8192, 0, 42);
  const std::string misfiled(reinterpret_cast<const char*>(other->record().data()), other->record_bytes());
  set_raw(KeyOf(300), flipped);                  // one bit off
  set_raw(KeyOf(302), misfiled);                 // a good record of another block
  set_raw(KeyOf(303), "not a record at all");    // garbage
  set_raw(KeyOf(304), flipped.substr(0, 100));   // torn
  const std::vector<BundleKey> keys = {KeyOf(300), KeyOf(302), KeyOf(303), KeyOf(304)};
  const auto got = tier->Get(keys).get();
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_TRUE(got[i].status().Is(StatusCode::kCorruption)) << i << ": " << got[i].status().ToString();
    EXPECT_TRUE(got[i].status().data_loss());
  }
  EXPECT_EQ(tier->Stats().corrupt, 4u);
  const auto has = tier->Contains(keys).get();
  EXPECT_EQ(std::count(has.begin(), has.end(), true), 0) << "damaged values are dropped";
  // A good value written over a damaged one is kept.
  ASSERT_TRUE(tier->Put({good}).get()[0].ok());
  const auto back = tier->Get({KeyOf(300)}).get();
  ASSERT_TRUE(back[0].ok());
  EXPECT_TRUE(SameBytes(**back[0], *good));
}

// A record of another bundle format under this release's key (another release wrote it, or it
// sits where a rolling upgrade left it): a miss, counted, and never deleted; a put of this
// release's own copy still lands. A process of another format files its values under keys of
// their own (":v<N>:" in the key), so neither reaches the other's.
TEST_F(RemoteTierTest, RecordsOfAnotherBundleFormatAreMissesAndStayInTheCluster) {
  auto tier = OpenTier(TierOptions(*harness_));
  ASSERT_NE(tier, nullptr);
  const BundlePtr good = MakeBundleOfBytes(400, 8192, 0, 42);
  std::string other(reinterpret_cast<const char*>(good->record().data()), good->record_bytes());
  other[4] = static_cast<char>(kBundleFormatVersion + 1);  // intact, but of the next format
  const std::string name = tier->RedisKey(KeyOf(400));
  auto node = harness_->NodeOfSlot(offload::RedisKeySlot(name));
  ASSERT_TRUE(node.ok());
  ASSERT_EQ(*harness_->Command(*node, {"SET", name, other}), "+OK");
  for (int i = 0; i < 3; ++i) {
    const auto got = tier->Get({KeyOf(400)}).get();
    EXPECT_TRUE(got[0].status().Is(StatusCode::kNotFound)) << got[0].status().ToString();
  }
  EXPECT_EQ(tier->Stats().other_version, 3u);
  EXPECT_EQ(tier->Stats().corrupt, 0u);
  EXPECT_EQ(*harness_->Command(*node, {"EXISTS", name}), ":1") << "the other format's record was deleted";
  EXPECT_EQ(*harness_->Command(*node, {"STRLEN", name}), ":" + std::to_string(other.size()));
  // The next format's process files the same block elsewhere.
  {
    const uint16_t was = SetBundleFormatVersionForTesting(kBundleFormatVersion + 1);
    const std::string theirs = tier->RedisKey(KeyOf(400));
    SetBundleFormatVersionForTesting(was);
    EXPECT_NE(theirs, name);
    EXPECT_NE(theirs.find(":v" + std::to_string(kBundleFormatVersion + 1) + ":"), std::string::npos) << theirs;
  }
  EXPECT_EQ(name.find(":v"), std::string::npos) << "format 3 keeps the key it always had: " << name;
}

TEST_F(RemoteTierTest, NamespacesAreSharedByNameAndKeptApart) {
  RemoteTierOptions a = TierOptions(*harness_), b = TierOptions(*harness_);
  a.namespace_labels = {"alpha", "beta", "we{ird}:name"};
  b.namespace_labels = {"beta", "alpha"};
  auto ta = OpenTier(a), tb = OpenTier(b);
  ASSERT_NE(ta, nullptr);
  ASSERT_NE(tb, nullptr);
  const BundlePtr in_alpha = MakeBundle(400, {5000, 300}, 1, /*ns=*/1, 10);
  ASSERT_TRUE(ta->Put({in_alpha}).get()[0].ok());
  // B numbers "alpha" 2: it finds the block, re-stamped as its own, every byte of the payload.
  const auto got = tb->Get({KeyOf(400, 2), KeyOf(400, 1)}).get();
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_EQ((*got[0])->key(), KeyOf(400, 2));
  EXPECT_EQ((*got[0])->sequence(), 10u);
  ASSERT_EQ((*got[0])->segment_count(), 2u);
  EXPECT_TRUE(std::equal(in_alpha->payload().begin(), in_alpha->payload().end(), (*got[0])->payload().begin()));
  EXPECT_TRUE(Bundle::VerifyRecord((*got[0])->record(), KeyOf(400, 2)).ok());
  // B's namespace 1 is "beta": nothing there.
  EXPECT_TRUE(got[1].status().Is(StatusCode::kNotFound));
  // A name that could make a hash tag or shift the key's parts is written in hex.
  const std::string weird = ta->RedisKey(KeyOf(1, 3));
  EXPECT_EQ(weird.find('{'), std::string::npos) << weird;
  EXPECT_NE(offload::RedisKeySlot(weird), offload::RedisKeySlot(ta->RedisKey(KeyOf(2, 3))));
}

TEST_F(RemoteTierTest, MovedAndAskRedirectsAreFollowed) {
  auto tier = OpenTier(TierOptions(*harness_));
  ASSERT_NE(tier, nullptr);
  const BundlePtr b1 = MakeBundleOfBytes(500, 20000, 0, 1), b2 = MakeBundleOfBytes(501, 20000, 0, 1);
  ASSERT_TRUE(tier->Put({b1, b2}).get()[0].ok());
  const uint32_t s1 = offload::RedisKeySlot(tier->RedisKey(b1->key()));
  const uint32_t s2 = offload::RedisKeySlot(tier->RedisKey(b2->key()));
  ASSERT_NE(s1, s2);
  auto other_primary = [&](uint32_t slot) {
    const size_t from = harness_->NodeOfSlot(slot).value();
    for (size_t i = 0; i < harness_->nodes().size(); ++i) {
      if (harness_->nodes()[i].primary && i != from) return i;
    }
    return from;
  };
  // A slot moved whole: the tier's map is stale, the node answers MOVED. (A refresh the tier
  // had asked for earlier, at most 20 ms later, may land between the move and the GET and read
  // the new owner first: then the slot moves again, up to 5 times, until a GET meets a MOVED.)
  bool redirected = false;
  for (int attempt = 0; attempt < 5 && !redirected; ++attempt) {
    ASSERT_TRUE(harness_->MoveSlot(s1, other_primary(s1)).ok());
    const uint64_t before = tier->State().redirects;
    auto got = tier->Get({b1->key()}).get();
    ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
    EXPECT_TRUE(SameBytes(**got[0], *b1));
    redirected = tier->State().redirects > before;
  }
  EXPECT_TRUE(redirected) << "no GET met a MOVED in 5 moves of its slot";
  std::vector<Result<BundlePtr>> got;
  // A slot half moved: the old owner answers ASK for the key already gone.
  const size_t to2 = other_primary(s2);
  ASSERT_TRUE(harness_->MoveSlot(s2, to2, /*leave_migrating=*/true).ok());
  const uint64_t before_ask = tier->State().redirects;
  got = tier->Get({b2->key()}).get();
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_TRUE(SameBytes(**got[0], *b2));
  EXPECT_GT(tier->State().redirects, before_ask);
  ASSERT_TRUE(harness_->MoveSlot(s2, to2).ok());  // finish it
  got = tier->Get({b2->key()}).get();
  EXPECT_TRUE(got[0].ok());
}

// A chain with the remote tier last: a demote is acknowledged by the host tier, the remote copy
// follows in the background, and a second chain (another machine) promotes it from there.
TEST_F(RemoteTierTest, ChainsShareBlocksThroughTheRemoteTier) {
  auto make_chain = [&](WritePolicy policy) {
    std::vector<std::unique_ptr<Tier>> tiers;
    HostTierOptions ho;
    ho.capacity_bytes = 64ull << 20;
    tiers.push_back(HostTier::Open(ho).value());
    tiers.push_back(OpenTier(TierOptions(*harness_)));
    TierChainOptions co;
    co.write_policy = policy;
    return std::make_unique<TierChain>(std::move(tiers), co);
  };
  auto a = make_chain(WritePolicy::kWriteBack), b = make_chain(WritePolicy::kWriteThrough);
  const auto now_us = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
  const uint64_t s1 = a->NextSequence();
  EXPECT_GE(s1, now_us) << "a chain with a remote tier numbers versions from the clock";
  EXPECT_GT(a->NextSequence(), s1);
  std::vector<BundlePtr> blocks;
  std::vector<BundleKey> keys;
  for (uint64_t i = 0; i < 8; ++i) {
    blocks.push_back(MakeBundle(600 + i, {30000, 2000}, 1, 7, a->NextSequence()));
    keys.push_back(blocks.back()->key());
  }
  for (const Status& s : a->Demote(blocks).get()) ASSERT_TRUE(s.ok()) << s.ToString();
  a->WaitIdle();
  EXPECT_EQ(a->Stats().written_behind, 8u);
  EXPECT_EQ(b->CountPrefix(keys), 8u);
  EXPECT_EQ(b->Locate(keys)[0], 1);  // the remote tier
  const auto got = b->Promote(keys).get();
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status().ToString();
    EXPECT_TRUE(SameBytes(**got[i], *blocks[i]));
  }
  b->WaitIdle();
  EXPECT_EQ(b->Locate(keys)[0], 0) << "promoted into B's host tier";
  // B writes a newer version (its clock is later); A, which no longer holds the block, reads it.
  const BundlePtr v2 = MakeBundle(600, {30000, 2000}, 2, 7, b->NextSequence());
  ASSERT_TRUE(b->Demote({v2}).get()[0].ok());
  b->WaitIdle();
  ASSERT_TRUE(a->tier(0).Erase({keys[0]}).get()[0].ok());
  const auto newer = a->Promote({keys[0]}).get();
  ASSERT_TRUE(newer[0].ok());
  EXPECT_TRUE(SameBytes(**newer[0], *v2));
  // An erase through B reaches the cluster: A finds nothing below its own host tier.
  ASSERT_TRUE(b->Erase({keys[1]}).get()[0].ok());
  ASSERT_TRUE(a->tier(0).Erase({keys[1]}).get()[0].ok());
  EXPECT_EQ(a->Locate(std::vector<BundleKey>{keys[1]})[0], -1);
}

// A cluster that does not answer yet: every key misses at once, and once it is up the tier
// finds it by itself.
TEST(RemoteTierStart, AClusterThatComesUpLaterIsFoundAndMissesMeanwhileAreImmediate) {
  const std::vector<uint16_t> ports = RedisClusterHarness::FreePorts(3);
  ASSERT_EQ(ports.size(), 3u);
  // Held (bound, not listening) until the cluster starts, so that no other test's cluster takes
  // them meanwhile: connections to them are refused all along.
  std::vector<int> held;
  for (uint16_t p : ports) {
    for (uint16_t q : {p, static_cast<uint16_t>(p + 10000)}) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(q);
      if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) held.push_back(fd);
    }
  }
  RemoteTierOptions o;
  for (uint16_t p : ports) o.nodes.push_back("127.0.0.1:" + std::to_string(p));
  o.timeout_ms = 50;
  auto tier = RemoteTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  const auto t0 = Clock::now();
  const auto got = (*tier)->Get({KeyOf(1), KeyOf(2)}).get();
  const auto put = (*tier)->Put({MakeBundleOfBytes(1, 1000, 0, 1)}).get();
  const double waited_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_LT(waited_ms, 100.0);
  EXPECT_TRUE(got[0].status().Is(StatusCode::kNotFound)) << got[0].status().ToString();
  EXPECT_TRUE(put[0].Is(StatusCode::kUnavailable)) << put[0].ToString();
  EXPECT_FALSE((*tier)->State().healthy);

  for (int fd : held) close(fd);
  RedisClusterHarnessOptions ho;
  ho.replicas = 0;
  ho.ports = ports;
  auto h = RedisClusterHarness::Start(ho);
  ASSERT_TRUE(h.ok()) << h.status().ToString();  // (a port taken meanwhile would fail here)
  // Nothing but the tier's own traffic: puts and gets start to land by themselves.
  const auto until = Clock::now() + std::chrono::seconds(10);
  Result<BundlePtr> back = Status::NotFound("");
  while (!back.ok() && Clock::now() < until) {
    if ((*tier)->Put({MakeBundleOfBytes(1, 1000, 0, 1)}).get()[0].ok()) back = std::move((*tier)->Get({KeyOf(1)}).get()[0]);
    if (!back.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(SameBytes(**back, *MakeBundleOfBytes(1, 1000, 0, 1)));
  EXPECT_TRUE((*tier)->State().healthy);
}

// ---- failures: each test has a cluster of its own ----

class RemoteTierFailover : public ::testing::Test {
 protected:
  void SetUp() override {
    RedisClusterHarnessOptions o;
    o.node_timeout_ms = 1000;
    auto h = RedisClusterHarness::Start(o);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    harness_ = std::move(*h);
  }
  // Keys 0..n-1 stored (through a tier of its own, with time to spare), every replica caught up.
  std::vector<BundleKey> Fill(size_t n) {
    auto tier = OpenTier(TierOptions(*harness_));
    std::vector<BundlePtr> b;
    std::vector<BundleKey> keys;
    for (size_t i = 0; i < n; ++i) {
      b.push_back(MakeBundleOfBytes(i, 4096, 0, i + 1));
      keys.push_back(b.back()->key());
    }
    for (const Status& s : tier->Put(b).get()) EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_TRUE(harness_->WaitReplicated(std::chrono::seconds(10)).ok());
    return keys;
  }
  size_t PrimaryIndex() {
    for (size_t i = 0; i < harness_->nodes().size(); ++i) {
      if (harness_->nodes()[i].primary) return i;
    }
    return 0;
  }
  bool OnNode(RemoteTier& tier, const BundleKey& k, size_t node) {
    auto n = harness_->NodeOfSlot(offload::RedisKeySlot(tier.RedisKey(k)));
    return n.ok() && *n == node;
  }

  std::unique_ptr<RedisClusterHarness> harness_;
};

TEST_F(RemoteTierFailover, AKilledPrimarysKeysMissWithinTheTimeoutThenHitAfterItsReplicaTakesOver) {
  const RemoteTierOptions o = TierOptions(*harness_, 50);
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const std::vector<BundleKey> keys = Fill(300);
  const size_t victim = PrimaryIndex();
  std::vector<bool> on_victim(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) on_victim[i] = OnNode(*tier, keys[i], victim);
  ASSERT_GT(std::count(on_victim.begin(), on_victim.end(), true), 30);
  ASSERT_TRUE(harness_->Kill(victim).ok());

  // Until the cluster fails the node over: the victim's keys miss, the rest hit, and no call
  // waits past the timeout. Gets, contains and puts alike. (The other nodes may be cut off too
  // when this machine is loaded past the 50 ms timeout: their keys then miss, never fail.)
  double worst_ms = 0;
  uint64_t misses = 0, hits = 0, other_misses = 0;
  const auto end = Clock::now() + std::chrono::milliseconds(600);
  std::mt19937 rng(3);
  while (Clock::now() < end) {
    const size_t i = rng() % keys.size();
    auto timed = [&](auto call) {
      const auto t0 = Clock::now();
      auto r = call();
      worst_ms = std::max(worst_ms, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      return r;
    };
    const auto got = timed([&] { return tier->Get({keys[i]}).get(); });
    const bool has = timed([&]() -> bool { return tier->Contains({keys[i]}).get()[0]; });
    const Status put = timed([&] { return tier->Put({MakeBundleOfBytes(i, 4096, 1, 1000 + i)}).get()[0]; });
    if (on_victim[i]) {
      EXPECT_TRUE(got[0].status().Is(StatusCode::kNotFound)) << got[0].status().ToString();
      EXPECT_FALSE(has);
      EXPECT_TRUE(put.Is(StatusCode::kUnavailable)) << put.ToString();
      ++misses;
    } else {
      EXPECT_TRUE(got[0].ok() || got[0].status().Is(StatusCode::kNotFound)) << got[0].status().ToString();
      EXPECT_TRUE(put.ok() || put.Is(StatusCode::kUnavailable)) << put.ToString();
      ++(got[0].ok() ? hits : other_misses);
    }
  }
  EXPECT_GT(misses, 0u);
  EXPECT_GE(hits, 9 * other_misses) << "the other nodes' keys hit";
  EXPECT_LE(worst_ms, o.timeout_ms + 150.0) << "a call waited past the timeout";
  RemoteTierState s = tier->State();
  EXPECT_FALSE(s.healthy);
  EXPECT_GE(s.nodes_down, 1u);
  EXPECT_GE(s.incidents, 1u);
  EXPECT_GT(s.failed_commands, 5 * s.incidents) << "one incident, however many commands failed";

  // The replica takes over; the tier's slot map follows, and the victim's keys hit again.
  ASSERT_TRUE(harness_->WaitHealthy(std::chrono::seconds(30)).ok());
  ASSERT_TRUE(tier->WaitHealthy(std::chrono::seconds(10)));
  const auto got = tier->Get(keys).get();
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_TRUE(got[i].ok()) << i << ": " << got[i].status().ToString();
  s = tier->State();
  EXPECT_TRUE(s.healthy);
  EXPECT_GT(s.slot_map_refreshes, 1u);
  bool metric = false;
  for (const TierMetric& m : tier->Metrics()) metric |= m.name == "sparsekv_remote_healthy" && m.value == 1.0;
  EXPECT_TRUE(metric);
}

TEST_F(RemoteTierFailover, AStalledPrimaryIsCutOffAfterTheTimeoutAndTakenBackWhenItAnswers) {
  const RemoteTierOptions o = TierOptions(*harness_, 50);
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  const std::vector<BundleKey> keys = Fill(200);
  const size_t victim = PrimaryIndex();
  size_t k = 0;
  while (!OnNode(*tier, keys[k], victim)) ++k;
  ASSERT_TRUE(harness_->Pause(victim).ok());  // alive, connections open, silent
  const auto t0 = Clock::now();
  const auto got = tier->Get({keys[k]}).get();
  const double first_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_TRUE(got[0].status().Is(StatusCode::kNotFound)) << got[0].status().ToString();
  EXPECT_GE(first_ms, o.timeout_ms * 0.8);
  EXPECT_LE(first_ms, o.timeout_ms + 100.0);
  EXPECT_GE(tier->State().timeouts, 1u);
  // Marked down: the next ones miss at once.
  const auto t1 = Clock::now();
  EXPECT_TRUE(tier->Get({keys[k]}).get()[0].status().Is(StatusCode::kNotFound));
  const double second_ms = std::chrono::duration<double, std::milli>(Clock::now() - t1).count();
  EXPECT_LT(second_ms, o.timeout_ms);
  // Back before the cluster fails it over: the probe reaches it and its keys hit again.
  ASSERT_TRUE(harness_->Resume(victim).ok());
  ASSERT_TRUE(tier->WaitHealthy(std::chrono::seconds(10)));
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  bool back = false;
  while (!back && Clock::now() < deadline) {
    back = tier->Get({keys[k]}).get()[0].ok();
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(back);
  EXPECT_GE(tier->State().incidents, 1u);
}

}  // namespace
}  // namespace sparsekv
