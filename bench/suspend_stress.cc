#include "suspend_stress.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "sparsekv/host_tier.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/request_log.h"
#include "sparsekv/ssd_tier.h"
#include "bench_util.h"
#include "progress.h"
#include "toy_decoder.h"

namespace sparsekv::bench {
namespace {

constexpr uint32_t kBlockTokens = 128;
constexpr uint64_t kToySeed = 7;

struct Msg {
  enum Type : uint32_t {
    kStart = 1,
    kAck,
    kFinished,
    kSuspended,
    kResumeExact,
    kResumePartial,
    kMismatch,
    kTorn,
    kFinishing,  // Finish is about to be logged: a kill from here on may leave it finished or not
    kStalled,    // stopped on purpose after a durable finish, before kFinished
    kHistory,    // a suspend wrote `value` blocks as history records
  };
  uint32_t type = 0;
  uint32_t pad = 0;
  uint64_t request = 0;
  uint64_t value = 0;
};
static_assert(sizeof(Msg) == 24);

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A V4-shaped model small enough for many requests: two window-only layers, then CSA, HCA,
// CSA, HCA (fp8), with their compressor states.
ModelSpec StressSpec() {
  ModelSpec s = ModelPreset("deepseek-v4-flash", KvPrecision::kFp8).value();
  s.layers.resize(6);
  return s;
}

Result<std::unique_ptr<CacheManager>> MakeManager(uint32_t blocks) {
  CacheManagerOptions mo;
  mo.block_tokens = kBlockTokens;
  mo.capacity_blocks = blocks;
  mo.huge_pages = false;
  return CacheManager::Create(StressSpec(), mo);
}

struct Engine {
  std::unique_ptr<CacheManager> manager;
  std::unique_ptr<TierChain> chain;
  std::unique_ptr<OffloadedCache> cache;
  std::unique_ptr<RequestLog> log;
};

// write_back: the blocks reach the tiers when L1 evicts them (whole) or when a request is
// suspended (as history records, the window and state in its tail); otherwise each block is
// stored whole as it fills and a suspend writes the tail alone.
Result<Engine> OpenEngine(const std::string& root, uint32_t requests, bool write_back) {
  Engine e;
  SPARSEKV_ASSIGN_OR_RETURN(e.manager, MakeManager(requests * 5 + 16));
  std::vector<uint64_t> sizes;
  for (const auto& p : e.manager->geometry().pools) sizes.push_back(p.block_stride);
  sizes.push_back(16);
  const uint64_t block_bytes = BundleRecordBytes(sizes);
  HostTierOptions h;
  h.capacity_bytes = 16 * ((block_bytes + 8192 + 4095) & ~uint64_t{4095});
  h.huge_pages = false;
  SsdTierOptions d;
  d.path = root + "/ssd";
  d.capacity_bytes = 512ull << 20;
  d.read_arena_bytes = 64 << 20;
  d.slab_grow_bytes = 64 << 20;
  d.durability = Durability::kFdatasync;
  std::vector<std::unique_ptr<Tier>> tiers;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<HostTier> host, HostTier::Open(h));
  tiers.push_back(std::move(host));
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<SsdTier> ssd, SsdTier::Open(d));
  tiers.push_back(std::move(ssd));
  TierChainOptions co;
  co.write_policy = WritePolicy::kWriteThrough;  // a suspension is on the SSD when acknowledged
  e.chain = std::make_unique<TierChain>(std::move(tiers), co);
  OffloadedCacheOptions oo;
  oo.write_policy = write_back ? WritePolicy::kWriteBack : WritePolicy::kWriteThrough;
  e.cache = std::make_unique<OffloadedCache>(*e.manager, *e.chain, oo);
  RequestLogOptions lo;
  lo.path = root + "/log";
  lo.segment_bytes = 256 << 10;  // small: segments roll over and are reclaimed during the run
  SPARSEKV_ASSIGN_OR_RETURN(e.log, RequestLog::Open(lo));
  return e;
}

// One request a child thread decodes.
struct Slot {
  uint64_t id = 0;
  std::vector<TokenId> tokens;  // all logged; all but the last computed while running
  bool running = false;
  SequenceId seq = 0;
  uint64_t state = 0;          // suspended: the state's tokens (0: nothing saved)
  std::optional<BlockHash> tail;
};

// The log keeps token ids as int32 (the engine's ids, bit for bit).
std::span<const int32_t> AsLogged(std::span<const TokenId> t) {
  return {reinterpret_cast<const int32_t*>(t.data()), t.size()};
}

}  // namespace

Status RunSuspendStressChild(const SuspendStressChildOptions& o) {
  // Odd incarnations (the first among them) write back, so resumes meet both kinds of blocks.
  SPARSEKV_ASSIGN_OR_RETURN(Engine e, OpenEngine(o.dir, o.requests, o.incarnation % 2 == 1));
  auto send = [&](uint32_t type, uint64_t request, uint64_t value) {
    Msg m;
    m.type = type;
    m.request = request;
    m.value = value;
    if (write(o.ack_fd, &m, sizeof m) != sizeof m) _exit(3);  // the parent is gone
  };
  send(Msg::kTorn, 0, e.log->Stats().torn_bytes_cut);
  // Every unfinished request of the log, resumed from its last suspension.
  std::vector<Slot> slots;
  for (RequestLog::Request& r : e.log->Recover()) {
    Slot s;
    s.id = r.id;
    s.tokens.assign(r.tokens.begin(), r.tokens.end());
    if (r.suspension) {
      s.state = r.suspension->tokens;
      s.tail = r.suspension->tail;
    }
    slots.push_back(std::move(s));
  }
  uint64_t next_id = (uint64_t{o.incarnation} << 32) | 1;
  while (slots.size() < o.requests) slots.push_back(Slot{});
  const uint32_t threads = std::max<uint32_t>(1, std::min<uint32_t>(o.threads, static_cast<uint32_t>(slots.size())));
  std::atomic<uint64_t> ids{next_id};
  std::atomic<bool> stalled{false};
  std::mutex failure_mu;
  Status failure;
  auto worker = [&](uint32_t w) {
    std::mt19937_64 rng(o.seed * 1000003 + w);
    auto toy = ToyDecoder::Create(*e.manager, kToySeed);
    if (!toy.ok()) {
      std::lock_guard l(failure_mu);
      failure = toy.status();
      return;
    }
    auto append = [&](SequenceId q, std::span<const TokenId> t) { return e.cache->AppendTokens(q, t); };
    auto commit = [&](SequenceId q, uint64_t n) { return e.cache->CommitComputed(q, n); };
    auto fail = [&](Status st) {
      std::lock_guard l(failure_mu);
      if (failure.ok()) failure = std::move(st);
    };
    for (;;) {
      for (size_t i = w; i < slots.size(); i += threads) {
        Slot& s = slots[i];
        {
          std::lock_guard l(failure_mu);
          if (!failure.ok()) return;
        }
        if (s.tokens.empty()) {  // a new request: its prompt's one token, logged first
          s = Slot{};
          s.id = ids.fetch_add(1);
          s.tokens.push_back(static_cast<TokenId>(rng() % 50000));
          send(Msg::kStart, s.id, 0);
          if (Status st = e.log->Append(s.id, 0, AsLogged(s.tokens)); !st.ok()) return fail(st);
          send(Msg::kAck, s.id, 1);
        }
        if (!s.running) {
          // Resume from the state saved (or from nothing), compute again what it lacks, and
          // check each such step gives the token the log holds.
          auto r = e.cache->Resume({}, s.tokens, s.state);
          if (!r.ok()) return fail(r.status());
          uint64_t mismatches = 0;
          Status st = (*toy)->Replay(*e.manager, r->seq, s.tokens, r->restored_tokens, s.tokens.size() - 1, commit,
                                     &mismatches);
          if (!st.ok()) return fail(st);
          if (mismatches) send(Msg::kMismatch, s.id, mismatches);
          send(r->recompute_tokens == 0 ? Msg::kResumeExact : Msg::kResumePartial, s.id,
               s.tokens.size() - 1 - r->restored_tokens);
          s.seq = r->seq;
          s.running = true;
        }
        const uint64_t steps = 1 + rng() % 24;
        for (uint64_t k = 0; k < steps; ++k) {
          Status st = (*toy)->Run(*e.manager, s.seq, 1, &s.tokens, nullptr, append, commit);
          if (!st.ok()) return fail(st);
          st = e.log->Append(s.id, s.tokens.size() - 1, AsLogged(std::span<const TokenId>(&s.tokens.back(), 1)));
          if (!st.ok()) return fail(st);
          send(Msg::kAck, s.id, s.tokens.size());
        }
        if (s.tokens.size() >= o.max_request_tokens) {
          if (Status st = e.cache->Free(s.seq); !st.ok()) return fail(st);
          send(Msg::kFinishing, s.id, 0);
          if (Status st = e.log->Finish(s.id); !st.ok()) return fail(st);
          if (o.stall_after_finish && !stalled.exchange(true)) {
            send(Msg::kStalled, s.id, 0);
            for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // until the kill
          }
          send(Msg::kFinished, s.id, 0);
          if (s.tail) e.cache->DropSuspension(*s.tail).IgnoreError();
          s = Slot{};
        } else if (rng() % 3 == 0) {
          auto info = e.cache->Suspend(s.seq);
          if (!info.ok()) return fail(info.status());
          if (Status st = e.log->Suspended(s.id, {info->tokens, info->tail, 0}); !st.ok()) return fail(st);
          send(Msg::kSuspended, s.id, info->tokens);
          if (info->history_blocks > 0) send(Msg::kHistory, s.id, info->history_blocks);
          if (s.tail && !(*s.tail == info->tail)) e.cache->DropSuspension(*s.tail).IgnoreError();
          s.tail = info->tail;
          s.state = info->tokens;
          s.running = false;
        }
      }
    }
  };
  std::vector<std::thread> pool;
  for (uint32_t w = 0; w < threads; ++w) pool.emplace_back(worker, w);
  for (std::thread& t : pool) t.join();
  return failure.ok() ? Status::Internal("stress suspend-child: the workers stopped") : failure;
}

Result<nlohmann::json> RunSuspendStress(const SuspendStressOptions& o) {
  if (o.dir.empty()) return Status::InvalidArgument("stress suspend: --dir is required");
  if (o.kill_cycles < 1) return Status::InvalidArgument("stress suspend: --kill-cycles must be at least 1");
  if (o.seconds <= 0) return Status::InvalidArgument("stress suspend: --seconds must be positive");
  if (o.requests == 0 || o.threads == 0) return Status::InvalidArgument("stress suspend: --requests and --threads must be positive");
  if (o.max_request_tokens < 2) return Status::InvalidArgument("stress suspend: --max-request-tokens must be at least 2");
  const uint64_t seed = o.seed ? o.seed : std::random_device{}() | 1;
  std::mt19937_64 rng(seed);
  const std::string root = (std::filesystem::path(o.dir) / fmt::format("sparsekv-suspend-{}", getpid())).string();
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  std::filesystem::create_directories(root, ec);
  if (ec) return Status::IOError("stress suspend: create " + root + ": " + ec.message());
  struct Cleanup {
    std::string root;
    bool keep;
    ~Cleanup() {
      std::error_code e;
      if (!keep) std::filesystem::remove_all(root, e);
    }
  } cleanup{root, o.keep};

  std::map<uint64_t, uint64_t> acked;  // request -> tokens acknowledged
  std::set<uint64_t> finished;
  std::set<uint64_t> finishing;  // Finish under way when the child was killed: gone or whole, both right
  bool stalled_now = false;      // this cycle's child has stalled after a durable finish
  uint64_t started = 0, acked_tokens = 0, resumes = 0, exact = 0, recomputed = 0, mismatches = 0, suspends = 0,
           torn_cycles = 0, torn_bytes = 0, torn_injected = 0, stalls = 0, history_blocks = 0;
  auto apply = [&](const Msg& m) {
    switch (m.type) {
      case Msg::kStart: ++started; break;
      case Msg::kAck:
        if (m.value > acked[m.request]) {
          acked_tokens += m.value - acked[m.request];
          acked[m.request] = m.value;
        }
        break;
      case Msg::kFinishing: finishing.insert(m.request); break;
      case Msg::kStalled:
        ++stalls;
        stalled_now = true;
        break;
      case Msg::kFinished: finished.insert(m.request); break;
      case Msg::kSuspended: ++suspends; break;
      case Msg::kHistory: history_blocks += m.value; break;
      case Msg::kResumeExact: ++resumes, ++exact, recomputed += m.value; break;
      case Msg::kResumePartial: ++resumes, recomputed += m.value; break;
      case Msg::kMismatch: mismatches += m.value; break;
      case Msg::kTorn:
        torn_cycles += m.value > 0;
        torn_bytes += m.value;
        break;
      default: break;
    }
  };
  const double t0 = Now();
  for (int cycle = 0; cycle < o.kill_cycles; ++cycle) {
    ProgressNote(fmt::format("kill cycle {} of {}, {} tokens acknowledged", cycle + 1, o.kill_cycles, acked_tokens));
    std::vector<std::string> args = o.child_command;
    const std::vector<std::string> more = {"--dir", root, "--incarnation", std::to_string(cycle + 1), "--seed",
                                           std::to_string(seed + cycle), "--requests", std::to_string(o.requests),
                                           "--threads", std::to_string(o.threads), "--max-request-tokens",
                                           std::to_string(o.max_request_tokens)};
    args.insert(args.end(), more.begin(), more.end());
    // Every other cycle the child stalls after its first durable finish, and the kill comes as
    // soon as the parent hears of it, so that window is hit every such cycle however fast the
    // build (a sanitizer's child may take most of a cycle to start); such a cycle waits up to
    // ten seconds longer for its first finish.
    const bool stall = cycle % 2 == 1;
    if (stall) args.push_back("--stall-after-finish");
    stalled_now = false;
    const double share = o.seconds / o.kill_cycles;
    const double run_for = std::max(0.3, share * (0.5 + std::uniform_real_distribution<double>(0, 1)(rng)));
    SPARSEKV_ASSIGN_OR_RETURN(const bool killed, RunChildUntilKilled(
                                                   args, sizeof(Msg), stall ? run_for + 10 : run_for,
                                                   [&](const std::byte* r) {
                                                     Msg m;
                                                     std::memcpy(&m, r, sizeof m);
                                                     apply(m);
                                                   },
                                                   [&] { return stall && stalled_now; }));
    const bool gone = !killed;
    // Every other kill, a torn write on top: random bytes at the end of the newest segment, as
    // a write cut short would leave them. The next open must cut them and lose nothing.
    if (!gone && cycle % 2 == 0) {
      std::string newest;
      for (const auto& f : std::filesystem::directory_iterator(root + "/log", ec)) {
        if (f.path().extension() == ".skvlog" && f.path().string() > newest) newest = f.path().string();
      }
      if (!newest.empty()) {
        std::ofstream out(newest, std::ios::binary | std::ios::app);
        const size_t n = 1 + rng() % 300;
        for (size_t i = 0; i < n; ++i) out.put(static_cast<char>(rng()));
        ++torn_injected;
      }
    }
    if (gone) {
      return Status::Internal(fmt::format(
          "stress suspend: the child exited by itself in cycle {} (its error is above); it must run until killed",
          cycle + 1));
    }
  }
  const double seconds = Now() - t0;

  // The log as the last kill left it: every acknowledged token there, no finished request back.
  RequestLogOptions lo;
  lo.path = root + "/log";
  lo.segment_bytes = 256 << 10;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RequestLog> log, RequestLog::Open(lo));
  const uint64_t final_torn = log->Stats().torn_bytes_cut;
  torn_cycles += final_torn > 0;
  torn_bytes += final_torn;
  std::map<uint64_t, std::vector<TokenId>> logged;
  for (RequestLog::Request& r : log->Recover()) logged[r.id].assign(r.tokens.begin(), r.tokens.end());
  uint64_t lost = 0, resurrected = 0, finished_unacknowledged = 0;
  for (const auto& [id, n] : acked) {
    auto it = logged.find(id);
    if (finished.count(id)) {
      resurrected += it != logged.end();
    } else if (finishing.count(id) && it == logged.end()) {
      ++finished_unacknowledged;  // its finish record is durable; the kill came before the child said so
    } else {
      const uint64_t have = it == logged.end() ? 0 : it->second.size();
      lost += n > have ? n - have : 0;
    }
  }
  // Every logged token against an uninterrupted run of the same prompt.
  ProgressNote(fmt::format("checking {} requests against uninterrupted runs", logged.size()));
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> m, MakeManager(8));
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<ToyDecoder> toy, ToyDecoder::Create(*m, kToySeed));
  uint64_t differing = 0, checked = 0;
  for (const auto& [id, tokens] : logged) {
    SPARSEKV_ASSIGN_OR_RETURN(SequenceId seq, m->CreateSequence(SequenceOptions{"", "", false}));
    std::vector<TokenId> fresh{tokens[0]};
    SPARSEKV_RETURN_IF_ERROR(m->AppendTokens(seq, fresh));
    SPARSEKV_RETURN_IF_ERROR(toy->Run(
        *m, seq, tokens.size() - 1, &fresh, nullptr,
        [&](SequenceId q, std::span<const TokenId> t) { return m->AppendTokens(q, t); },
        [&](SequenceId q, uint64_t n) { return m->CommitComputed(q, n); }));
    fresh.resize(tokens.size());
    differing += fresh != tokens;
    checked += tokens.size();
    SPARSEKV_RETURN_IF_ERROR(m->Free(seq));
  }
  nlohmann::json out;
  out["kill_cycles"] = o.kill_cycles;
  out["requests_started"] = started;
  out["requests_finished"] = finished.size();
  out["acknowledged_tokens"] = acked_tokens;
  out["lost_tokens"] = lost;
  out["resurrected"] = resurrected;
  out["finished_unacknowledged"] = finished_unacknowledged;
  out["finish_stalls"] = stalls;
  out["suspends"] = suspends;
  out["history_blocks_written"] = history_blocks;
  out["resumes"] = resumes;
  out["resumed_exact"] = exact;
  out["recomputed_tokens"] = recomputed;
  out["child_mismatches"] = mismatches;
  out["differing_requests"] = differing;
  out["checked_requests"] = logged.size();
  out["checked_tokens"] = checked;
  out["torn_tails_cut"] = torn_cycles;
  out["torn_bytes_cut"] = torn_bytes;
  out["torn_tails_injected"] = torn_injected;
  out["seconds"] = seconds;
  out["seed"] = seed;
  // Every injected tail was cut at the next open (a torn write of the child's own may add more).
  // Every stall after a durable finish left a request the log rightly holds no more.
  out["ok"] = lost == 0 && resurrected == 0 && mismatches == 0 && differing == 0 && acked_tokens > 0 && resumes > 0 &&
              torn_cycles >= torn_injected && finished_unacknowledged >= stalls;
  return out;
}

}  // namespace sparsekv::bench
