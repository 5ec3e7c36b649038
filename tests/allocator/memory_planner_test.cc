#include "sparsekv/memory_planner.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace sparsekv {
namespace {

const PlanKindRow* Find(const MemoryPlan& plan, CacheKind kind, uint32_t ratio = 0) {
  for (const PlanKindRow& r : plan.kinds) {
    if (r.kind == kind && (ratio == 0 || r.ratio == ratio)) return &r;
  }
  return nullptr;
}

TEST(MemoryPlanner, V32IndexerKeysMatchThePublicArithmetic) {
  auto spec = ModelPreset("deepseek-v3.2-exp", KvPrecision::kBf16);
  ASSERT_TRUE(spec.ok());
  auto plan = PlanForSequences(*spec, 128, 4, 65536);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const PlanKindRow* idx = Find(*plan, CacheKind::kIndexerKey);
  ASSERT_NE(idx, nullptr);
  // 4 sequences x 65,536 tokens x 61 layers x 128 dims x 2 bytes: "about 4 GB".
  EXPECT_EQ(idx->bytes, 4ull * 65536 * 61 * 128 * 2);
  EXPECT_EQ(idx->bytes, 4093640704ull);
  EXPECT_EQ(idx->layers, 61u);
  EXPECT_EQ(idx->bytes_per_entry, 256u);
  EXPECT_EQ(idx->blocks, 4u * 512u);
  const PlanKindRow* mla = Find(*plan, CacheKind::kMlaLatent);
  ASSERT_NE(mla, nullptr);
  EXPECT_EQ(mla->bytes, 4ull * 65536 * 61 * 576 * 2);
  EXPECT_EQ(plan->total_bytes, idx->bytes + mla->bytes);
  EXPECT_EQ(plan->tokens, 4u * 65536u);

  // 8-bit: 132 bytes per key, "about 2 GB".
  for (KvPrecision p : {KvPrecision::kC8, KvPrecision::kFp8}) {
    auto s8 = ModelPreset("deepseek-v3.2-exp", p);
    auto p8 = PlanForSequences(*s8, 128, 4, 65536);
    ASSERT_TRUE(p8.ok());
    const PlanKindRow* idx8 = Find(*p8, CacheKind::kIndexerKey);
    EXPECT_EQ(idx8->bytes, 4ull * 65536 * 61 * 132);
    EXPECT_NEAR(static_cast<double>(idx8->bytes) / idx->bytes, 132.0 / 256.0, 1e-12);
    EXPECT_EQ(Find(*p8, CacheKind::kMlaLatent)->bytes, 4ull * 65536 * 61 * 656);
  }
}

TEST(MemoryPlanner, PartialBlocksRoundUp) {
  auto spec = ModelPreset("deepseek-v3.2-exp", KvPrecision::kBf16);
  auto plan = PlanForSequences(*spec, 128, 1, 129);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(Find(*plan, CacheKind::kIndexerKey)->blocks, 2u);
}

TEST(MemoryPlanner, V4KeepsOnlyTheWindowAndOneSnapshot) {
  auto spec = ModelPreset("deepseek-v4-flash", KvPrecision::kFp8);
  ASSERT_TRUE(spec.ok());
  auto plan = PlanForSequences(*spec, 128, 2, 65536);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const uint64_t seq_blocks = 65536 / 128;
  const PlanKindRow* swa = Find(*plan, CacheKind::kSwaWindow);
  EXPECT_EQ(swa->blocks, 2u * 2u);  // a 128-token window spans at most 2 blocks
  EXPECT_EQ(swa->layers, 43u);
  const PlanKindRow* csa = Find(*plan, CacheKind::kCsaCompressed);
  EXPECT_EQ(csa->blocks, 2 * seq_blocks);
  EXPECT_EQ(csa->layers, 21u);
  // 65,536 / 4 = 16,384 entries per layer per sequence, 576-byte padded 32-entry pages.
  EXPECT_EQ(csa->bytes, 2 * seq_blocks * 21 * 19008);
  const PlanKindRow* hca = Find(*plan, CacheKind::kHcaCompressed);
  EXPECT_EQ(hca->bytes, 2 * seq_blocks * 20 * 1152);
  const PlanKindRow* idx = Find(*plan, CacheKind::kIndexerKey);
  EXPECT_EQ(idx->bytes, 2 * seq_blocks * 21 * 32 * 132);
  EXPECT_EQ(Find(*plan, CacheKind::kCompressorState, 4)->blocks, 2u);
  EXPECT_EQ(Find(*plan, CacheKind::kCompressorState, 128)->bytes, 2ull * 20 * 2 * 128 * 512 * 4);
  uint64_t sum = 0;
  for (const PlanKindRow& r : plan->kinds) sum += r.bytes;
  EXPECT_EQ(sum, plan->total_bytes);
}

TEST(MemoryPlanner, BudgetAnswersTheLongestFittingLength) {
  auto spec = ModelPreset("deepseek-v3.2-exp", KvPrecision::kFp8);
  const uint64_t budget = 10ull << 30;
  auto plan = PlanForBudget(*spec, 128, budget, 2);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_LE(plan->total_bytes, budget);
  EXPECT_EQ(plan->seq_len % 128, 0u);
  auto more = PlanForSequences(*spec, 128, 2, plan->seq_len + 128);
  ASSERT_TRUE(more.ok());
  EXPECT_GT(more->total_bytes, budget);  // one block more would not fit
  // (656 + 132) x 61 bytes per token.
  EXPECT_EQ(plan->seq_len, budget / 2 / (788ull * 61 * 128) * 128);
  EXPECT_EQ(PlanForBudget(*spec, 128, 1000, 1).status().code(), StatusCode::kResourceExhausted);
}

TEST(MemoryPlanner, JsonHasTheAgreedFields) {
  auto spec = ModelPreset("deepseek-v4-flash", KvPrecision::kBf16);
  auto plan = PlanForSequences(*spec, 128, 1, 1000);
  ASSERT_TRUE(plan.ok());
  auto j = nlohmann::json::parse(MemoryPlanToJson(*plan));
  for (const char* k : {"model", "tokens", "block_tokens", "total_bytes", "kinds"}) EXPECT_TRUE(j.contains(k)) << k;
  for (const auto& row : j["kinds"]) {
    for (const char* k : {"kind", "format", "layers", "bytes_per_entry", "blocks", "bytes"}) {
      EXPECT_TRUE(row.contains(k)) << k;
    }
  }
  EXPECT_FALSE(PlanForSequences(*spec, 128, 0, 10).ok());
  EXPECT_FALSE(PlanForSequences(*spec, 96, 1, 10).ok());
}

}  // namespace
}  // namespace sparsekv
