// Suspend and resume at any token (OffloadedCache::Suspend/Resume, issue 35): a toy decoder
// (bench/toy_decoder.h) writes and reads the pages as a model does, so a resumed sequence must
// give the digests of an uninterrupted run, step for step, and hold byte-identical pages. Token
// positions on, just before and just after block edges and V4's ratio-4 and ratio-128 edges;
// resumes from L1 and from the chain (L1 emptied); a tail record that is missing, names another
// state, or is damaged on the SSD; a prefix block gone from every tier.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <map>
#include <optional>

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

Stack Build(bool v4, const std::string& dir, WritePolicy policy = WritePolicy::kWriteThrough,
            uint32_t l1_blocks = kL1Blocks, uint32_t boundary_blocks = 0, bool demote_on_boundary_eviction = true,
            uint32_t evict_ahead_blocks = 8) {
  Stack s;
  s.fs = std::make_unique<FaultInjectionFileSystem>(FileSystem::Default());
  CacheManagerOptions mo;
  mo.block_tokens = kBlockTokens;
  mo.capacity_blocks = l1_blocks;
  mo.window_capacity_blocks = boundary_blocks;
  mo.state_capacity_blocks = boundary_blocks;
  mo.huge_pages = false;
  mo.check_invariants = true;
  s.manager = CacheManager::Create(Spec(v4), mo).value();
  std::vector<uint64_t> sizes;
  for (const auto& p : s.manager->geometry().pools) sizes.push_back(p.block_stride);
  sizes.push_back(16);
  const uint64_t block_bytes = BundleRecordBytes(sizes);
  HostTierOptions h;
  // A tail record: a block's pages, the window pages before it, its tokens, a header.
  h.max_record_bytes = 2 * block_bytes;
  h.capacity_bytes = (l1_blocks + 14) * ((block_bytes + 4095) & ~uint64_t{4095});
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
  oo.demote_on_boundary_eviction = demote_on_boundary_eviction;
  oo.evict_ahead_blocks = evict_ahead_blocks;
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

// One turn of a conversation suspended after every turn: resumes `tokens` (suspended at their
// last token) with nothing to recompute, decodes `count` more into them, suspends again into
// `info` and drops the turn before's suspension (`previous`, then this turn's tail).
void ConversationTurn(Stack& s, std::vector<TokenId>& tokens, uint64_t count,
                      std::optional<BlockHash>& previous, SuspendInfo& info) {
  auto res = s.cache->Resume({}, tokens, tokens.size() - 1);
  ASSERT_TRUE(res.ok());
  ASSERT_EQ(res->recompute_tokens, 0u) << res->lost;
  ASSERT_TRUE(Decode(s, res->seq, count, &tokens, nullptr).ok());
  auto suspended = s.cache->Suspend(res->seq);
  ASSERT_TRUE(suspended.ok()) << suspended.status().ToString();
  info = *suspended;
  if (previous) {
    ASSERT_TRUE(s.cache->DropSuspension(*previous).ok());
  }
  previous = info.tail;
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

// Decodes kContinue more tokens of a resumed sequence (tokens as ToyDecoder::Run wants them):
// they must give the uninterrupted run's digests `ref` from position p on.
void ExpectContinues(Stack& s, SequenceId seq, std::vector<TokenId>* tokens, const std::vector<uint64_t>& ref,
                     uint64_t p) {
  std::vector<uint64_t> after;
  const Status st = Decode(s, seq, kContinue, tokens, &after);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(after, std::vector<uint64_t>(ref.begin() + static_cast<long>(p),
                                         ref.begin() + static_cast<long>(p + kContinue)));
}

// Every page the suspended sequence held, byte for byte, and no more.
void ExpectSamePages(const Pages& want, const Pages& got) {
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [where, bytes] : want) {
    auto it = got.find(where);
    ASSERT_NE(it, got.end()) << "block " << where.first << " pool " << where.second;
    size_t at = 0;
    while (at < bytes.size() && bytes[at] == it->second[at]) ++at;
    EXPECT_EQ(at, bytes.size()) << "block " << where.first << " pool " << where.second
                                << " differs at byte " << at << " of " << bytes.size();
  }
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

// Decodes p tokens and suspends there (`before` runs just before the suspend).
Suspended DecodeAndSuspend(Stack& s, uint64_t p,
                           const std::function<void(const std::vector<TokenId>&)>& before = nullptr) {
  Suspended r;
  SequenceId seq = s.cache->CreateSequence().value();
  EXPECT_TRUE(s.cache->AppendTokens(seq, r.tokens).ok());
  const Status st = Decode(s, seq, p, &r.tokens, &r.digests);
  EXPECT_TRUE(st.ok()) << st.ToString();
  if (before) before(r.tokens);
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

// The digests of the full blocks of `tokens`.
std::vector<BlockDigest> DigestsOf(Stack& s, const std::vector<TokenId>& tokens) {
  SequenceId probe = s.cache->CreateSequence().value();
  EXPECT_TRUE(s.cache->AppendTokens(probe, tokens).ok());
  std::vector<BlockDigest> d = s.cache->BlockDigests(probe).value();
  EXPECT_TRUE(s.cache->Free(probe).ok());
  return d;
}

// Erases blocks [from, to) of `tokens` from every tier: their whole bundles, and with `history`
// their history records too.
void EraseBlocks(Stack& s, const std::vector<TokenId>& tokens, uint32_t from, uint32_t to, bool history) {
  s.cache->WaitIdle();
  const std::vector<BlockDigest> d = DigestsOf(s, tokens);
  std::vector<BundleKey> keys;
  for (uint32_t b = from; b < to && b < d.size(); ++b) {
    keys.push_back(BundleKey{0, d[b].hash});
    if (history && !(s.cache->HistoryKey(d[b]) == keys.back())) keys.push_back(s.cache->HistoryKey(d[b]));
  }
  for (const Status& st : s.chain->Erase(keys).get()) EXPECT_TRUE(st.ok()) << st.ToString();
}

// Parameters: V4 (else V3.2); history (write-back: Suspend writes the blocks, as history records
// where the model has boundary pools, and a resume "from the chain" finds only those: the whole
// bundles that L1's eviction demotes are erased).
class SuspendResume : public ::testing::TestWithParam<std::tuple<bool, bool>> {
 protected:
  bool v4() const { return std::get<0>(GetParam()); }
  bool history() const { return std::get<1>(GetParam()); }
  WritePolicy policy() const { return history() ? WritePolicy::kWriteBack : WritePolicy::kWriteThrough; }
};

TEST_P(SuspendResume, ContinuesBitIdenticalAtBlockAndCompressionEdges) {
  const bool v4 = this->v4();
  // 1, 3, 4, 5, 127, 128, 129 tokens into the first and the second block (V4's ratio-4 edge
  // at 4, its ratio-128 and the block edge at 128 and 256).
  const std::vector<uint64_t> positions = {1, 3, 4, 5, 127, 128, 129, 131, 132, 133, 255, 256, 257};
  const std::vector<uint64_t> ref = Reference(v4, 257 + kContinue);
  testing::TempDir dir("suspend");
  Stack s = Build(v4, dir.path(), policy());
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
    if (history() && v4) {
      EXPECT_EQ(r.info.history_blocks, r.info.written_blocks);
    }
    if (!history()) {
      EXPECT_EQ(r.info.written_blocks, 0u) << "write-through stored them as they filled";
    }
    if (from_chain) {
      s.cache->WaitIdle();
      s.cache->Evict(kL1Blocks);
      ASSERT_EQ(s.manager->Stats().cached_blocks, 0u);
      if (history() && v4) EraseBlocks(s, r.tokens, 0, static_cast<uint32_t>(p / kBlockTokens), /*history=*/false);
    }
    auto res = s.cache->Resume({}, r.tokens, p);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
    EXPECT_EQ(res->restored_tokens, p);
    // The tail serves a partial block, and V4's window and state at an edge L1 cannot give.
    EXPECT_EQ(res->tail_restored, p % kBlockTokens != 0 || (v4 && from_chain && p >= kBlockTokens));
    if (from_chain) {
      EXPECT_EQ(res->lower_blocks, p / kBlockTokens);
    }
    EXPECT_EQ(s.manager->GetSequenceInfo(res->seq)->computed_tokens, p);
    ASSERT_NO_FATAL_FAILURE(ExpectSamePages(r.pages, Snapshot(*s.manager, res->seq)));
    ASSERT_NO_FATAL_FAILURE(ExpectContinues(s, res->seq, &r.tokens, ref, p));
    ASSERT_TRUE(s.cache->Free(res->seq).ok());
    ASSERT_TRUE(s.manager->CheckInvariants().ok());
  }
}

// A tail record that cannot be used ends the exact state at the block edge before it: the
// resume says so, and computing the rest again gives the uninterrupted digests.
TEST_P(SuspendResume, MissingWrongOrDamagedTailRecomputesFromTheBlockEdge) {
  const bool v4 = this->v4();
  const uint64_t p = 133;
  const std::vector<uint64_t> ref = Reference(v4, p + kContinue);
  testing::TempDir dir("suspend_tail");
  Stack s = Build(v4, dir.path(), policy());
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
    ASSERT_NO_FATAL_FAILURE(ExpectContinues(s, res->seq, &r.tokens, ref, p));
    ASSERT_TRUE(s.cache->Free(res->seq).ok());
  }
  if (!s.fs->Stats().flipped_bits) ADD_FAILURE() << "the damaged read was never made";
}

// A prefix block evicted from L1 and erased from every tier since the suspension: the resume
// restores the blocks before it and says how many tokens to compute again.
TEST_P(SuspendResume, PrefixBlockGoneFromEveryTierRecomputesFromIt) {
  const bool v4 = this->v4();
  const uint64_t p = 3 * kBlockTokens + 5;
  const std::vector<uint64_t> ref = Reference(v4, p + kContinue);
  testing::TempDir dir("suspend_gone");
  Stack s = Build(v4, dir.path(), policy());
  Suspended r = DecodeAndSuspend(s, p);
  s.cache->WaitIdle();
  s.cache->Evict(kL1Blocks);
  // Block 1 in every form; with history, the whole bundles of the others too (the history
  // records and the tail remain, and cannot reach past block 1).
  EraseBlocks(s, r.tokens, 1, 2, /*history=*/true);
  if (history() && v4) EraseBlocks(s, r.tokens, 0, 3, /*history=*/false);
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  // V4's block 0 alone is a resume point only as a whole bundle.
  const uint64_t exact = history() && v4 ? 0 : kBlockTokens;
  EXPECT_EQ(res->restored_tokens, exact);
  EXPECT_EQ(res->recompute_tokens, p - exact);
  EXPECT_EQ(s.manager->GetSequenceInfo(res->seq)->slot_tokens, exact) << "no slots left past the exact state";
  EXPECT_FALSE(res->tail_restored);
  EXPECT_NE(res->lost.find(exact ? "block 1" : "block 0"), std::string::npos) << res->lost;
  ASSERT_TRUE(s.manager->CheckInvariants().ok()) << s.manager->CheckInvariants().ToString();
  std::vector<uint64_t> again;
  ASSERT_TRUE(Recompute(s, res->seq, r.tokens, exact, p, &again).ok());
  EXPECT_EQ(again, std::vector<uint64_t>(ref.begin() + static_cast<long>(exact), ref.begin() + static_cast<long>(p)));
  ASSERT_NO_FATAL_FAILURE(ExpectContinues(s, res->seq, &r.tokens, ref, p));
}

// Write-back: nothing reached the tiers before the suspend, and V4's window and snapshot pages
// of older blocks left the sequence early (they are the cached blocks' only): Suspend writes
// every block whole, and a resume with L1 emptied restores them all.
TEST_P(SuspendResume, WriteBackSuspendWritesEveryBlock) {
  const bool v4 = this->v4();
  const uint64_t p = 3 * kBlockTokens + 5;
  const std::vector<uint64_t> ref = Reference(v4, p + kContinue);
  testing::TempDir dir("suspend_wb");
  Stack s = Build(v4, dir.path(), WritePolicy::kWriteBack);
  Suspended r = DecodeAndSuspend(s, p);
  EXPECT_EQ(r.info.written_blocks, 3u);
  EXPECT_EQ(r.info.history_blocks, v4 ? 3u : 0u);
  EXPECT_EQ(r.info.unsaved_blocks, 0u);
  ASSERT_TRUE(s.manager->CheckInvariants().ok()) << s.manager->CheckInvariants().ToString();
  s.cache->Evict(kL1Blocks);
  s.cache->WaitIdle();
  ASSERT_EQ(s.manager->Stats().cached_blocks, 0u);
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
  EXPECT_EQ(res->lower_blocks, 3u);
  ASSERT_NO_FATAL_FAILURE(ExpectContinues(s, res->seq, &r.tokens, ref, p));
  ASSERT_TRUE(s.cache->Free(res->seq).ok());
  ASSERT_TRUE(s.manager->CheckInvariants().ok());
}

INSTANTIATE_TEST_SUITE_P(Models, SuspendResume,
                         ::testing::Combine(::testing::Values(false, true), ::testing::Values(false, true)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "V4" : "V32") +
                                  (std::get<1>(info.param) ? "History" : "WriteThrough");
                         });

TEST(Suspend, ConversationCostsItsBlocksOncePlusOneTail) {
  testing::TempDir dir("suspend_conv");
  Stack s = Build(true, dir.path());
  std::vector<TokenId> tokens{11};
  std::optional<BlockHash> previous;
  uint64_t written = 0, tails = 0;
  for (int turn = 0; turn < 6; ++turn) {
    SuspendInfo info;
    ASSERT_NO_FATAL_FAILURE(ConversationTurn(s, tokens, 70, previous, info));
    written += info.written_bytes;
    tails += info.tail_bytes;
  }
  // 421 tokens: 3 full blocks, each written once (write-through stored them as they filled, so
  // Suspend wrote none of them), and the tails.
  EXPECT_EQ(written, tails);
  auto key = s.cache->SuspensionKey({}, tokens, tokens.size() - 1);
  ASSERT_TRUE(key.ok());
  ASSERT_TRUE(previous.has_value());
  EXPECT_EQ(*key, *previous);
}

// A V4 sequence far longer than L1's window and state pools (2 blocks each) suspends as history
// records and resumes from them into that L1: only the boundary pages the tail holds are
// allocated, and decoding goes on bit for bit.
TEST(Suspend, LongV4SequenceResumesFromHistoryIntoSmallBoundaryPools) {
  const uint64_t p = 9 * kBlockTokens + 77;
  const std::vector<uint64_t> ref = Reference(true, p + kContinue);
  testing::TempDir dir("suspend_long");
  Stack s = Build(true, dir.path(), WritePolicy::kWriteBack, /*l1_blocks=*/12, /*boundary_blocks=*/2);
  // The blocks whose window pages L1 evicted while decoding were demoted whole: erased, so the
  // suspend writes every block as a history record.
  Suspended r = DecodeAndSuspend(s, p, [&](const std::vector<TokenId>& t) { EraseBlocks(s, t, 0, 9, false); });
  ASSERT_EQ(r.digests, std::vector<uint64_t>(ref.begin(), ref.begin() + static_cast<long>(p)));
  EXPECT_EQ(r.info.history_blocks, 9u);
  s.cache->WaitIdle();
  s.cache->Evict(12);
  ASSERT_EQ(s.manager->Stats().cached_blocks, 0u);
  EraseBlocks(s, r.tokens, 0, 9, /*history=*/false);  // whole copies the eviction demoted
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
  EXPECT_EQ(res->lower_blocks, 9u);
  EXPECT_TRUE(res->tail_restored);
  EXPECT_EQ(s.cache->Stats().restore_no_room, 0u);
  ASSERT_TRUE(s.manager->CheckInvariants().ok()) << s.manager->CheckInvariants().ToString();
  ASSERT_NO_FATAL_FAILURE(ExpectSamePages(r.pages, Snapshot(*s.manager, res->seq)));
  ASSERT_NO_FATAL_FAILURE(ExpectContinues(s, res->seq, &r.tokens, ref, p));
  ASSERT_TRUE(s.cache->Free(res->seq).ok());
  ASSERT_TRUE(s.manager->CheckInvariants().ok());
}

// Write-back, window and state pools of two pages: as a long V4 sequence runs, L1 evicts its
// older blocks' window and state pages. Whole demotes of those (the default) leave a resume point
// at each edge; without them (demote_on_boundary_eviction false) nothing is written then. Either
// way the blocks' own eviction later demotes their history records: through the eviction hook
// when a second run's allocations evict them (no evict-ahead here), through EvictAhead when
// Evict does. The second run suspends, and with the whole bundles erased resumes exactly from
// the history records.
TEST(Suspend, WriteBackEvictionKeepsTheHistoryOfBlocksWithoutTheirEdges) {
  const uint64_t p = 6 * kBlockTokens + 9;
  const std::vector<uint64_t> ref = Reference(true, p + kContinue);
  for (const bool whole_demotes : {true, false}) {
    SCOPED_TRACE(whole_demotes ? "demote on boundary eviction" : "no demote on boundary eviction");
    testing::TempDir dir("suspend_evict_history");
    Stack s = Build(true, dir.path(), WritePolicy::kWriteBack, /*l1_blocks=*/8, /*boundary_blocks=*/2,
                    whole_demotes, /*evict_ahead_blocks=*/0);
    std::vector<TokenId> tokens{11};
    {
      SequenceId a = s.cache->CreateSequence().value();
      ASSERT_TRUE(s.cache->AppendTokens(a, tokens).ok());
      ASSERT_TRUE(Decode(s, a, p, &tokens, nullptr).ok());
      ASSERT_TRUE(s.cache->Free(a).ok());
    }
    Suspended r = DecodeAndSuspend(s, p);  // its allocations evict the first run's blocks
    ASSERT_EQ(r.tokens, tokens);
    const uint64_t by_hook = s.cache->Stats().evicted_history;
    EXPECT_GE(by_hook, 1u) << "the second run's allocations evicted blocks without their edges";
    s.cache->WaitIdle();
    s.cache->Evict(8);
    s.cache->WaitIdle();
    ASSERT_EQ(s.manager->Stats().cached_blocks, 0u);
    const OffloadedCacheStats st = s.cache->Stats();
    const std::vector<BlockDigest> d = DigestsOf(s, tokens);
    std::vector<BundleKey> whole, hist;
    for (uint32_t b = 0; b < 6; ++b) {
      whole.push_back(BundleKey{0, d[b].hash});
      hist.push_back(s.cache->HistoryKey(d[b]));
    }
    const std::vector<int> at_whole = s.chain->Locate(whole), at_hist = s.chain->Locate(hist);
    // Every block is in the chain in one form or the other (a block the second run computed
    // again while the first's was cached gave it back its window and state: it went whole).
    std::vector<BundleKey> erase;
    for (uint32_t b = 0; b < 6; ++b) {
      EXPECT_TRUE(at_whole[b] >= 0 || at_hist[b] >= 0) << b;
      if (at_hist[b] >= 0 && at_whole[b] >= 0) erase.push_back(whole[b]);
    }
    EXPECT_GE(st.evicted_history, by_hook);
    EXPECT_EQ(st.boundary_evictions_not_demoted > 0, !whole_demotes);
    // Where a history record exists the whole bundle goes, so the resume mixes the two.
    for (const Status& e : s.chain->Erase(erase).get()) ASSERT_TRUE(e.ok());
    auto res = s.cache->Resume({}, r.tokens, p);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
    EXPECT_EQ(res->lower_blocks, 6u);
    ASSERT_NO_FATAL_FAILURE(ExpectContinues(s, res->seq, &r.tokens, ref, p));
    ASSERT_TRUE(s.cache->Free(res->seq).ok());
  }
}

// History records are no resume point: neither a lookup nor a prefix hit takes them (a V4
// prefix needs the window and state at its edge), while Resume with the tail restores it all.
TEST(Suspend, HistoryRecordsAreNoPrefixHit) {
  const uint64_t p = 3 * kBlockTokens + 9;
  testing::TempDir dir("suspend_nohit");
  Stack s = Build(true, dir.path(), WritePolicy::kWriteBack);
  Suspended r = DecodeAndSuspend(s, p);
  s.cache->WaitIdle();
  s.cache->Evict(kL1Blocks);
  EraseBlocks(s, r.tokens, 0, 3, /*history=*/false);
  PrefixQuery q;
  q.tokens = r.tokens;
  auto look = s.cache->LookupPrefix(q);
  ASSERT_TRUE(look.ok());
  EXPECT_EQ(look->blocks, 0u);
  SequenceId seq = s.cache->CreateSequence().value();
  ASSERT_TRUE(s.cache->AppendTokens(seq, r.tokens).ok());
  auto hit = s.cache->AcquirePrefix(seq);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->blocks, 0u);
  ASSERT_TRUE(s.cache->Free(seq).ok());
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
  ASSERT_TRUE(s.cache->Free(res->seq).ok());
}

// Write-back, so Suspend writes the blocks itself: a V4 conversation suspended after every turn
// costs each block once, as a history record (its full-history kinds only), plus the tails; the
// tier holds the blocks and the one live tail.
TEST(Suspend, V4ConversationStoresHistoryOncePlusOneLiveTail) {
  testing::TempDir dir("suspend_conv_wb");
  Stack s = Build(true, dir.path(), WritePolicy::kWriteBack);
  uint64_t history_bytes = 0;
  {
    std::vector<uint64_t> sizes;
    for (const auto& g : s.manager->geometry().pools)
      sizes.push_back(IsFullHistoryKind(g.spec.kind) ? g.block_stride : 0);
    sizes.push_back(16);
    history_bytes = BundleRecordBytes(sizes);
  }
  std::vector<TokenId> tokens{11};
  std::optional<BlockHash> previous;
  uint64_t written = 0, tails = 0, last_tail = 0;
  uint32_t blocks = 0;
  for (int turn = 0; turn < 6; ++turn) {
    SuspendInfo info;
    ASSERT_NO_FATAL_FAILURE(ConversationTurn(s, tokens, 70, previous, info));
    EXPECT_EQ(info.history_blocks, info.written_blocks);
    blocks += info.written_blocks;
    written += info.written_bytes;
    tails += info.tail_bytes;
    last_tail = info.tail_bytes;
  }
  EXPECT_EQ(blocks, (tokens.size() - 1) / kBlockTokens);
  EXPECT_EQ(written, blocks * history_bytes + tails);
  s.cache->WaitIdle();
  // The SSD tier under write-through: every history record and the last tail, nothing else
  // (L1 has not evicted anything, so no whole bundle was demoted).
  EXPECT_EQ(s.chain->tier(1).Stats().items, blocks + 1);
  EXPECT_EQ(s.chain->tier(1).Stats().bytes, blocks * history_bytes + last_tail);
}

// A tail written by the previous version (1: no window or state pages; its blocks were whole)
// still resumes.
TEST(Suspend, VersionOneTailStillResumes) {
  const uint64_t p = 133;
  const std::vector<uint64_t> ref = Reference(true, p + kContinue);
  testing::TempDir dir("suspend_v1");
  Stack s = Build(true, dir.path());
  Suspended r = DecodeAndSuspend(s, p);
  s.cache->WaitIdle();
  s.cache->Evict(kL1Blocks);
  const BundleKey key{0, r.info.tail};
  BundlePtr v2 = s.chain->Promote({key}).get()[0].value();
  // Version 1: the 48-byte header, the tokens, the partial block's pages; no window page.
  std::vector<std::byte> header(v2->segment(0).begin(), v2->segment(0).begin() + 48);
  const uint16_t one = 1;
  std::memcpy(header.data() + 4, &one, sizeof one);
  std::vector<std::span<const std::byte>> segs{header, v2->segment(1)};
  for (size_t pool = 0; pool < s.manager->num_pools(); ++pool) segs.push_back(v2->segment(static_cast<uint32_t>(2 + pool)));
  ASSERT_GT(v2->segment_count(), segs.size()) << "the version 2 tail holds the window page of block 0";
  ASSERT_TRUE(s.chain->Demote({Bundle::Make(key, segs, s.chain->NextSequence()).value()}).get()[0].ok());
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->recompute_tokens, 0u) << res->lost;
  EXPECT_TRUE(res->tail_restored);
  ASSERT_NO_FATAL_FAILURE(ExpectContinues(s, res->seq, &r.tokens, ref, p));
}

// A version-2 tail whose header claims fewer window pages than the state needs (a foreign or
// damaged writer whose checksum holds) is not used: the resume goes back to the whole bundles'
// edge instead of leaving the window's first rows unrestored.
TEST(Suspend, ATailShortOfWindowPagesIsNotUsed) {
  const uint64_t p = 133;
  testing::TempDir dir("suspend_short_tail");
  Stack s = Build(true, dir.path());
  Suspended r = DecodeAndSuspend(s, p);
  s.cache->WaitIdle();
  s.cache->Evict(kL1Blocks);
  const BundleKey key{0, r.info.tail};
  BundlePtr v2 = s.chain->Promote({key}).get()[0].value();
  std::vector<std::byte> header(v2->segment(0).begin(), v2->segment(0).end());
  ASSERT_EQ(header.size(), 64u);
  uint32_t first = 0, blocks = 0;
  std::memcpy(&first, header.data() + 48, 4);
  std::memcpy(&blocks, header.data() + 52, 4);
  ASSERT_EQ(first, 0u);
  ASSERT_EQ(blocks, 1u);
  first = 1;
  blocks = 0;
  std::memcpy(header.data() + 48, &first, 4);
  std::memcpy(header.data() + 52, &blocks, 4);
  std::vector<std::span<const std::byte>> segs{header, v2->segment(1)};
  for (size_t pool = 0; pool < s.manager->num_pools(); ++pool) segs.push_back(v2->segment(static_cast<uint32_t>(2 + pool)));
  ASSERT_TRUE(s.chain->Demote({Bundle::Make(key, segs, s.chain->NextSequence()).value()}).get()[0].ok());
  auto res = s.cache->Resume({}, r.tokens, p);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_FALSE(res->tail_restored);
  EXPECT_EQ(res->restored_tokens, kBlockTokens);
  EXPECT_NE(res->lost.find("window pages"), std::string::npos) << res->lost;
  ASSERT_TRUE(s.manager->CheckInvariants().ok()) << s.manager->CheckInvariants().ToString();
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
