// Suspend and resume at any token (OffloadedCache::Suspend/Resume, issue 35): a toy decoder
// (bench/toy_decoder.h) writes and reads the pages as a model does, so a resumed sequence must
// give the digests of an uninterrupted run, step for step, and hold byte-identical pages. Token
// positions on, just before and just after block edges and V4's ratio-4 and ratio-128 edges;
// resumes from L1 and from the chain (L1 emptied); a tail record that is missing, names another
// state, or is damaged on the SSD; a prefix block gone from every tier.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <map>

#include "sparsekv/fault_injection_file_system.h"
#include "sparsekv/host_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"
#include "toy_decoder.h"

namespace sparsekv {
namespace {

using bench::ToyDecoder;

constexpr uint32_t kBlockTokens = 128;
constexpr uint32_t kL1Blocks = 10;
constexpr uint64_t kContinue = 12;  // tokens decoded after a resume

ModelSpec Spec(bool v4) {
  ModelSpec s = ModelPreset(v4 ? "deepseek-v4-flash" : "deepseek-v3.2-exp", KvPrecision::kFp8).value();
  // V4: two window-only layers, then CSA, HCA, CSA, HCA. V3.2: two latent + indexer layers.
  s.layers.resize(v4 ? 6 : 2);
  return s;
}

struct Stack {
  std::unique_ptr<FaultInjectionFileSystem> fs;
  std::unique_ptr<CacheManager> manager;
  std::unique_ptr<TierChain> chain;
  std::unique_ptr<OffloadedCache> cache;
  std::unique_ptr<ToyDecoder> toy;
};

Stack Build(bool v4, const std::string& dir, WritePolicy policy = WritePolicy::kWriteThrough) {
  Stack s;
  s.fs = std::make_unique<FaultInjectionFileSystem>(FileSystem::Default());
  CacheManagerOptions mo;
  mo.block_tokens = kBlockTokens;
  mo.capacity_blocks = kL1Blocks;
  mo.huge_pages = false;
  mo.check_invariants = true;
  s.manager = CacheManager::Create(Spec(v4), mo).value();
  std::vector<uint64_t> sizes;
  for (const auto& p : s.manager->geometry().pools) sizes.push_back(p.block_stride);
  sizes.push_back(16);
  const uint64_t block_bytes = BundleRecordBytes(sizes);
  HostTierOptions h;
  h.max_record_bytes = block_bytes + 8192;  // a tail record: a block's pages, its tokens, a header
  h.capacity_bytes = 24 * ((block_bytes + 4095) & ~uint64_t{4095});
  h.huge_pages = false;
  SsdTierOptions d;
  d.path = dir;
  d.capacity_bytes = 256 << 20;
  d.read_arena_bytes = 64 << 20;
  d.slab_grow_bytes = 32 << 20;
  std::vector<std::unique_ptr<Tier>> tiers;
  tiers.push_back(HostTier::Open(h).value());
  tiers.push_back(SsdTier::Open(d, s.fs.get()).value());
  TierChainOptions co;
  co.write_policy = WritePolicy::kWriteThrough;
  s.chain = std::make_unique<TierChain>(std::move(tiers), co);
  OffloadedCacheOptions oo;
  oo.write_policy = policy;
  s.cache = std::make_unique<OffloadedCache>(*s.manager, *s.chain, oo);
  EXPECT_LE(s.cache->max_tail_record_bytes(), h.max_record_bytes);
  EXPECT_GT(s.cache->max_tail_record_bytes(), block_bytes);
  s.toy = ToyDecoder::Create(*s.manager, 7).value();
  return s;
}

// Decodes `count` tokens of a sequence of `cache` (tokens as ToyDecoder::Run wants them).
Status Decode(Stack& s, SequenceId seq, uint64_t count, std::vector<TokenId>* tokens,
              std::vector<uint64_t>* digests) {
  return s.toy->Run(
      *s.manager, seq, count, tokens, digests,
      [&](SequenceId q, std::span<const TokenId> t) { return s.cache->AppendTokens(q, t); },
      [&](SequenceId q, uint64_t n) { return s.cache->CommitComputed(q, n); });
}

// Computes tokens [from, to) of a resumed sequence again (they are appended already).
Status Recompute(Stack& s, SequenceId seq, const std::vector<TokenId>& tokens, uint64_t from,
                 uint64_t to, std::vector<uint64_t>* digests) {
  uint64_t mismatches = 0;
  return s.toy->Replay(
      *s.manager, seq, tokens, from, to,
      [&](SequenceId q, uint64_t n) { return s.cache->CommitComputed(q, n); }, &mismatches, digests);
}

// (block, pool) -> bytes of every page the sequence holds: each layer's entries (a format's
// padding after them is nobody's data: a block found in L1 was computed by another sequence,
// in a page whose padding its earlier users wrote).
using Pages = std::map<std::pair<uint32_t, size_t>, std::vector<std::byte>>;
Pages Snapshot(const CacheManager& m, SequenceId seq) {
  Pages out;
  for (size_t p = 0; p < m.num_pools(); ++p) {
    const PoolGeometry& g = m.geometry().pools[p];
    std::vector<PageId> table;
    EXPECT_TRUE(m.GetBlockTable(seq, p, &table).ok());
    for (uint32_t b = 0; b < table.size(); ++b) {
      if (table[b] == kInvalidPage) continue;
      std::vector<std::byte>& bytes = out[{b, p}];
      for (uint32_t l = 0; l < g.layers.size(); ++l) {
        const std::byte* d = m.pool(p).PageData(table[b]) + g.Offset(0, l);
        bytes.insert(bytes.end(), d, d + uint64_t{g.entries_per_block} * g.bytes_per_entry);
      }
    }
  }
  return out;
}

// An uninterrupted run of `n` steps: its digests.
std::vector<uint64_t> Reference(bool v4, uint64_t n) {
  testing::TempDir dir("suspend_ref");
  Stack s = Build(v4, dir.path());
  SequenceId seq = s.cache->CreateSequence().value();
  std::vector<TokenId> tokens{11};
  EXPECT_TRUE(s.cache->AppendTokens(seq, tokens).ok());
  std::vector<uint64_t> digests;
  const Status st = Decode(s, seq, n, &tokens, &digests);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return digests;
}

struct Suspended {
  std::vector<TokenId> tokens{11};
  std::vector<uint64_t> digests;
  SuspendInfo info;
  Pages pages;
};

// Decodes p tokens and suspends there.
Suspended DecodeAndSuspend(Stack& s, uint64_t p) {
  Suspended r;
  SequenceId seq = s.cache->CreateSequence().value();
  EXPECT_TRUE(s.cache->AppendTokens(seq, r.tokens).ok());
  const Status st = Decode(s, seq, p, &r.tokens, &r.digests);
  EXPECT_TRUE(st.ok()) << st.ToString();
  r.pages = Snapshot(*s.manager, seq);
  auto info = s.cache->Suspend(seq);
  EXPECT_TRUE(info.ok()) << info.status().ToString();
  if (info.ok()) r.info = *info;
  EXPECT_FALSE(s.manager->GetSequenceInfo(seq).ok()) << "suspend frees the sequence";
  // Scribble over free pages (the suspended sequence's partial block among them), so a resume
  // that left a byte unrestored cannot pass by finding the old page again.
  SequenceId junk = s.manager->CreateSequence().value();
  if (s.manager->AllocateSlots(junk, 2 * kBlockTokens).ok()) {
    for (size_t q = 0; q < s.manager->num_pools(); ++q) {
      std::vector<PageId> table;
      EXPECT_TRUE(s.manager->GetBlockTable(junk, q, &table).ok());
      for (PageId pg : table)
        std::memset(s.manager->pool(q).PageData(pg), 0xa5, s.manager->geometry().pools[q].block_stride);
    }
  }
  EXPECT_TRUE(s.manager->Free(junk).ok());
  return r;
}

class SuspendResume : public ::testing::TestWithParam<bool> {};

TEST_P(SuspendResume, ContinuesBitIdenticalAtBlockAndCompressionEdges) {
  const bool v4 = GetParam();
  // 1, 3, 4, 5, 127, 128, 129 tokens into the first and the second block (V4's ratio-4 edge
  // at 4, its ratio-128 and the block edge at 128 and 256).
  const std::vector<uint64_t> positions = {1, 3, 4, 5, 127, 128, 129, 131, 132, 133, 255, 256, 257};
  const std::vector<uint64_t> ref = Reference(v4, 257 + kContinue);
  testing::TempDir dir("suspend");
  Stack s = Build(v4, dir.path());
  for (size_t i = 0; i < positions.size(); ++i) {
    const uint64_t p = positions[i];
    const bool from_chain = i % 2 == 1;
    SCOPED_TRACE(fmt::format("{} at {} tokens, resumed from {}", v4 ? "V4" : "V3.2", p,
                             from_chain ? "the chain" : "L1"));
    Suspended r = DecodeAndSuspend(s, p);
    ASSERT_EQ(r.digests, std::vector<uint64_t>(ref.begin(), ref.begin() + static_cast<long>(p)));
    EXPECT_EQ(r.info.tokens, p);
    EXPECT_EQ(r.info.blocks, p / kBlockTokens);
    EXPECT_EQ(r.info.unsaved_blocks, 0u);
    if (from_chain) {
      s.cache->WaitIdle();
      s.cache->Evict(kL1Blocks);
      ASSERT_EQ(s.manager->Stats().cached_blocks, 0u);
    }
    auto res = s.cache->Resume({}, r.tokens, p);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
    EXPECT_EQ(res->restored_tokens, p);
    EXPECT_EQ(res->tail_restored, p % kBlockTokens != 0);
    if (from_chain) {
      EXPECT_EQ(res->lower_blocks, p / kBlockTokens);
    }
    EXPECT_EQ(s.manager->GetSequenceInfo(res->seq)->computed_tokens, p);
    // Every page the suspended sequence held, byte for byte (and no more).
    const Pages resumed = Snapshot(*s.manager, res->seq);
    EXPECT_EQ(resumed.size(), r.pages.size());
    for (const auto& [where, bytes] : r.pages) {
      auto it = resumed.find(where);
      ASSERT_NE(it, resumed.end()) << "block " << where.first << " pool " << where.second;
      size_t at = 0;
      while (at < bytes.size() && bytes[at] == it->second[at]) ++at;
      EXPECT_EQ(at, bytes.size()) << "block " << where.first << " pool " << where.second
                                  << " differs at byte " << at << " of " << bytes.size();
    }
    std::vector<uint64_t> after;
    const Status st = Decode(s, res->seq, kContinue, &r.tokens, &after);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(after, std::vector<uint64_t>(ref.begin() + static_cast<long>(p),
                                           ref.begin() + static_cast<long>(p + kContinue)));
    ASSERT_TRUE(s.cache->Free(res->seq).ok());
    ASSERT_TRUE(s.manager->CheckInvariants().ok());
  }
}

// A tail record that cannot be used ends the exact state at the block edge before it: the
// resume says so, and computing the rest again gives the uninterrupted digests.
TEST_P(SuspendResume, MissingWrongOrDamagedTailRecomputesFromTheBlockEdge) {
  const bool v4 = GetParam();
  const uint64_t p = 133;
  const std::vector<uint64_t> ref = Reference(v4, p + kContinue);
  testing::TempDir dir("suspend_tail");
  Stack s = Build(v4, dir.path());
  for (const std::string how : {"missing", "wrong", "damaged"}) {
    SCOPED_TRACE(how);
    Suspended r = DecodeAndSuspend(s, p);
    const BundleKey key{0, r.info.tail};
    if (how == "missing") {
      ASSERT_TRUE(s.cache->DropSuspension(r.info.tail).ok());
    } else if (how == "wrong") {
      // A well-formed record under the key that names another state (as a hash collision would).
      std::vector<std::byte> junk(64, std::byte{1});
      std::vector<std::span<const std::byte>> segs{junk};
      ASSERT_TRUE(s.chain->Demote({Bundle::Make(key, segs, s.chain->NextSequence()).value()})
                      .get()[0]
                      .ok());
    } else {
      // Only the SSD copy is left, and its read comes back with a bit flipped.
      s.cache->WaitIdle();
      ASSERT_TRUE(s.chain->tier(0).Erase({key}).get()[0].ok());
      s.fs->AddRule({FaultOp::kRead, FaultKind::kFlipBit, "", 1, 1.0});
    }
    auto res = s.cache->Resume({}, r.tokens, p);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    s.fs->ClearRules();
    EXPECT_FALSE(res->tail_restored);
    EXPECT_EQ(res->restored_tokens, 128u);
    EXPECT_EQ(res->recompute_tokens, p - 128);
    EXPECT_FALSE(res->lost.empty());
    std::vector<uint64_t> again;
    ASSERT_TRUE(Recompute(s, res->seq, r.tokens, 128, p, &again).ok());
    EXPECT_EQ(again, std::vector<uint64_t>(ref.begin() + 128, ref.begin() + static_cast<long>(p)));
    std::vector<uint64_t> after;
    ASSERT_TRUE(Decode(s, res->seq, kContinue, &r.tokens, &after).ok());
    EXPECT_EQ(after, std::vector<uint64_t>(ref.begin() + static_cast<long>(p),
                                           ref.begin() + static_cast<long>(p + kContinue)));
    ASSERT_TRUE(s.cache->Free(res->seq).ok());
  }
  if (!s.fs->Stats().flipped_bits) ADD_FAILURE() << "the damaged read was never made";
}

// A prefix block evicted from L1 and erased from every tier since the suspension: the resume
// restores the blocks before it and says how many tokens to compute again.
TEST_P(SuspendResume, PrefixBlockGoneFromEveryTierRecomputesFromIt) {
  const bool v4 = GetParam();
  const uint64_t p = 3 * kBlockTokens + 5;
  const std::vector<uint64_t> ref = Reference(v4, p + kContinue);
  testing::TempDir dir("suspend_gone");
  Stack s = Build(v4, dir.path());
  Suspended r = DecodeAndSuspend(s, p);
  s.cache->WaitIdle();
  s.cache->Evict(kL1Blocks);
  SequenceId probe = s.cache->CreateSequence().value();
  ASSERT_TRUE(s.cache->AppendTokens(probe, r.tokens).ok());
  const std::vector<BlockDigest> digests = s.cache->BlockDigests(probe).value();
  ASSERT_TRUE(s.cache->Free(probe).ok());
  ASSERT_TRUE(s.chain->Erase({BundleKey{0, digests[1].hash}}).get()[0].ok());
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->restored_tokens, kBlockTokens);
  EXPECT_EQ(res->recompute_tokens, p - kBlockTokens);
  EXPECT_FALSE(res->tail_restored);
  EXPECT_NE(res->lost.find("block 1"), std::string::npos) << res->lost;
  std::vector<uint64_t> again;
  ASSERT_TRUE(Recompute(s, res->seq, r.tokens, kBlockTokens, p, &again).ok());
  EXPECT_EQ(again, std::vector<uint64_t>(ref.begin() + kBlockTokens, ref.begin() + static_cast<long>(p)));
  std::vector<uint64_t> after;
  ASSERT_TRUE(Decode(s, res->seq, kContinue, &r.tokens, &after).ok());
  EXPECT_EQ(after, std::vector<uint64_t>(ref.begin() + static_cast<long>(p),
                                         ref.begin() + static_cast<long>(p + kContinue)));
}

// Write-back: nothing reached the tiers before the suspend, and V4's window and snapshot pages
// of older blocks left the sequence early (they are the cached blocks' only): Suspend writes
// every block whole, and a resume with L1 emptied restores them all.
TEST_P(SuspendResume, WriteBackSuspendWritesEveryBlockWhole) {
  const bool v4 = GetParam();
  const uint64_t p = 3 * kBlockTokens + 5;
  const std::vector<uint64_t> ref = Reference(v4, p + kContinue);
  testing::TempDir dir("suspend_wb");
  Stack s = Build(v4, dir.path(), WritePolicy::kWriteBack);
  Suspended r = DecodeAndSuspend(s, p);
  EXPECT_EQ(r.info.written_blocks, 3u);
  EXPECT_EQ(r.info.unsaved_blocks, 0u);
  ASSERT_TRUE(s.manager->CheckInvariants().ok()) << s.manager->CheckInvariants().ToString();
  s.cache->Evict(kL1Blocks);
  s.cache->WaitIdle();
  ASSERT_EQ(s.manager->Stats().cached_blocks, 0u);
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
  EXPECT_EQ(res->lower_blocks, 3u);
  std::vector<uint64_t> after;
  ASSERT_TRUE(Decode(s, res->seq, kContinue, &r.tokens, &after).ok());
  EXPECT_EQ(after, std::vector<uint64_t>(ref.begin() + static_cast<long>(p),
                                         ref.begin() + static_cast<long>(p + kContinue)));
  ASSERT_TRUE(s.cache->Free(res->seq).ok());
  ASSERT_TRUE(s.manager->CheckInvariants().ok());
}

INSTANTIATE_TEST_SUITE_P(Models, SuspendResume, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "V4" : "V32"; });

TEST(Suspend, ConversationCostsItsBlocksOncePlusOneTail) {
  testing::TempDir dir("suspend_conv");
  Stack s = Build(true, dir.path());
  std::vector<TokenId> tokens{11};
  BlockHash previous;
  uint64_t written = 0, tails = 0;
  for (int turn = 0; turn < 6; ++turn) {
    auto res = s.cache->Resume({}, tokens, tokens.size() - 1);
    ASSERT_TRUE(res.ok());
    ASSERT_EQ(res->recompute_tokens, 0u) << res->lost;
    ASSERT_TRUE(Decode(s, res->seq, 70, &tokens, nullptr).ok());
    auto info = s.cache->Suspend(res->seq);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    written += info->written_bytes;
    tails += info->tail_bytes;
    if (turn > 0) {
      ASSERT_TRUE(s.cache->DropSuspension(previous).ok());
    }
    previous = info->tail;
  }
  // 421 tokens: 3 full blocks, each written once (write-through stored them as they filled, so
  // Suspend wrote none of them), and the tails.
  EXPECT_EQ(written, tails);
  auto key = s.cache->SuspensionKey({}, tokens, tokens.size() - 1);
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, previous);
}

TEST(Suspend, BadArguments) {
  testing::TempDir dir("suspend_bad");
  Stack s = Build(false, dir.path());
  EXPECT_TRUE(s.cache->Suspend(12345).status().Is(StatusCode::kNotFound));
  std::vector<TokenId> tokens(10, 3);
  EXPECT_TRUE(s.cache->Resume({}, tokens, 11).status().Is(StatusCode::kInvalidArgument));
  SequenceOptions no_cache;
  no_cache.cache_blocks = false;
  SequenceId seq = s.cache->CreateSequence(no_cache).value();
  EXPECT_TRUE(s.cache->Suspend(seq).status().Is(StatusCode::kFailedPrecondition));
  // Resuming a state never suspended: nothing found, everything to compute, no error.
  auto res = s.cache->Resume({}, tokens, 9);
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(res->recompute_tokens, 9u);
}

}  // namespace
}  // namespace sparsekv
