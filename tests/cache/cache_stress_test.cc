// Randomized stress of the CacheManager against its invariant checker (issue 16): allocate with
// and without lookahead (more and fewer slots than held), append, commit (also into blocks still
// shared with a fork), fork and forks of forks, free, lookup, pin, unpin, eviction pressure and
// reset, on DeepSeek-V3.2 (2 pools) and V4-Flash (6 pools), single-threaded and from 4 threads.
//
// After every operation: CheckInvariants (and the manager checks itself inside every changing
// call, check_invariants), the sequence's info against a model of what the engine asked for, and
// page contents: the test keeps a shadow of every page (one tag per token slot, the tag hashing
// the namespace and every token up to that one), writes it as an engine writes KV, performs the
// copies AllocateSlots lists, and checks every page of every hit against the tokens it stands for.
// So a hit on a page that was freed and reused, or written by a fork, is caught even where the
// bookkeeping agrees with itself.
//
// Seeded and bounded. SPARSEKV_CACHE_STRESS_OPS sets the operations per test (default 60,000, a
// couple of seconds for all four; 20,000 in the sanitizer builds), SPARSEKV_CACHE_STRESS_SEED the
// seed (default 16). The long run (README, "Prefix cache"):
//   SPARSEKV_CACHE_STRESS_OPS=1000000 build/test/tests/cache/sparsekv_cache_stress_tests
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <latch>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sparsekv/cache_manager.h"
#include "tests/cache/cache_test_util.h"

namespace sparsekv {
namespace {

using testing::MakeCache;

uint64_t EnvU64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

struct Preset {
  const char* model;
  uint32_t block_tokens;
  uint32_t capacity;         // full-history pools, per thread
  uint32_t window_capacity;  // 0: capacity
  uint32_t state_capacity;   // 0: capacity
  uint32_t family_blocks;    // length of the shared prompts
};

constexpr Preset kV32{"deepseek-v3.2-exp", 4, 24, 0, 0, 10};
// Fewer window and snapshot pages than full-history ones: boundary pages get evicted alone.
constexpr Preset kV4{"deepseek-v4-flash", 128, 24, 12, 14, 8};

const char* const kSalts[] = {"", "other"};

// What the test expects of one live sequence.
struct ModelSeq {
  SequenceId id = 0;
  uint32_t ns = 0;
  std::vector<TokenId> tokens;
  std::vector<uint64_t> tags;  // tags[i]: the tag of token i
  int family = -1;             // still a prefix of that family's prompt, or -1
  uint64_t computed = 0;
  uint64_t slots = 0;
  // Tokens below this are in blocks the sequence holds alone for sure: allocated since its last
  // fork. Commits beyond it may find a block still shared (refused) or not (accepted).
  uint64_t writable = 0;
};

struct Counters {
  std::atomic<uint64_t> ops{0}, calls{0}, hit_blocks{0}, alloc_refused{0}, commit_refused{0},
      cow_copies{0}, carry_copies{0}, forks{0}, resets{0}, pins{0}, checks{0};
};

class Stress {
 public:
  Stress(const Preset& p, int threads, EvictionPolicyKind policy)
      : preset_(p), bt_(p.block_tokens), threads_(threads) {
    CacheManagerOptions o;
    o.eviction = policy;
    o.max_hints = 16;  // hints run into the limit too
    o.block_tokens = p.block_tokens;
    o.capacity_blocks = p.capacity * threads;
    o.window_capacity_blocks = p.window_capacity * threads;
    o.state_capacity_blocks = p.state_capacity * threads;
    o.metadata_only = true;  // page contents live in the shadow below
    o.check_invariants = true;
    cache_ = MakeCache(*ModelPreset(p.model, KvPrecision::kFp8), o);
    shadow_.resize(cache_->num_pools());
    for (size_t q = 0; q < cache_->num_pools(); ++q)
      shadow_[q].assign(uint64_t{cache_->pool(q).capacity()} * bt_, 0);
    // Shared prompts: several requests (and threads) hit, extend and recompute the same blocks.
    std::mt19937_64 rng(4242);
    families_.resize(6);
    for (auto& f : families_) {
      f.resize(uint64_t{p.family_blocks} * bt_);
      for (TokenId& t : f) t = static_cast<TokenId>(rng() % 50000);
    }
  }

  CacheManager& cache() { return *cache_; }
  Counters& counters() { return counters_; }

  // Runs `ops` operations on this thread; false (with the reason in failure()) at the first
  // surprise.
  bool Run(uint64_t seed, uint64_t ops);

  bool Failed() const { return failed_.load(std::memory_order_relaxed); }
  std::string failure() {
    std::lock_guard<std::mutex> l(failure_mu_);
    return failure_;
  }

 private:
  class Worker;

  void Fail(std::string what) {
    std::lock_guard<std::mutex> l(failure_mu_);
    if (!failed_.exchange(true)) failure_ = std::move(what);
  }

  const Preset preset_;
  const uint32_t bt_;
  const int threads_;
  std::unique_ptr<CacheManager> cache_;
  std::vector<std::vector<TokenId>> families_;
  // [pool][page * block_tokens + slot]. Plain words: under TSan, two threads writing one page (a
  // page given to two holders) is a reported race.
  std::vector<std::vector<uint64_t>> shadow_;
  Counters counters_;
  std::atomic<bool> failed_{false};
  std::mutex failure_mu_;
  std::string failure_;
};

class Stress::Worker {
 public:
  Worker(Stress& st, uint64_t seed) : st_(st), c_(*st.cache_), bt_(st.bt_), rng_(seed) {}

  bool Step() {
    // (weight, operation); most operations fall back on another when they cannot apply.
    using Op = bool (Worker::*)();
    static constexpr std::pair<int, Op> kOps[] = {
        {10, &Worker::Create},  {12, &Worker::Append}, {22, &Worker::Allocate},
        {22, &Worker::Commit},  {7, &Worker::DoFork},  {10, &Worker::DoFree},
        {6, &Worker::Lookup},   {3, &Worker::Pin},     {3, &Worker::Unpin},
        {2, &Worker::Pressure}, {1, &Worker::DoReset}, {4, &Worker::Hint},
        {2, &Worker::DropHint}};
    int total = 0;
    for (const auto& op : kOps) total += op.first;
    int pick = static_cast<int>(rng_() % total);
    size_t i = 0;
    while (pick >= kOps[i].first) pick -= kOps[i++].first;
    return (this->*kOps[i].second)() && Check();
  }

  void FreeAll() {
    while (!seqs_.empty()) {
      (void)c_.Free(seqs_.back().id);
      seqs_.pop_back();
    }
    for (PinId p : pins_) (void)c_.Unpin(p);
    pins_.clear();
    for (HintId h : hints_) (void)c_.DropHint(h);
    hints_.clear();
  }

 private:
  static constexpr size_t kMaxLive = 5;

  bool Fail(const std::string& what) {
    st_.Fail(what);
    return false;
  }
  bool Expect(bool cond, const std::string& what) { return cond || Fail(what); }
  bool ExpectOk(const Status& s, const char* call) {
    return s.ok() || Fail(std::string(call) + ": " + s.ToString());
  }

  uint64_t Blocks(uint64_t tokens) const { return (tokens + bt_ - 1) / bt_; }
  uint64_t Rand(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  void PushTokens(ModelSeq& s, std::span<const TokenId> t) {
    for (TokenId x : t) {
      const uint64_t prev = s.tags.empty() ? Mix(0x5eed, s.ns) : s.tags.back();
      s.tokens.push_back(x);
      s.tags.push_back(Mix(prev, x));
    }
  }

  ModelSeq* PickSeq() { return seqs_.empty() ? nullptr : &seqs_[Rand(seqs_.size())]; }

  std::vector<PageId> Table(SequenceId id, size_t q) {
    std::vector<PageId> t;
    if (!c_.GetBlockTable(id, q, &t).ok()) Fail("GetBlockTable");
    ++st_.counters_.calls;
    return t;
  }

  // Every page of blocks [0, blocks) holds the tags of the tokens it stands for.
  bool VerifyPages(const ModelSeq& s, uint64_t blocks, const char* when) {
    for (size_t q = 0; q < c_.num_pools(); ++q) {
      const auto table = Table(s.id, q);
      for (uint64_t b = 0; b < blocks && b < table.size(); ++b) {
        if (table[b] == kInvalidPage) continue;
        const uint64_t* page = &st_.shadow_[q][uint64_t{table[b]} * bt_];
        for (uint32_t j = 0; j < bt_; ++j) {
          if (page[j] != s.tags[b * bt_ + j]) {
            return Fail(std::string(when) + ": pool " + std::to_string(q) + " block " +
                        std::to_string(b) + " page " + std::to_string(table[b]) + " slot " +
                        std::to_string(j) + " holds another token's KV");
          }
        }
      }
    }
    return true;
  }

  // The manager's view of the sequence against the model.
  bool Agree(const ModelSeq& s) {
    auto info = c_.GetSequenceInfo(s.id);
    ++st_.counters_.calls;
    if (!info.ok()) return Fail("GetSequenceInfo: " + info.status().ToString());
    const std::string who = "sequence " + std::to_string(s.id) + ": ";
    return Expect(info->tokens == s.tokens.size(), who + "tokens") &&
           Expect(info->computed_tokens == s.computed, who + "computed " +
                                                           std::to_string(info->computed_tokens) +
                                                           " vs " + std::to_string(s.computed)) &&
           Expect(info->slot_tokens == s.slots, who + "slots " + std::to_string(info->slot_tokens) +
                                                    " vs " + std::to_string(s.slots)) &&
           Expect(info->blocks == Blocks(s.slots), who + "blocks " + std::to_string(info->blocks) +
                                                       " for " + std::to_string(s.slots) +
                                                       " slots");
  }

  bool Check() {
    ++st_.counters_.checks;
    const Status s = c_.CheckInvariants();
    return s.ok() || Fail("CheckInvariants: " + s.ToString());
  }

  PrefixQuery FamilyQuery(std::vector<TokenId>* buf) {
    const auto& f = st_.families_[Rand(st_.families_.size())];
    buf->assign(f.begin(), f.begin() + 1 + Rand(f.size()));
    PrefixQuery q;
    q.namespace_salt = kSalts[Rand(8) == 0 ? 1 : 0];
    q.tokens = *buf;
    return q;
  }

  bool Create() {
    if (seqs_.size() >= kMaxLive) return DoFree();
    ModelSeq s;
    s.ns = Rand(8) == 0 ? 1 : 0;
    SequenceOptions so;
    so.namespace_salt = kSalts[s.ns];
    so.cache_blocks = Rand(16) != 0;
    auto id = c_.CreateSequence(so);
    ++st_.counters_.calls;
    if (!id.ok()) return Fail("CreateSequence: " + id.status().ToString());
    s.id = *id;
    const int f = static_cast<int>(Rand(st_.families_.size()));
    const auto& fam = st_.families_[f];
    const uint64_t len = 1 + Rand(fam.size() + bt_);
    if (len <= fam.size()) {
      PushTokens(s, std::span<const TokenId>(fam).first(len));
      s.family = f;
    } else {
      PushTokens(s, fam);
      RandomTokens(s, len - fam.size());
    }
    if (!ExpectOk(c_.AppendTokens(s.id, s.tokens), "AppendTokens")) return false;
    ++st_.counters_.calls;
    seqs_.push_back(std::move(s));
    ModelSeq& m = seqs_.back();
    if (Rand(8) != 0) {
      auto hit = c_.AcquireCachedPrefix(m.id);
      ++st_.counters_.calls;
      if (!hit.ok()) return Fail("AcquireCachedPrefix: " + hit.status().ToString());
      if (!Expect(hit->blocks <= (m.tokens.size() - 1) / bt_, "hit leaves no token to compute"))
        return false;
      m.computed = m.slots = m.writable = hit->tokens;
      st_.counters_.hit_blocks += hit->blocks;
      if (!VerifyPages(m, hit->blocks, "hit")) return false;
    }
    return Agree(m);
  }

  void RandomTokens(ModelSeq& s, uint64_t n) {
    std::vector<TokenId> t(n);
    for (TokenId& x : t) x = static_cast<TokenId>(50000 + rng_() % 1000000);
    PushTokens(s, t);
    s.family = -1;
  }

  bool Append() {
    ModelSeq* s = PickSeq();
    if (s == nullptr) return Create();
    if (s->tokens.size() > uint64_t{st_.preset_.family_blocks + 4} * bt_) return Commit();
    const uint64_t n = 1 + Rand(2 * bt_);
    const size_t before = s->tokens.size();
    const auto& fam = s->family >= 0 ? st_.families_[s->family] : st_.families_[0];
    if (s->family >= 0 && before < fam.size() && Rand(4) != 0) {
      const uint64_t take = std::min<uint64_t>(n, fam.size() - before);
      PushTokens(*s, std::span<const TokenId>(fam).subspan(before, take));
    } else {
      RandomTokens(*s, n);
    }
    const std::span<const TokenId> added(s->tokens.data() + before, s->tokens.size() - before);
    if (!ExpectOk(c_.AppendTokens(s->id, added), "AppendTokens")) return false;
    ++st_.counters_.calls;
    return Agree(*s);
  }

  bool Allocate() {
    ModelSeq* s = PickSeq();
    if (s == nullptr) return Create();
    uint64_t n;
    switch (Rand(4)) {
      case 0:  // what is appended
        n = s->tokens.size();
        break;
      case 1:  // lookahead
        n = s->tokens.size() + 1 + Rand(3 * bt_);
        break;
      case 2:  // fewer than held (issue 16), or the next token
        n = s->slots > s->computed ? s->computed + 1 + Rand(s->slots - s->computed)
                                   : s->computed + 1;
        break;
      default:  // anything up to a little past what is held
        n = Rand(std::max(s->slots, s->tokens.size()) + bt_ + 1);
        break;
    }
    const uint64_t old_blocks = Blocks(s->slots);
    std::vector<std::vector<PageId>> before;
    if (st_.threads_ == 1) {
      for (size_t q = 0; q < c_.num_pools(); ++q) before.push_back(Table(s->id, q));
    }
    auto a = c_.AllocateSlots(s->id, n);
    ++st_.counters_.calls;
    if (!a.ok()) {
      if (a.status().code() != StatusCode::kResourceExhausted)
        return Fail("AllocateSlots: " + a.status().ToString());
      ++st_.counters_.alloc_refused;
      // All or nothing: not a page of the tables moved.
      for (size_t q = 0; q < before.size(); ++q) {
        if (!Expect(Table(s->id, q) == before[q],
                    "a refused allocation changed pool " + std::to_string(q) + "'s table"))
          return false;
      }
      return Agree(*s);
    }
    const uint64_t want = Blocks(n);
    if (!Expect(a->first_new_block == old_blocks, "first_new_block") ||
        !Expect(a->new_blocks == (want > old_blocks ? want - old_blocks : 0), "new_blocks"))
      return false;
    // The engine's copies, in order, before it writes.
    for (const PageCopy& cp : a->copies) {
      if (!Expect(cp.pool < c_.num_pools() && cp.src != kInvalidPage && cp.dst != kInvalidPage &&
                      cp.src != cp.dst,
                  "a bad copy"))
        return false;
      auto& sh = st_.shadow_[cp.pool];
      std::copy_n(&sh[uint64_t{cp.src} * bt_], bt_, &sh[uint64_t{cp.dst} * bt_]);
      ++(cp.reason == CopyReason::kCopyOnWrite ? st_.counters_.cow_copies
                                               : st_.counters_.carry_copies);
    }
    s->slots = std::max(s->slots, n);
    s->writable = std::max(s->writable, n);
    return Agree(*s);
  }

  bool Commit() {
    ModelSeq* s = PickSeq();
    if (s == nullptr) return Create();
    const uint64_t top = std::min<uint64_t>(s->tokens.size(), s->slots);
    if (Rand(32) == 0) {  // out of order: refused, nothing changes
      const bool back = s->computed > 0 && Rand(2) == 0;
      const uint64_t n = back ? s->computed - 1 : top + 1;
      const Status st = c_.CommitComputed(s->id, n);
      ++st_.counters_.calls;
      return Expect(st.code() ==
                        (back ? StatusCode::kInvalidArgument : StatusCode::kFailedPrecondition),
                    "a bad commit: " + st.ToString()) &&
             Agree(*s);
    }
    if (top < s->computed) return Allocate();
    // Mostly everything that has slots, as an engine does.
    const uint64_t n = Rand(3) != 0 ? top : s->computed + Rand(top - s->computed + 1);
    // The engine writes the KV of tokens [computed, n) where the tables say.
    std::vector<std::vector<PageId>> tables;
    for (size_t q = 0; q < c_.num_pools(); ++q) tables.push_back(Table(s->id, q));
    for (uint64_t i = s->computed; i < n; ++i) {
      for (size_t q = 0; q < tables.size(); ++q) {
        const uint64_t b = i / bt_;
        if (!Expect(b < tables[q].size() && tables[q][b] != kInvalidPage,
                    "no page for a token that has a slot"))
          return false;
        st_.shadow_[q][uint64_t{tables[q][b]} * bt_ + i % bt_] = s->tags[i];
      }
    }
    const Status st = c_.CommitComputed(s->id, n);
    ++st_.counters_.calls;
    if (!st.ok()) {
      // Only for tokens past what was allocated since the last fork.
      if (st.code() != StatusCode::kFailedPrecondition || n <= s->writable)
        return Fail("CommitComputed(" + std::to_string(n) + "): " + st.ToString());
      ++st_.counters_.commit_refused;
      return Agree(*s);
    }
    s->computed = n;
    return Agree(*s);
  }

  bool DoFork() {
    ModelSeq* s = PickSeq();
    if (s == nullptr) return Create();
    if (seqs_.size() >= kMaxLive) return DoFree();
    auto f = c_.Fork(s->id);
    ++st_.counters_.calls;
    if (!f.ok()) return Fail("Fork: " + f.status().ToString());
    ++st_.counters_.forks;
    // Every page is shared now: neither may write before allocating again.
    s->writable = s->computed;
    ModelSeq child = *s;
    child.id = *f;
    const size_t parent = static_cast<size_t>(s - seqs_.data());
    seqs_.push_back(std::move(child));
    return Agree(seqs_.back()) && Agree(seqs_[parent]);
  }

  bool DoFree() {
    if (seqs_.empty()) return Create();
    const size_t i = Rand(seqs_.size());
    if (!ExpectOk(c_.Free(seqs_[i].id), "Free")) return false;
    ++st_.counters_.calls;
    seqs_.erase(seqs_.begin() + static_cast<std::ptrdiff_t>(i));
    return true;
  }

  bool Lookup() {
    std::vector<TokenId> buf;
    const PrefixQuery q = FamilyQuery(&buf);
    auto m = c_.LookupPrefix(q);
    ++st_.counters_.calls;
    if (!m.ok()) return Fail("LookupPrefix: " + m.status().ToString());
    return Expect(m->blocks <= m->chain_blocks && m->blocks <= (buf.size() - 1) / bt_ &&
                      m->tokens == uint64_t{m->blocks} * bt_,
                  "a lookup beyond its prompt");
  }

  bool Pin() {
    std::vector<TokenId> buf;
    const PrefixQuery q = FamilyQuery(&buf);
    // Mostly low priorities, which pressure gives up; a rare one that it never does.
    const uint32_t priority = Rand(64) == 0 && pins_.empty() ? kPinForever : Rand(4);
    auto p = c_.PinPrefix(q, priority);
    ++st_.counters_.calls;
    if (!p.ok()) {
      return Expect(p.status().code() == StatusCode::kNotFound,
                    "PinPrefix: " + p.status().ToString());
    }
    ++st_.counters_.pins;
    pins_.push_back(p->id);
    if (pins_.size() > 3) return Unpin();
    return true;
  }

  // A scheduler's hint for a family prompt: protects what it finds (and what is registered
  // under its hashes later) until dropped or, with a short time to live, expired.
  bool Hint() {
    std::vector<TokenId> buf;
    const PrefixQuery q = FamilyQuery(&buf);
    HintOptions ho;
    ho.ttl = std::chrono::milliseconds(Rand(4) == 0 ? 1 : 60000);
    auto h = c_.HintPrefix(q, ho);
    ++st_.counters_.calls;
    if (!h.ok()) {
      return Expect(h.status().code() == StatusCode::kResourceExhausted, "HintPrefix: " + h.status().ToString()) ||
             DropHint();
    }
    if (!Expect(h->protected_blocks <= h->found_blocks && h->found_blocks <= buf.size() / bt_,
                "a hint protecting more than it found")) {
      return false;
    }
    hints_.push_back(h->id);
    if (hints_.size() > 4) return DropHint();
    return true;
  }

  bool DropHint() {
    if (hints_.empty()) return true;
    const size_t i = Rand(hints_.size());
    const Status st = c_.DropHint(hints_[i]);
    ++st_.counters_.calls;
    hints_.erase(hints_.begin() + static_cast<std::ptrdiff_t>(i));
    // Expired (its time to live was short), or dropped by a reset on another thread.
    return Expect(st.ok() || st.code() == StatusCode::kNotFound, "DropHint: " + st.ToString());
  }

  bool Unpin() {
    if (pins_.empty()) return Pin();
    const size_t i = Rand(pins_.size());
    const Status st = c_.Unpin(pins_[i]);
    ++st_.counters_.calls;
    pins_.erase(pins_.begin() + static_cast<std::ptrdiff_t>(i));
    // NotFound: given up under pressure, or cleared by a reset.
    return Expect(st.ok() || st.code() == StatusCode::kNotFound, "Unpin: " + st.ToString());
  }

  // A long request of its own tokens: its allocation evicts cached blocks (and gives up pins).
  bool Pressure() {
    if (seqs_.size() >= kMaxLive) return DoFree();
    ModelSeq s;
    auto id = c_.CreateSequence();
    ++st_.counters_.calls;
    if (!id.ok()) return Fail("CreateSequence");
    s.id = *id;
    RandomTokens(s, (st_.preset_.capacity / 2 + Rand(st_.preset_.capacity / 2)) * bt_ + 1);
    if (!ExpectOk(c_.AppendTokens(s.id, s.tokens), "AppendTokens")) return false;
    seqs_.push_back(std::move(s));
    ModelSeq& m = seqs_.back();
    auto a = c_.AllocateSlots(m.id, m.tokens.size());
    st_.counters_.calls += 2;
    if (!a.ok()) {
      if (a.status().code() != StatusCode::kResourceExhausted)
        return Fail("AllocateSlots: " + a.status().ToString());
      ++st_.counters_.alloc_refused;
      return Agree(m);
    }
    m.slots = m.writable = m.tokens.size();
    if (Rand(2) == 0) return Agree(m);  // stays, holding its pages; committed by later steps
    return Commit();
  }

  bool DoReset() {
    if (st_.threads_ == 1 && Rand(2) == 0) FreeSeqsOnly();
    bool holding = false;
    for (const ModelSeq& s : seqs_) holding |= s.slots > 0;
    const Status st = c_.Reset();
    ++st_.counters_.calls;
    if (st.ok()) {
      ++st_.counters_.resets;
      pins_.clear();  // gone with the reset
      return Expect(!holding, "Reset succeeded while this thread's sequences hold pages");
    }
    // Single-threaded, the refusal is exact: only while a sequence holds pages.
    return Expect(st.code() == StatusCode::kFailedPrecondition && (holding || st_.threads_ > 1),
                  "Reset: " + st.ToString());
  }

  void FreeSeqsOnly() {
    while (!seqs_.empty()) {
      (void)c_.Free(seqs_.back().id);
      seqs_.pop_back();
    }
  }

  Stress& st_;
  CacheManager& c_;
  const uint32_t bt_;
  std::mt19937_64 rng_;
  std::vector<ModelSeq> seqs_;
  std::vector<PinId> pins_;
  std::vector<HintId> hints_;
};

bool Stress::Run(uint64_t seed, uint64_t ops) {
  Worker w(*this, seed);
  for (uint64_t i = 0; i < ops; ++i) {
    if (!w.Step() || Failed()) break;
    ++counters_.ops;
  }
  w.FreeAll();
  return !Failed();
}

void RunStress(const Preset& p, int threads, EvictionPolicyKind policy) {
  const uint64_t seed = EnvU64("SPARSEKV_CACHE_STRESS_SEED", 16);
#if SPARSEKV_SANITIZED
  // The checks dominate (a few per operation) and cost 10-20x more in the sanitizer builds.
  const uint64_t default_ops = 20000;
#else
  const uint64_t default_ops = 60000;
#endif
  const uint64_t ops = EnvU64("SPARSEKV_CACHE_STRESS_OPS", default_ops);
  Stress stress(p, threads, policy);
  const auto t0 = std::chrono::steady_clock::now();
  std::latch start(threads);
  std::vector<std::thread> ts;
  std::atomic<int> failed_threads{0};
  for (int i = 0; i < threads; ++i) {
    const uint64_t share = ops / threads + (static_cast<uint64_t>(i) < ops % threads ? 1 : 0);
    ts.emplace_back([&, i, share] {
      start.arrive_and_wait();
      if (!stress.Run(seed * 1000003 + static_cast<uint64_t>(i), share)) ++failed_threads;
    });
  }
  for (auto& t : ts) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  CacheManager& c = stress.cache();
  const CacheStats s = c.Stats();
  const Counters& k = stress.counters();
  std::printf(
      "%s, %d thread(s), seed %llu: %llu ops (%llu manager calls, %llu invariant checks) in "
      "%.2f s; %llu hit blocks, %llu evicted blocks, %llu evicted boundary pages, %llu refused "
      "allocations, %llu refused commits into shared blocks, %llu copy-on-write and %llu state "
      "copies, %llu forks, %llu pins, %llu given up, %llu resets; internal errors %llu\n",
      p.model, threads, static_cast<unsigned long long>(seed),
      static_cast<unsigned long long>(k.ops.load()),
      static_cast<unsigned long long>(k.calls.load()),
      static_cast<unsigned long long>(k.checks.load()), secs,
      static_cast<unsigned long long>(k.hit_blocks.load()),
      static_cast<unsigned long long>(s.evicted_blocks),
      static_cast<unsigned long long>(s.evicted_boundary_pages),
      static_cast<unsigned long long>(k.alloc_refused.load()),
      static_cast<unsigned long long>(k.commit_refused.load()),
      static_cast<unsigned long long>(k.cow_copies.load()),
      static_cast<unsigned long long>(k.carry_copies.load()),
      static_cast<unsigned long long>(k.forks.load()),
      static_cast<unsigned long long>(k.pins.load()),
      static_cast<unsigned long long>(s.pins_released),
      static_cast<unsigned long long>(k.resets.load()),
      static_cast<unsigned long long>(s.internal_errors));

  EXPECT_EQ(failed_threads.load(), 0) << stress.failure();
  EXPECT_FALSE(stress.Failed()) << stress.failure();
  EXPECT_EQ(k.ops.load(), ops);
  EXPECT_EQ(s.internal_errors, 0u) << s.first_internal_error;
  for (size_t q = 0; q < c.num_pools(); ++q) {
    EXPECT_EQ(c.pool(q).Stats().misuse, 0u) << "pool " << q;
    EXPECT_EQ(c.pool(q).Stats().used, 0u) << "pool " << q << ": pages held after every free";
  }
  EXPECT_EQ(s.sequences, 0u);
  EXPECT_EQ(s.hints, 0u) << "hints left after every worker dropped its own";
  EXPECT_EQ(s.hinted_blocks, 0u);
  EXPECT_GT(s.hints_given, 0u);
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants().ToString();
  // The run went where it should: hits, evictions, forks, copies and refusals all happened.
  EXPECT_GT(k.hit_blocks.load(), 0u);
  EXPECT_GT(s.evicted_blocks, 0u);
  EXPECT_GT(k.forks.load(), 0u);
  EXPECT_GT(k.cow_copies.load(), 0u);
  EXPECT_GT(k.alloc_refused.load(), 0u);
  ASSERT_TRUE(c.Reset().ok());
  EXPECT_TRUE(c.CheckInvariants().ok()) << c.CheckInvariants().ToString();
}

// Every eviction policy, each with hints coming and going.
class CacheStressPolicy : public ::testing::TestWithParam<EvictionPolicyKind> {};

TEST_P(CacheStressPolicy, V32OneThread) { RunStress(kV32, 1, GetParam()); }
TEST_P(CacheStressPolicy, V32FourThreads) { RunStress(kV32, 4, GetParam()); }
TEST_P(CacheStressPolicy, V4OneThread) { RunStress(kV4, 1, GetParam()); }
TEST_P(CacheStressPolicy, V4FourThreads) { RunStress(kV4, 4, GetParam()); }

INSTANTIATE_TEST_SUITE_P(Policies, CacheStressPolicy, ::testing::ValuesIn(AllEvictionPolicies()),
                         [](const auto& info) { return std::string(EvictionPolicyName(info.param)); });

}  // namespace
}  // namespace sparsekv
