#include "sparsekv/offload_options.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

TEST(OffloadOptions, DefaultsAndFullSection) {
  auto d = ParseOffloadOptionsJson("{}");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->host_enabled);
  EXPECT_FALSE(d->ssd_enabled);
  EXPECT_EQ(d->ssd.queue_depth, 16u);
  EXPECT_EQ(d->ssd.durability, Durability::kFdatasync);
  auto o = ParseOffloadOptionsJson(R"({
    "write_policy": "write-through", "prefetch_blocks": 8,
    "host": {"capacity_bytes": "4GiB", "max_record_bytes": 9437184, "populate": true},
    "ssd": {"enabled": true, "path": "l3", "capacity_bytes": "64 GiB", "queue_depth": 32, "io_threads": 2,
            "io_bytes": "2MiB", "durability": "dsync", "register_buffers": false,
            "read_coalesce_bytes": "16MiB", "read_gap_bytes": "64KiB"},
    "rocksdb": {"enabled": true, "min_blob_size": "64KiB", "durability": "none", "use_direct_io": true}})");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->chain.write_policy, WritePolicy::kWriteThrough);
  EXPECT_EQ(o->chain.prefetch_blocks, 8u);
  EXPECT_EQ(o->host.capacity_bytes, 4ull << 30);
  EXPECT_EQ(o->host.max_record_bytes, 9437184u);
  EXPECT_TRUE(o->host.populate);
  EXPECT_FALSE(d->host.populate);
  EXPECT_EQ(o->ssd.read_coalesce_bytes, 16u << 20);
  EXPECT_EQ(o->ssd.read_gap_bytes, 64u << 10);
  EXPECT_EQ(o->ssd.capacity_bytes, 64ull << 30);
  EXPECT_EQ(o->ssd.queue_depth, 32u);
  EXPECT_EQ(o->ssd.io_bytes, 2u << 20);
  EXPECT_EQ(o->ssd.durability, Durability::kDsync);
  EXPECT_FALSE(o->ssd.register_buffers);
  EXPECT_EQ(o->rocksdb.min_blob_size, 65536u);
  EXPECT_EQ(o->rocksdb.durability, Durability::kNone);
  ResolveOffloadPaths(*o, "/var/skv");
  EXPECT_EQ(o->ssd.path, "/var/skv/l3");
  EXPECT_EQ(o->rocksdb.path, "/var/skv/rocksdb");
  // Round trip through the effective-options JSON.
  auto again = ParseOffloadOptionsJson(OffloadOptionsToJson(*o));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(OffloadOptionsToJson(*again), OffloadOptionsToJson(*o));
}

TEST(OffloadOptions, ErrorsNameTheKeyAndWhatWasExpected) {
  struct Case {
    const char* json;
    const char* expect;
  } cases[] = {
      {R"({"ssd": {"queue_depth": "deep"}})",
       "offload.ssd.queue_depth: expected an integer from 1 to 4096, got \"deep\""},
      {R"({"ssd": {"queue_depth": 0}})",
       "offload.ssd.queue_depth: expected an integer from 1 to 4096, got 0"},
      {R"({"ssd": {"durability": "sometimes"}})",
       "offload.ssd.durability: unknown durability 'sometimes'"},
      {R"({"ssd": {"capacity_bytes": "lots"}})", "offload.ssd.capacity_bytes: expected a size"},
      {R"({"ssd": {"io_bytes": 5000}})", "offload.ssd.io_bytes: expected a multiple of 4096"},
      {R"({"ssd": {"read_gap_bytes": 5000}})", "offload.ssd.read_gap_bytes: expected a multiple of 4096, got 5000"},
      {R"({"ssd": {"read_coalesce_bytes": "2GiB"}})", "offload.ssd.read_coalesce_bytes: expected at most 1 GiB"},
      {R"({"host": {"populate": 1}})", "offload.host.populate: expected true or false"},
      {R"({"host": {"enabled": "yes"}})", "offload.host.enabled: expected true or false"},
      {R"({"rocksdb": {"colour": 1}})", "offload.rocksdb.colour: unknown key"},
      {R"({"write_policy": "sideways"})", "offload.write_policy: unknown write policy 'sideways'"},
      {R"({"ssd": []})", "offload.ssd: expected an object"},
      {R"({"ssd": {)", "offload: not valid JSON"},
      {R"({"remote": {"enabled": true}})", "offload.remote.nodes: expected at least one"},
      {R"({"remote": {"nodes": "10.0.0.1:7000"}})", "offload.remote.nodes: expected an array of strings"},
      {R"({"remote": {"nodes": ["10.0.0.1"]}})", "offload.remote.nodes: expected \"host:port\", got \"10.0.0.1\""},
      {R"({"remote": {"nodes": ["h:70x0"]}})", "offload.remote.nodes: expected \"host:port\""},
      {R"({"remote": {"timeout_ms": 0}})", "offload.remote.timeout_ms: expected an integer from 1 to 60000"},
      {R"({"remote": {"key_prefix": "a{b}"}})", "offload.remote.key_prefix: must not hold '{' or '}'"},
      {R"({"remote": {"max_record_bytes": "1GiB"}})", "offload.remote.max_record_bytes: expected at most 512 MiB"},
      {R"({"remote": {"node": ["h:1"]}})", "offload.remote.node: unknown key"},
  };
  for (const Case& c : cases) {
    auto r = ParseOffloadOptionsJson(c.json);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_TRUE(r.status().Is(StatusCode::kInvalidArgument));
    EXPECT_NE(r.status().ToString().find(c.expect), std::string::npos) << r.status().ToString();
  }
}

TEST(OffloadOptions, RemoteSectionRoundTripsAndNeedsALocalTier) {
  auto o = ParseOffloadOptionsJson(R"({"remote": {"enabled": true, "nodes": ["127.0.0.1:7000", "db-3:7001"],
      "password": "pw", "key_prefix": "fleet1", "timeout_ms": 40, "connections_per_node": 6,
      "max_record_bytes": "16MiB", "max_pending_write_bytes": "1GiB", "writer_threads": 3}})");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->remote_enabled);
  EXPECT_EQ(o->remote.nodes, (std::vector<std::string>{"127.0.0.1:7000", "db-3:7001"}));
  EXPECT_EQ(o->remote.key_prefix, "fleet1");
  EXPECT_EQ(o->remote.timeout_ms, 40u);
  EXPECT_EQ(o->remote.connections_per_node, 6u);
  EXPECT_EQ(o->remote.max_record_bytes, 16ull << 20);
  EXPECT_EQ(o->remote.max_pending_write_bytes, 1ull << 30);
  EXPECT_EQ(o->remote.writer_threads, 3u);
  const std::string shown = OffloadOptionsToJson(*o);
  EXPECT_EQ(shown.find("\"pw\""), std::string::npos) << "the password is not logged";
  auto again = ParseOffloadOptionsJson(shown);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->remote.nodes, o->remote.nodes);
  // A remote tier alone is refused: reads and acknowledgements need a local tier.
  o->host_enabled = false;
  auto chain = OpenTierChain(*o);
  ASSERT_FALSE(chain.ok());
  EXPECT_NE(chain.status().message().find("needs a local tier"), std::string::npos) << chain.status().ToString();
}

TEST(OffloadOptions, OpenTierChainBuildsTheEnabledTiers) {
  testing::TempDir dir("opts");
  auto o = ParseOffloadOptionsJson(
      R"({"host": {"capacity_bytes": "1MiB", "max_record_bytes": 65536, "huge_pages": false},
                                       "ssd": {"enabled": true, "capacity_bytes": "16MiB", "slab_grow_bytes": "1MiB", "read_arena_bytes": "4MiB"},
                                       "rocksdb": {"enabled": true}})");
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  ResolveOffloadPaths(*o, dir.path());
  auto chain = OpenTierChain(*o);
  ASSERT_TRUE(chain.ok()) << chain.status().ToString();
  ASSERT_EQ((*chain)->tier_count(), 3u);
  EXPECT_EQ((*chain)->tier(0).name(), "host");
  EXPECT_EQ((*chain)->tier(1).name(), "ssd");
  EXPECT_EQ((*chain)->tier(2).name(), "rocksdb");
  OffloadOptions none;
  none.host_enabled = false;
  EXPECT_TRUE(OpenTierChain(none).status().Is(StatusCode::kInvalidArgument));
  OffloadOptions too_large;  // a record limit above the tier's capacity
  too_large.host.capacity_bytes = 1 << 20;
  too_large.host.max_record_bytes = 2 << 20;
  too_large.host.huge_pages = false;
  auto e = OpenTierChain(too_large);
  EXPECT_NE(e.status().ToString().find("offload.host: host tier: max_record_bytes"),
            std::string::npos)
      << e.status().ToString();
  // The older name of the limit still reads, as the same limit.
  auto old = ParseOffloadOptionsJson(R"({"host": {"slot_bytes": 65536}})");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(old->host.max_record_bytes, 65536u);
}

}  // namespace
}  // namespace sparsekv
