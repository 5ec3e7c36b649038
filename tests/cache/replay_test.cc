// Trace replay: the real Mooncake conversation trace against the figures of an independent
// simulation (the issue's), a synthetic trace against a reference model written here, the trace
// parser's errors, and the `sparsekv replay` / `sparsekv bench cache` commands end to end.
#include "replay.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <list>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <unordered_map>

#include "cache_bench.h"
#include "prefix_sim.h"

namespace sparsekv::bench {
namespace {

// The trace beside the checkout (DESIGN.md), or where SPARSEKV_MOONCAKE_TRACE points.
std::string TracePath() {
  const char* env = std::getenv("SPARSEKV_MOONCAKE_TRACE");
  return env != nullptr && *env != '\0' ? env : SPARSEKV_TRACE_PATH;
}

bool HaveTrace() {
  return std::filesystem::exists(TracePath());
}

const std::vector<TraceRequest>& RealTrace() {
  static const std::vector<TraceRequest> trace = [] {
    auto t = LoadMooncakeTrace(TracePath());
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : std::vector<TraceRequest>{};
  }();
  return trace;
}

// Replays the whole trace at one capacity under LRU and holds hit_blocks to the issue's figure.
void ExpectFigure(uint64_t capacity, uint64_t want_hits) {
  if (!HaveTrace()) GTEST_SKIP() << "no trace at " << TracePath();
  ReplayOptions o;
  o.capacity_blocks = capacity;
  o.eviction = EvictionPolicyKind::kLru;
  auto r = RunReplay(RealTrace(), o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->requests, 12031u);
  EXPECT_EQ(r->blocks, 288500u);
  EXPECT_EQ(r->failed_requests, 0u);
  const double want = static_cast<double>(want_hits);
  EXPECT_LE(std::abs(static_cast<double>(r->hit_blocks) - want), 0.005 * want)
      << "hit_blocks " << r->hit_blocks << " vs " << want_hits;
  EXPECT_EQ(r->hit_blocks, want_hits);  // the semantics are the same: exactly
  const nlohmann::json j = ReplayResultToJson(*r, o);
  EXPECT_DOUBLE_EQ(j["block_hit_ratio"].get<double>(), want / 288500.0);
  EXPECT_DOUBLE_EQ(j["token_hit_ratio"].get<double>(),
                   want * 512 / static_cast<double>(r->input_tokens));
  if (capacity == 0) {
    EXPECT_EQ(r->evicted_blocks, 0u);
  }
  std::printf("capacity %llu: hit_blocks %llu in %.3f s (%.2f M blocks/s)\n",
              static_cast<unsigned long long>(capacity),
              static_cast<unsigned long long>(r->hit_blocks), r->seconds,
              r->BlocksPerSecond() / 1e6);
}

TEST(MooncakeReplay, Capacity1000Hits12988) {
  ExpectFigure(1000, 12988);
}
TEST(MooncakeReplay, Capacity5859Hits40640) {
  ExpectFigure(5859, 40640);
}
TEST(MooncakeReplay, Capacity20000Hits84689) {
  ExpectFigure(20000, 84689);
}
TEST(MooncakeReplay, UnlimitedHits105592) {
  ExpectFigure(0, 105592);
}

// Issue 34: the default policy against LRU on the conversation trace, without hints and with the
// next 64 requests hinted, in the same run; Belady's MIN bounds every one.
TEST(MooncakeReplay, DefaultPolicyKeepsMoreHitsThanLru) {
  if (!HaveTrace()) GTEST_SKIP() << "no trace at " << TracePath();
#if SPARSEKV_SANITIZED
  // A sanitizer makes each replay take many seconds: the first 2,000 requests, bounds only.
  const std::span<const TraceRequest> trace(RealTrace().data(), 2000);
  const bool figures = false;
#else
  const std::span<const TraceRequest> trace(RealTrace());
  const bool figures = true;
#endif
  const struct {
    uint64_t capacity;
    double plain, hinted;  // the floors, relative to LRU without hints
  } want[] = {{1000, 1.2, 1.4}, {5859, 1.1, 1.25}, {20000, 0.99, 0.99}, {0, 0.99, 0.99}};
  for (const auto& w : want) {
    ReplayOptions o;
    o.capacity_blocks = w.capacity;
    o.eviction = EvictionPolicyKind::kLru;
    auto lru = RunReplay(trace, o);
    o.lookahead = 64;
    auto lru_hinted = RunReplay(trace, o);
    o.eviction = kDefaultEvictionPolicy;
    auto hinted = RunReplay(trace, o);
    o.lookahead = 0;
    auto plain = RunReplay(trace, o);
    auto opt = SimulatePrefixCache(trace, w.capacity, SimPolicy::kBelady);
    ASSERT_TRUE(lru.ok() && lru_hinted.ok() && hinted.ok() && plain.ok() && opt.ok());
    const double l = static_cast<double>(lru->hit_blocks);
    std::printf("capacity %llu: %s %.3fx LRU, with the next 64 hinted %.3fx (LRU hinted %.3fx), Belady %.3fx; "
                "%.2f M blocks/s, %.2f M blocks/s hinted\n",
                static_cast<unsigned long long>(w.capacity), std::string(EvictionPolicyName(kDefaultEvictionPolicy)).c_str(),
                plain->hit_blocks / l, hinted->hit_blocks / l, lru_hinted->hit_blocks / l, opt->hit_blocks / l,
                plain->BlocksPerSecond() / 1e6, hinted->BlocksPerSecond() / 1e6);
    for (const auto* r : {&*lru, &*lru_hinted, &*hinted, &*plain}) {
      EXPECT_LE(r->hit_blocks, opt->hit_blocks) << "capacity " << w.capacity << ": above the optimum";
    }
    EXPECT_EQ(hinted->hints, trace.size() - 1) << "every request but the first was hinted";
    if (!figures) continue;
    EXPECT_GE(plain->hit_blocks / l, w.plain) << "capacity " << w.capacity;
    EXPECT_GE(hinted->hit_blocks / l, w.hinted) << "capacity " << w.capacity;
    if (w.capacity == 1000 || w.capacity == 5859) {
      EXPECT_GT(hinted->hit_blocks, lru_hinted->hit_blocks) << "more than hints under LRU give";
    }
    // The offline model's ARC (bench/prefix_sim.h, written apart, without the chain rule) keeps
    // the same hits on this trace: the rule changes nothing here, and the manager's lists, ghosts
    // and adaptation are ARC's.
    PrefixSimOptions so;
    so.capacity_blocks = w.capacity;
    so.policy = SimPolicy::kArc;
    auto sim = SimulatePrefixCache(trace, so);
    ASSERT_TRUE(sim.ok());
    if (kDefaultEvictionPolicy == EvictionPolicyKind::kArc) {
      EXPECT_EQ(sim->hit_blocks, plain->hit_blocks) << "capacity " << w.capacity;
    }
  }
}

TEST(Replay, ModelsWithSeveralPoolsGiveTheSameHitsOnTheRealTrace) {
  // Every pool has the same capacity, and V4's window and snapshot pages of a finished request's
  // last block are kept, so the multi-pool models hit exactly where the single-kind one does.
  if (!HaveTrace()) GTEST_SKIP();
#if SPARSEKV_SANITIZED
  const size_t n = 2000;  // a sanitizer makes the whole trace take seconds per model
#else
  const size_t n = RealTrace().size();
#endif
  const std::span<const TraceRequest> trace(RealTrace().data(), n);
  ReplayOptions single;
  single.capacity_blocks = 1000;
  auto want = RunReplay(trace, single);
  ASSERT_TRUE(want.ok());
  for (const char* model : {"deepseek-v3.2-exp", "deepseek-v4-flash"}) {
    ReplayOptions o = single;
    o.spec = *ModelPreset(model);
    auto r = RunReplay(trace, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->hit_blocks, want->hit_blocks) << model;
  }
}

[[maybe_unused]] double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

TEST(Replay, IsFastEnough) {
  // The issue asks for a million blocks per second, hashing included, on an optimized build.
  // Counted in this thread's CPU time, so that other jobs on the machine (ctest -j, builds) do
  // not make the test flaky; the wall-clock figure is what `sparsekv replay` prints.
  if (!HaveTrace()) GTEST_SKIP();
#if SPARSEKV_SANITIZED || !defined(NDEBUG)
  GTEST_SKIP() << "timing is meaningless in sanitizer and debug builds";
#else
  ReplayOptions o;
  o.capacity_blocks = 5859;
  double best = 0, best_wall = 0;
  for (int i = 0; i < 3; ++i) {
    const double t0 = ThreadCpuSeconds();
    auto r = RunReplay(RealTrace(), o);
    const double cpu = ThreadCpuSeconds() - t0;
    ASSERT_TRUE(r.ok());
    best = std::max(best, static_cast<double>(r->blocks) / cpu);
    best_wall = std::max(best_wall, r->BlocksPerSecond());
  }
  EXPECT_GE(best, 1e6);
  std::printf("replay: %.2f M blocks per CPU second (%.2f M/s wall clock)\n", best / 1e6,
              best_wall / 1e6);
#endif
}

// ---- a reference model of the replay's semantics, independent of the cache manager ----

// LRU over block keys; a key is the chain of trace hash ids up to the block (the trace's own
// prefix identity). Partial blocks are never cached, free pages are used before cached ones, a
// request's blocks are released tail first, and at least one token is computed.
uint64_t ReferenceHits(const std::vector<TraceRequest>& trace, uint64_t capacity, uint32_t bt) {
  std::list<uint64_t> lru;  // front: least recently released
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> cached;
  uint64_t free_pages = capacity ? capacity : UINT64_MAX / 2;
  uint64_t hits = 0;
  for (const TraceRequest& r : trace) {
    if (r.input_length == 0) continue;
    const uint64_t total = (r.input_length + bt - 1) / bt, full = r.input_length / bt;
    std::vector<uint64_t> keys;
    uint64_t h = 0x12345;
    for (uint64_t j = 0; j < full; ++j) {
      h = (h ^ r.hash_ids[j]) * 0x100000001b3ull + j;
      keys.push_back(h);
    }
    uint64_t k = 0;
    while (k < std::min(full, (r.input_length - 1) / bt) && cached.count(keys[k])) ++k;
    hits += k;
    for (uint64_t j = 0; j < k; ++j) {
      lru.erase(cached[keys[j]]);
      cached.erase(keys[j]);
    }
    for (uint64_t need = total - k; need > 0; --need) {
      if (free_pages > 0) {
        --free_pages;
      } else {
        cached.erase(lru.front());
        lru.pop_front();
      }
    }
    std::vector<bool> keep(total, false);
    std::set<uint64_t> mine(keys.begin(), keys.begin() + k);
    for (uint64_t j = 0; j < full; ++j) {
      if (j < k || (!cached.count(keys[j]) && mine.insert(keys[j]).second)) keep[j] = true;
    }
    for (uint64_t j = total; j-- > 0;) {
      if (keep[j]) {
        lru.push_back(keys[j]);
        cached[keys[j]] = std::prev(lru.end());
      } else {
        ++free_pages;
      }
    }
  }
  return hits;
}

std::vector<TraceRequest> SyntheticTrace(uint64_t seed, size_t n) {
  // Conversations that grow turn by turn, interleaved, with shared system prompts.
  std::mt19937_64 rng(seed);
  std::vector<std::vector<uint64_t>> convs(40);
  uint64_t next_id = 100;
  std::vector<TraceRequest> out;
  for (size_t i = 0; i < n; ++i) {
    auto& c = convs[rng() % convs.size()];
    if (c.empty()) c.push_back(rng() % 3);  // one of three system prompts
    const uint64_t grow = 1 + rng() % 6;
    for (uint64_t g = 0; g < grow; ++g) c.push_back(next_id++);
    TraceRequest r;
    r.hash_ids = c;
    r.input_length = (c.size() - 1) * 512 + 1 + rng() % 512;  // the last block partial (or full)
    out.push_back(r);
    if (rng() % 10 == 0 || c.size() > 30) c.clear();  // requests stay below the smallest capacity
  }
  return out;
}

// The offline model of bench/prefix_sim.h on the real trace: its LRU is the cache manager's, hit
// for hit (on synthetic traces: AgreesWithAReferenceModelOnASyntheticTrace), and Belady's MIN
// never keeps fewer hits than it, and as many when nothing is evicted.
TEST(PrefixSim, ItsLruIsTheCacheManagersAndBeladyBoundsIt) {
  if (!HaveTrace()) GTEST_SKIP() << "no trace at " << TracePath();
  // The real trace, at the issue's capacities (the manager's figures are the tests above).
  const std::pair<uint64_t, uint64_t> lru_figures[] = {{1000, 12988}, {5859, 40640}, {20000, 84689}, {0, 105592}};
  uint64_t last_opt = 0;
  for (auto [capacity, want] : lru_figures) {
    auto lru = SimulatePrefixCache(RealTrace(), capacity, SimPolicy::kLru);
    auto opt = SimulatePrefixCache(RealTrace(), capacity, SimPolicy::kBelady);
    ASSERT_TRUE(lru.ok() && opt.ok());
    EXPECT_EQ(lru->hit_blocks, want) << "capacity " << capacity;
    EXPECT_GT(opt->hit_blocks, capacity ? lru->hit_blocks : 0) << "capacity " << capacity;
    EXPECT_GE(opt->hit_blocks, last_opt) << "more room never keeps fewer hits";
    last_opt = opt->hit_blocks;
    std::printf("capacity %llu: LRU %llu, Belady %llu (%.2fx)\n", static_cast<unsigned long long>(capacity),
                static_cast<unsigned long long>(lru->hit_blocks), static_cast<unsigned long long>(opt->hit_blocks),
                static_cast<double>(opt->hit_blocks) / static_cast<double>(lru->hit_blocks));
  }
  EXPECT_EQ(last_opt, 105592u);
}

// What the model says of ARC and of hints on the conversation trace (the figures of issue 34's
// exploration): ARC keeps at least 1.2x LRU's hits at 1,000 blocks, 1.1x at 5,859 and never
// fewer than 0.99x; with the next 64 requests hinted, 1.4x and 1.25x; Belady bounds them all.
TEST(PrefixSim, ArcAndHintsOnTheConversationTrace) {
  if (!HaveTrace()) GTEST_SKIP() << "no trace at " << TracePath();
  const struct {
    uint64_t capacity;
    double arc, arc_hinted;
  } want[] = {{1000, 1.2, 1.4}, {5859, 1.1, 1.25}, {20000, 0.99, 0.99}, {0, 0.99, 0.99}};
  for (const auto& w : want) {
    PrefixSimOptions o;
    o.capacity_blocks = w.capacity;
    auto lru = SimulatePrefixCache(RealTrace(), o);
    o.policy = SimPolicy::kArc;
    auto arc = SimulatePrefixCache(RealTrace(), o);
    o.lookahead = 64;
    auto hinted = SimulatePrefixCache(RealTrace(), o);
    o.policy = SimPolicy::kBelady;
    o.lookahead = 0;
    auto opt = SimulatePrefixCache(RealTrace(), o);
    ASSERT_TRUE(lru.ok() && arc.ok() && hinted.ok() && opt.ok());
    const double l = static_cast<double>(lru->hit_blocks);
    std::printf("capacity %llu: ARC %.3fx LRU, ARC + lookahead 64 %.3fx, Belady %.3fx\n",
                static_cast<unsigned long long>(w.capacity), arc->hit_blocks / l, hinted->hit_blocks / l,
                opt->hit_blocks / l);
    EXPECT_GE(arc->hit_blocks / l, w.arc) << "capacity " << w.capacity;
    EXPECT_GE(hinted->hit_blocks / l, w.arc_hinted) << "capacity " << w.capacity;
    EXPECT_LE(arc->hit_blocks, opt->hit_blocks);
    EXPECT_LE(hinted->hit_blocks, opt->hit_blocks);
  }
}

TEST(PrefixSim, BadOptionsAreRefused) {
  PrefixSimOptions o;
  o.hint_bound = 1.5;
  EXPECT_EQ(SimulatePrefixCache(std::vector<TraceRequest>{}, o).status().code(), StatusCode::kInvalidArgument);
  o.hint_bound = 0.5;
  o.block_tokens = 0;
  EXPECT_EQ(SimulatePrefixCache(std::vector<TraceRequest>{}, o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSimPolicy("lfu").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseSimPolicy("arc"), SimPolicy::kArc);
}

TEST(PrefixSim, BeladyOnAHandMadeTrace) {
  // Prompts of one hittable block and a partial one (2 pages each), 3 pages in all, so two
  // blocks stay cached at most: A B C A B C. LRU always evicts the block needed next: no hit.
  // Belady keeps A and then C (their next uses come first): 2 hits.
  auto req = [](std::vector<uint64_t> ids) {
    TraceRequest r;
    r.hash_ids = std::move(ids);
    r.input_length = 512 * (r.hash_ids.size() - 1) + 1;
    return r;
  };
  const std::vector<TraceRequest> trace = {req({1, 90}), req({2, 91}), req({3, 92}), req({1, 93}), req({2, 94}),
                                           req({3, 95})};
  auto lru = SimulatePrefixCache(trace, 3, SimPolicy::kLru);
  auto opt = SimulatePrefixCache(trace, 3, SimPolicy::kBelady);
  ASSERT_TRUE(lru.ok() && opt.ok());
  EXPECT_EQ(lru->hit_blocks, 0u);
  EXPECT_EQ(opt->hit_blocks, 2u);
  PrefixSimOptions hinted;
  hinted.capacity_blocks = 3;
  hinted.lookahead = 3;
  hinted.hint_bound = 1.0;
  // LRU hinted with the next 3 requests: at requests 2 and 3 every candidate is hinted, so LRU's
  // own choice stands (A, then B go); at request 4 (B) C is hinted and A is not: A goes, and C
  // hits at request 5. One hit: more than LRU, fewer than Belady.
  auto h = SimulatePrefixCache(trace, hinted);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->hit_blocks, 1u);
  EXPECT_LE(h->hit_blocks, opt->hit_blocks);
  ReplayOptions o;
  o.capacity_blocks = 3;
  o.eviction = EvictionPolicyKind::kLru;
  auto r = RunReplay(trace, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->hit_blocks, lru->hit_blocks);
  TraceRequest bad = req({1, 2});
  bad.input_length = 5000;
  EXPECT_EQ(SimulatePrefixCache(std::vector<TraceRequest>{bad}, 3, SimPolicy::kLru).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Replay, AgreesWithAReferenceModelOnASyntheticTrace) {
  const auto trace = SyntheticTrace(5, 3000);
  for (uint64_t capacity : {40, 150, 600, 0}) {
    ReplayOptions o;
    o.capacity_blocks = capacity;
    o.eviction = EvictionPolicyKind::kLru;  // the reference model is LRU's
    auto r = RunReplay(trace, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->hit_blocks, ReferenceHits(trace, capacity, 512)) << "capacity " << capacity;
    EXPECT_GT(r->hit_blocks, 0u);
    // And the offline model of bench/prefix_sim.h too; Belady's MIN bounds it.
    auto lru = SimulatePrefixCache(trace, capacity, SimPolicy::kLru);
    auto opt = SimulatePrefixCache(trace, capacity, SimPolicy::kBelady);
    ASSERT_TRUE(lru.ok() && opt.ok());
    EXPECT_EQ(lru->hit_blocks, r->hit_blocks) << "capacity " << capacity;
    EXPECT_GE(opt->hit_blocks, lru->hit_blocks) << "capacity " << capacity;
    if (capacity == 0) {
      EXPECT_EQ(opt->hit_blocks, lru->hit_blocks);
      EXPECT_EQ(opt->evicted_blocks, 0u);
    }
  }
}

TEST(Replay, SmallerCacheBlocksThanTraceBlocks) {
  // 128-token cache blocks over 512-token trace blocks: four cache blocks per hash id.
  const auto trace = SyntheticTrace(9, 500);
  ReplayOptions o;
  o.block_tokens = 128;
  auto r = RunReplay(trace, o);
  ASSERT_TRUE(r.ok());
  ReplayOptions big;
  auto r512 = RunReplay(trace, big);
  ASSERT_TRUE(r512.ok());
  EXPECT_GE(r->hit_blocks, 4 * r512->hit_blocks);  // finer blocks hit at least as many tokens
}

TEST(Replay, SynthesizedTokensAreDeterministicAndDistinct) {
  std::vector<TokenId> a(512), b(512), c(512), part(100);
  SynthesizeBlockTokens(7, 0, a);
  SynthesizeBlockTokens(7, 0, b);
  SynthesizeBlockTokens(8, 0, c);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  SynthesizeBlockTokens(7, 3, part);  // any window of a block gives the same tokens
  EXPECT_TRUE(std::equal(part.begin(), part.end(), a.begin() + 3));
  SynthesizeBlockTokens(uint64_t{1} << 32, 0, a);
  SynthesizeBlockTokens(0, 0, b);
  EXPECT_NE(a[1], b[1]);  // ids differing only in the high word still differ
}

TEST(TraceParser, ReadsTheFormatAndNamesBadLines) {
  auto ok = ParseMooncakeTrace(
      "{\"timestamp\": 5, \"input_length\": 513, \"output_length\": 3, \"hash_ids\": [1, 2]}\n\n"
      "{\"input_length\": 10, \"hash_ids\": [1]}\n");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[0].timestamp, 5u);
  EXPECT_EQ((*ok)[0].hash_ids, (std::vector<uint64_t>{1, 2}));

  auto bad_json = ParseMooncakeTrace("{\"input_length\": 1, \"hash_ids\": [1]}\n{oops\n");
  ASSERT_FALSE(bad_json.ok());
  EXPECT_NE(bad_json.status().message().find("line 2"), std::string_view::npos);
  auto missing = ParseMooncakeTrace("{\"hash_ids\": []}");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("input_length"), std::string_view::npos);
  auto count = ParseMooncakeTrace("{\"input_length\": 1025, \"hash_ids\": [1, 2]}");
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("expected ceil(1025/512) = 3"), std::string_view::npos);
  auto negative = ParseMooncakeTrace("{\"input_length\": 4, \"hash_ids\": [-1]}");
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(LoadMooncakeTrace("/nonexistent/trace.jsonl").status().code(), StatusCode::kIOError);
}

// ---- the commands end to end ----

struct Outcome {
  int exit_code = -1;
  std::string out, err;
};

Outcome Cli(const std::string& args) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("sparsekv_replay_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string cmd = std::string(SPARSEKV_CLI_PATH) + " " + args + " >" +
                          (dir / "out").string() + " 2>" + (dir / "err").string();
  const int rc = std::system(cmd.c_str());
  Outcome o;
  o.exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::ifstream out(dir / "out"), err(dir / "err");
  std::stringstream so, se;
  so << out.rdbuf();
  se << err.rdbuf();
  o.out = so.str();
  o.err = se.str();
  return o;
}

TEST(ReplayCommand, PrintsTheIssuesFieldsAsJson) {
  if (!HaveTrace()) GTEST_SKIP();
  const Outcome r = Cli("replay --trace " + TracePath() +
                        " --block-tokens 512 --capacity-blocks 5859 --policy lru --json --progress");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["requests"], 12031);
  EXPECT_EQ(j["blocks"], 288500);
  EXPECT_EQ(j["hit_blocks"], 40640);
  for (const char* key : {"block_hit_ratio", "token_hit_ratio", "seconds"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_NE(r.err.find("100%"), std::string::npos);  // the progress bar went to stderr
  EXPECT_EQ(j["policy"], "lru");
  // The default policy with hints, and LRU in the same run for the ratio.
  const Outcome d = Cli("replay --trace " + TracePath() + " --capacity-blocks 5859 --lookahead 64 --vs-lru --json");
  ASSERT_EQ(d.exit_code, 0) << d.err;
  const auto k = nlohmann::json::parse(d.out);
  EXPECT_EQ(k["policy"], std::string(EvictionPolicyName(kDefaultEvictionPolicy)));
  EXPECT_EQ(k["lookahead"], 64);
  EXPECT_EQ(k["lru_hit_blocks"], 40640);
  EXPECT_GE(k["vs_lru"].get<double>(), 1.25);
  EXPECT_LE(k["hit_blocks"].get<uint64_t>(), k["belady_hit_blocks"].get<uint64_t>());
  const Outcome bad = Cli("replay --trace " + TracePath() + " --policy lfu");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("lru or arc"), std::string::npos) << bad.err;
}

TEST(ReplayCommand, PrintsASummaryWithoutJson) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("small_trace_" + std::to_string(getpid()) + ".jsonl");
  {
    std::ofstream out(path);
    for (const TraceRequest& r : SyntheticTrace(3, 200)) {
      out << nlohmann::json{{"timestamp", 0},
                            {"input_length", r.input_length},
                            {"output_length", 1},
                            {"hash_ids", r.hash_ids}}
                 .dump()
          << "\n";
    }
  }
  const Outcome text =
      Cli("replay --trace " + path.string() + " --capacity-blocks 50 --model deepseek-v4-flash");
  std::filesystem::remove(path);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("200 requests"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("hit blocks"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("M blocks/s"), std::string::npos) << text.out;
}

TEST(ReplayCommand, RejectsABadTraceWithTheLine) {
  const auto path =
      std::filesystem::temp_directory_path() / ("bad_trace_" + std::to_string(getpid()) + ".jsonl");
  std::ofstream(path) << "{\"input_length\": 10, \"hash_ids\": [1]}\n{\"input_length\": 10}\n";
  const Outcome r = Cli("replay --trace " + path.string() + " --json");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("line 2"), std::string::npos) << r.err;
  const Outcome model = Cli("replay --trace " + path.string() + " --model nope");
  EXPECT_EQ(model.exit_code, 1);
  std::filesystem::remove(path);
}

TEST(BenchCacheCommand, ReportsBothModels) {
  const Outcome r = Cli(
      "bench cache --json --rounds 1 --round-seconds 0.01 --prompt-blocks 4 --capacity-blocks 64");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* model : {"deepseek-v3.2-exp", "deepseek-v4-flash"}) {
    ASSERT_TRUE(j.contains(model)) << model;
    for (const char* key :
         {"lookups_per_s", "alloc_register_free_per_s", "hash_only_per_s", "pool_only_per_s"}) {
      EXPECT_GT(j[model][key].get<double>(), 0) << model << " " << key;
    }
    EXPECT_GT(j[model]["evicted_blocks"].get<uint64_t>(), 0u);
    // Every policy in the same run, each against LRU's.
    EXPECT_EQ(j[model]["policy"], std::string(EvictionPolicyName(kDefaultEvictionPolicy)));
    for (EvictionPolicyKind k : AllEvictionPolicies()) {
      const auto& pj = j[model]["policies"][std::string(EvictionPolicyName(k))];
      EXPECT_GT(pj["alloc_register_free_per_s"].get<double>(), 0) << model;
      EXPECT_GT(pj["evicted_blocks"].get<uint64_t>(), 0u) << model;
      if (k == EvictionPolicyKind::kLru) {
        EXPECT_DOUBLE_EQ(pj["alloc_register_free_vs_lru"].get<double>(), 1.0);
      }
    }
  }
  EXPECT_EQ(j["deepseek-v4-flash"]["pools"], 6);
}

}  // namespace
}  // namespace sparsekv::bench
