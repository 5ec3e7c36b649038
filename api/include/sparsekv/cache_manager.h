// CacheManager: sequences, their block tables and the prefix cache over one model's page pools.
//
// What it is. The manager owns one PagePool per PoolGeometry of the model (block_geometry.h) and
// gives each sequence a block table per pool: entry b is the page holding token block b of that
// kind. An engine, per request: CreateSequence, AppendTokens (the prompt), AcquireCachedPrefix
// (attach the longest resumable cached prefix), AllocateSlots (pages for the tokens to compute),
// runs the model, CommitComputed (the KV is written: full blocks become findable), and at the
// end Free. Fork shares a sequence's pages with a new one (copy on write for a shared partial
// block).
//
// Blocks and records. A full block that is committed gets a record in the prefix index, keyed by
// its BlockHash (block_hash.h), holding the block's page in every pool. The record is the unit of
// caching: lookup walks the chain of records, and a record whose full-history page is evicted
// from any pool is removed with all its pages. The sliding-window and compressor-snapshot pages
// of a record are only needed to *resume at* its end boundary, so they may go first (a running
// sequence releases them early once they leave its window, and they may be evicted while the
// block's full-history pages stay); the record then remains a prefix but not a resume point,
// until a request that computes the block again hands it the lost pages.
//
// Compressor state. A compressor-state page of block b holds the compressor's running state while
// b is the sequence's last block, and its snapshot at the end of b once b is full. A new block's
// page starts from the previous one: AllocateSlots lists that copy (kCarryState).
//
// Resumable prefix (DESIGN.md). A cached prefix of k blocks is a hit only if every full-history
// kind of blocks 0..k-1 is cached, the sliding-window pages of the ceil(window/block_tokens)
// blocks before token k*block_tokens are cached, and the compressor snapshot at that boundary
// (the compressor-state page of block k-1) is cached. A request always computes at least one
// token: a prompt of L tokens hits at most (L-1)/block_tokens blocks. So a V4 prefix never hits
// at a boundary whose window or snapshot pages were evicted; it may still hit at a later
// boundary whose own pages are there, since the earlier window is not needed to resume there.
//
// Eviction. Pages are reference-counted by the pools; a page with references is never evicted.
// A freed sequence's pages are released tail first: pages of committed full blocks stay cached
// (findable; a hit takes them back), the others are freed at once, and allocation takes free
// pages before evicting cached ones, in the order of the pools' eviction policy
// (CacheManagerOptions::eviction; eviction_policy.h). ARC, the default, keeps blocks that were
// hit apart from blocks used once, remembers the hashes it evicted recently, and evicts the tail
// of a cached chain before its head (a block whose successors are cached is passed over among
// the oldest few: without it they could never hit). LRU evicts the least recently released. A
// failed allocation changes nothing. Pins hold a cached prefix's pages; under memory pressure,
// once no unpinned cached page is left, pins are given up lowest priority first (never those
// with kPinForever).
//
// Hints. An engine's scheduler knows which prompts it will run soon (its waiting queue, a
// session that will continue). HintPrefix protects the blocks of such a prompt, those cached
// now and those registered while the hint lives: a protected block is evicted only when nothing
// unprotected is left, so hints never make an allocation fail. A hint lasts until DropHint or
// its time to live; at most CacheManagerOptions::hint_bound of the cache is protected at once
// (blocks past the bound are left unprotected, and counted in CacheStats::hint_blocks_cut).
//
// Ownership. The manager owns its pools, records, sequences and pins; pool(i) is exposed for
// page addresses (PageData, arena_base) only: allocating or releasing its pages directly breaks
// the manager. Block tables are copied out.
//
// Eviction hook. An offload layer that keeps evicted blocks (offloaded_cache.h, write-back) must
// copy a block out after the manager decides to evict it and before its pages are reused; KV
// events come too late for that (they are delivered after the allocation returned the pages).
// SetBlockEvictHook installs a function called at exactly that point; see BlockEvictHook.
//
// Invariants. CheckInvariants verifies the bookkeeping against the pools: every sequence's table
// has `blocks` entries in every pool and its slots fit in them, every page's reference count is
// the number of tables and pins holding it, no page is in use without a holder or cached without
// a block, and every indexed block's pages are cached or held. With
// CacheManagerOptions::check_invariants it runs after every call that changes the manager; debug
// builds (NDEBUG undefined) always check the one sequence a call changed, which costs only that
// sequence's table. A violation found that way is counted as an internal error (CacheStats).
//
// Thread safety. Every method is thread-safe: one annotated mutex guards the index, records,
// tables and statistics; token hashing for AppendTokens and the query forms of LookupPrefix and
// PinPrefix runs outside it. Calls on one sequence from several threads are safe, but their order
// is the callers' business. Event listeners run after the lock is released, one event at a time,
// in event order across all threads (see kv_events.h). The eviction hook is the exception: it
// runs with the lock held.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/block_geometry.h"
#include "sparsekv/block_hash.h"
#include "sparsekv/kv_events.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/page_pool.h"
#include "sparsekv/status.h"

namespace sparsekv {

struct CacheManagerOptions {
  // Tokens per block: a multiple of every compression ratio of the model. Default: 128.
  uint32_t block_tokens = kDefaultBlockTokens;
  // Pages of each full-history pool (one page per block). Must be at least 1. Default: 0 (set it).
  uint32_t capacity_blocks = 0;
  // Pages of each sliding-window pool; 0 means capacity_blocks. Default: 0.
  uint32_t window_capacity_blocks = 0;
  // Pages of each compressor-state pool; 0 means capacity_blocks. Default: 0.
  uint32_t state_capacity_blocks = 0;
  // Pools without a payload arena: tables, refcounts and the prefix cache only (trace replay,
  // benchmarks, a router's model of a remote cache). Default: false.
  bool metadata_only = false;
  // Arena backing: kAnonymous or kMemfd (kFile is refused: one file per pool is not modelled).
  // Default: kAnonymous.
  ArenaBacking backing = ArenaBacking::kAnonymous;
  // Ask for transparent huge pages for the arenas. Default: true.
  bool huge_pages = true;
  // Prefix hash chain. Default: kXxh3.
  HashMode hash_mode = HashMode::kXxh3;
  // Keep committed full blocks findable after their sequences end. When false, nothing is
  // hashed, looked up or registered, and pages are freed at once. Default: true.
  bool enable_prefix_caching = true;
  // Lookups over which CacheStats::recent_token_hit_ratio is computed. Default: 1000.
  uint32_t stats_window_requests = 1000;
  // Which cached page an allocation evicts (eviction_policy.h). Default: kDefaultEvictionPolicy.
  EvictionPolicyKind eviction = kDefaultEvictionPolicy;
  // The share of capacity_blocks hints may protect at once, in [0, 1]. Default: 0.5.
  double hint_bound = 0.5;
  // Live hints at most (each holds a list of its blocks). Default: 65536.
  uint32_t max_hints = 65536;
  // Run CheckInvariants after every call that changes the manager, under its lock, counting a
  // violation as an internal error (the first one named in CacheStats::first_internal_error;
  // checking stops there). Costs O(pages of every pool + table entries + pins + block records)
  // per call: about a microsecond for a few hundred pages, far too much for a production-sized
  // cache, so it is for tests and stress runs. Off, debug builds still check the sequence a call
  // changed (O(its table)). Default: false.
  bool check_invariants = false;
  // Keep every appended token of a sequence (4 bytes each, until the sequence ends) so that
  // "stored" events carry their blocks' token ids (KvEvent::token_ids), as vLLM's BlockStored
  // does (vllm_kv_events.h). Default: false.
  bool event_token_ids = false;
};

using SequenceId = uint64_t;
using PinId = uint64_t;
// A pin that memory pressure never gives up.
inline constexpr uint32_t kPinForever = UINT32_MAX;

struct SequenceOptions {
  // Namespace salt: sequences only share blocks with sequences of the same salt. Default: "".
  std::string namespace_salt;
  // Extra keys hashed into every block (adapter id, ...). Default: "".
  std::string extra_keys;
  // Look this sequence's prompt up and register its full blocks. Default: true.
  bool cache_blocks = true;
};

// A prompt to look up or pin without a sequence.
struct PrefixQuery {
  std::string_view namespace_salt;
  std::string_view extra_keys;
  std::span<const TokenId> tokens;
  // Leave at least one token to compute, as a request must. Default: true.
  bool leave_last_token = true;
};

struct PrefixMatch {
  uint32_t blocks = 0;        // resumable cached blocks
  uint64_t tokens = 0;        // blocks * block_tokens
  uint32_t chain_blocks = 0;  // consecutive blocks found in the index, resumable or not
};

enum class CopyReason : uint8_t {
  kCopyOnWrite,  // a partial block shared with a fork: the new page gets the old page's bytes
  kCarryState,   // compressor state entering a new block: its page starts from the previous one
};

// One page copy the engine performs, in list order, before it writes the new tokens.
struct PageCopy {
  uint32_t pool = 0;
  PageId src = kInvalidPage;
  PageId dst = kInvalidPage;
  CopyReason reason = CopyReason::kCopyOnWrite;
};

struct SlotAllocation {
  uint32_t first_new_block = 0;  // index of the first block added
  uint32_t new_blocks = 0;       // blocks added to every table
  std::vector<PageCopy> copies;
};

// A restore's blocks that need no page of a boundary pool (CacheManager::AllocateRestoreSlots):
// blocks restored from records that carry only the full-history kinds, whose window and
// compressor state at their end nobody will read.
struct BoundarySkip {
  uint32_t window_from_block = 0;  // new blocks below this one get no sliding-window page
  uint32_t state_from_block = 0;   // new blocks below this one get no compressor-state page
};

struct SequenceInfo {
  uint64_t tokens = 0;           // appended
  uint64_t computed_tokens = 0;  // committed (or taken from the cache)
  uint64_t slot_tokens = 0;      // tokens that have pages
  uint32_t blocks = 0;           // entries in every block table
  uint32_t cached_blocks = 0;    // blocks whose pages belong to the prefix cache
};

struct PinInfo {
  PinId id = 0;
  uint32_t blocks = 0;  // blocks pinned (the longest resumable cached prefix)
};

using HintId = uint64_t;

struct HintOptions {
  // The hint expires this long after it is given, unless dropped first. Must be positive.
  // Default: 30 s.
  std::chrono::milliseconds ttl{30000};
};

struct HintInfo {
  HintId id = 0;
  uint32_t found_blocks = 0;      // consecutive blocks of the prefix found cached now
  uint32_t protected_blocks = 0;  // of those, the ones protected now (hint_bound may cut)
};

struct CacheStats {
  uint64_t lookups = 0;        // AcquireCachedPrefix calls that looked up (requests)
  uint64_t hits = 0;           // ... that hit at least one block
  uint64_t misses = 0;         // ... that hit none
  uint64_t lookup_tokens = 0;  // prompt tokens of those lookups
  uint64_t hit_tokens = 0;     // tokens taken from the cache
  uint64_t hit_blocks = 0;
  // hit_tokens / lookup_tokens over the last `recent_lookups` lookups (stats_window_requests).
  double recent_token_hit_ratio = 0;
  uint64_t recent_lookups = 0;
  uint64_t stored_blocks = 0;           // records created
  uint64_t duplicate_blocks = 0;        // blocks committed while an equal block was cached
  uint64_t repaired_blocks = 0;         // ... that gave it back window/snapshot pages it had lost
  uint64_t hash_collisions = 0;         // key matched, check did not: treated as a miss
  uint64_t evicted_blocks = 0;          // records evicted (full-history pages reused)
  uint64_t evicted_boundary_pages = 0;  // window/snapshot pages evicted from records that stayed
  uint64_t early_released_pages = 0;    // window/snapshot pages a running sequence gave up
  uint64_t failed_allocations = 0;      // AllocateSlots refused for want of pages
  uint64_t pins_released = 0;           // pins given up under memory pressure
  uint64_t hints = 0;                   // live hints
  uint64_t hinted_blocks = 0;           // blocks some live hint protects
  uint64_t hints_given = 0;             // HintPrefix/HintDigests calls that made a hint
  uint64_t hints_expired = 0;           // hints that reached their time to live
  uint64_t hint_blocks_cut = 0;         // blocks left unprotected because of hint_bound
  uint64_t cached_blocks = 0;           // records now
  uint64_t sequences = 0;               // live sequences
  uint64_t pins = 0;                    // live pins
  uint64_t events = 0;                  // KV events emitted
  uint64_t internal_errors = 0;         // broken invariants: a bug in sparsekv
  std::string first_internal_error;     // what the first one was
};

// A cached block (committed and in the prefix index) that an allocation is about to evict, with
// its pages still intact. The evicted page has no reference left; a window or snapshot page of
// the block may still be held by a sequence that computed the block again. Either way the bytes
// are final: committed blocks are never written again.
struct EvictingBlock {
  // The block's key and verification digest, as the block's sequence hashed it.
  BlockDigest digest;
  // The block's page in every pool, indexed like pool(i); kInvalidPage where it holds none (its
  // window or snapshot pages were evicted earlier). Read the bytes with
  // pool(i).PageData(pages[i]), geometry().pools[i].block_stride of them. Valid during the call
  // only: once the allocation returns, these pages may be written by their new holder.
  std::span<const PageId> pages;
  // true: a full-history page is evicted and the whole block leaves the cache. false: only its
  // window or snapshot pages go (the block stays a cached prefix, no longer a resume point
  // there); this is often the first loss of a V4 block, since those pages are released to the
  // cache while the sequence runs, long before the full-history pages at Free.
  bool whole_block = true;
};

// Called once for every eviction that takes pages from a cached block: an allocation evicts the
// LRU cached page of a pool, and the block that owns it loses that page and the pages going with
// it (all of them for a full-history page; the window or the snapshot role's pages otherwise).
// Never called for Reset, nor for pages that were not a cached block's (uncommitted, partial,
// or duplicate blocks are freed, not evicted).
//
// Contract for the callee:
//   - It runs on the thread whose AllocateSlots evicts, with the manager's lock held and no
//     pool lock held, before any bookkeeping of the eviction: the block is still in the index.
//   - It must not call any CacheManager method except the lock-free accessors geometry(),
//     options(), hasher(), num_pools() and pool(i) (any other call deadlocks), nor any PagePool
//     method other than PageData, arena_base and the constant accessors. It may take its own
//     locks, provided it never holds one of them while it calls into this manager.
//   - It should be short: every other manager call waits for it. Copying the pages out is the
//     intended work; I/O belongs on another thread.
//   - It must not throw, and must not keep `pages` or page pointers after it returns.
using BlockEvictHook = std::function<void(const EvictingBlock&)>;

// A cached block evicted ahead of need (CacheManager::EvictAhead): out of the cache and the
// prefix index, its pages held with one reference each for the taker, who reads them at
// leisure, off the manager's lock, and then gives them back with ReleaseHeldBlock.
struct HeldBlock {
  BlockDigest digest;
  std::vector<PageId> pages;  // indexed like pool(i); kInvalidPage where the block held none
  bool cached = false;        // HoldCachedBlock's: the pages go back to the cache, not free
};
// Called under the manager's lock, with BlockEvictHook's contract (no manager calls; its own
// short locks allowed). It owns the references from then on.
using HeldBlockTaker = std::function<void(HeldBlock)>;

class CacheManager {
 public:
  // Errors: an invalid spec, a block_tokens that is not a multiple of some ratio, capacity 0,
  // kFile backing, an arena that cannot be mapped.
  static Result<std::unique_ptr<CacheManager>> Create(const ModelSpec& spec,
                                                      const CacheManagerOptions& options);
  ~CacheManager();
  CacheManager(const CacheManager&) = delete;
  CacheManager& operator=(const CacheManager&) = delete;

  const BlockGeometry& geometry() const;
  const CacheManagerOptions& options() const;
  const BlockHasher& hasher() const;
  // The model's sliding-window length in tokens (0 without one).
  uint32_t window_tokens() const;
  // The model spec's name (ModelSpec::name).
  const std::string& model_name() const;
  size_t num_pools() const;
  // Precondition: i < num_pools(). For page addresses only (see the contract above).
  const PagePool& pool(size_t i) const;

  // ---- sequences ----
  Result<SequenceId> CreateSequence(const SequenceOptions& options = {});
  // Adds known tokens (prompt or generated); full blocks are hashed here, outside the lock.
  Status AppendTokens(SequenceId seq, std::span<const TokenId> tokens);
  // Looks the appended tokens up and attaches the longest resumable cached prefix: its pages join
  // the block tables and its tokens count as computed. Counts in the statistics. Precondition:
  // the sequence has no pages yet (FailedPrecondition otherwise).
  Result<PrefixMatch> AcquireCachedPrefix(SequenceId seq);
  // The same for a sequence resumed at a suspended state (OffloadedCache::Resume): at most
  // `max_blocks` blocks, and no token is left to compute (the state covers every token of the
  // blocks; the engine's next input is the token after them).
  Result<PrefixMatch> AcquireResumePrefix(SequenceId seq, uint32_t max_blocks);
  // Pages in every pool for tokens [0, num_tokens) (num_tokens may exceed the appended tokens,
  // for lookahead), copying a partial block shared with a fork before it is written. Asking for
  // fewer tokens than the sequence holds slots for keeps every block it holds; only the shared
  // blocks that tokens [computed, num_tokens) fall in are copied. All or nothing: on
  // ResourceExhausted no page, count, cached block or pin has changed.
  Result<SlotAllocation> AllocateSlots(SequenceId seq, uint64_t num_tokens);
  // As AllocateSlots, for a restore (OffloadedCache::Resume): the new blocks that `skip` names get
  // no page of the sliding-window or compressor-state pools (kInvalidPage in those tables).
  // Committed, such blocks are cached as prefixes, not resume points. The caller must commit
  // only up to a boundary whose window and state pages the sequence holds, and TrimSlots the
  // rest: an engine cannot compute into a block that lacks a page.
  Result<SlotAllocation> AllocateRestoreSlots(SequenceId seq, uint64_t num_tokens, const BoundarySkip& skip);
  // Gives back the pages of the blocks past the one holding the last computed token (slots taken
  // ahead and never committed), in every pool; the sequence then has slots for exactly its
  // computed tokens' blocks. NotFound for an unknown sequence.
  Status TrimSlots(SequenceId seq);
  // The KV of tokens [0, num_tokens) is written. Registers the full blocks among them (stored
  // events), then releases window and snapshot pages that left the sequence's window.
  // Preconditions: computed <= num_tokens <= min(appended tokens, slot tokens), and no block that
  // tokens [computed, num_tokens) fall in is still shared with a fork (FailedPrecondition, nothing
  // changed: the KV was written into a page another sequence holds; see Fork).
  Status CommitComputed(SequenceId seq, uint64_t num_tokens);
  // A new sequence with the same tokens and pages (references shared), lookahead blocks included.
  // Afterwards either sequence must call AllocateSlots for the tokens it is about to compute, even
  // where it already holds slots for them: that is where a shared block gets its copy.
  Result<SequenceId> Fork(SequenceId seq);
  // Releases the sequence's pages tail first and forgets it.
  Status Free(SequenceId seq);
  // The sequence's table for pool `pool` (kInvalidPage where a page was released early).
  Status GetBlockTable(SequenceId seq, size_t pool, std::vector<PageId>* out) const;
  Result<SequenceInfo> GetSequenceInfo(SequenceId seq) const;

  // ---- prefix cache ----
  // How much of a prompt would hit now. Read-only: no statistics, no references.
  Result<PrefixMatch> LookupPrefix(const PrefixQuery& query) const;
  // The same for digests computed elsewhere (a router's, hasher().HashFullBlocks). `prompt_tokens`
  // is the prompt length when leave_last_token applies, 0 to consider every digest.
  PrefixMatch LookupDigests(std::span<const BlockDigest> digests, uint64_t prompt_tokens) const;
  // Holds the longest resumable cached prefix of `query.tokens` (leave_last_token is ignored)
  // until Unpin. NotFound when nothing of it is cached.
  Result<PinInfo> PinPrefix(const PrefixQuery& query, uint32_t priority);
  Status Unpin(PinId pin);
  // Forgets every cached block, pin and hint ("all cleared" event). FailedPrecondition while a
  // sequence holds pages.
  Status Reset();

  // ---- scheduler hints ----
  // The prompt `query.tokens` will be looked up soon: its full blocks (leave_last_token ignored),
  // those cached now and those registered while the hint lives, are protected from eviction
  // until DropHint or the time to live ends, within hint_bound. ResourceExhausted when max_hints
  // hints are live; InvalidArgument for a time to live that is not positive.
  Result<HintInfo> HintPrefix(const PrefixQuery& query, const HintOptions& options = {});
  // The same for digests computed elsewhere (hasher().HashFullBlocks).
  Result<HintInfo> HintDigests(std::span<const BlockDigest> digests, const HintOptions& options = {});
  // Ends a hint early. NotFound when it does not exist (never made, dropped, or expired).
  Status DropHint(HintId hint);

  // ---- eviction hook ----
  // Installs `hook` (see BlockEvictHook), replacing any previous one; an empty function removes
  // it. One hook per manager: the last one set wins. The manager keeps a copy; whatever it
  // captures must stay valid until the hook is replaced or the manager is destroyed. Once this
  // returns, the previous hook is not running and is never called again, so its owner may go.
  // Precondition: not called from within a hook (it takes the manager's lock). With no hook
  // set, eviction costs what it did before (one test of an empty function per evicted page).
  void SetBlockEvictHook(BlockEvictHook hook);
  // Evicts cached blocks ahead of need, least recently used first, while some full-history pool
  // has fewer than `free_target` free pages; at most `max_blocks`. Each goes whole (every pool's
  // page) to `take` instead of the eviction hook, and no page is written over: an offload layer
  // copies them out off the lock, where an eviction inside AllocateSlots would have to copy
  // before the page is reused. Events and statistics are those of an eviction. Returns how
  // many blocks went; 0 when every such pool has `free_target` free pages or nothing cached.
  uint32_t EvictAhead(uint32_t free_target, uint32_t max_blocks, const HeldBlockTaker& take);
  // After an AllocateSlots that leaves some full-history pool with fewer than `low_free_pages`
  // free pages, `notify` is called on the allocating thread, outside the lock: it should only
  // schedule an EvictAhead elsewhere. Replaces any previous one; an empty function removes it.
  // As SetBlockEvictHook, once this returns the previous one is not running.
  void SetLowFreePagesNotify(uint32_t low_free_pages, std::function<void()> notify);
  // Holds the pages of the cached block `digest` names (every pool's it has; kInvalidPage
  // where it holds none) with one reference each, as EvictAhead does, but the block stays
  // cached and findable: the caller reads them off the manager's lock, then gives them back
  // with ReleaseHeldBlock. NotFound when the block is not cached.
  Result<HeldBlock> HoldCachedBlock(const BlockDigest& digest);
  // Gives back the pages of a block EvictAhead or HoldCachedBlock handed over (each becomes free once nobody else
  // holds it). Takes no manager lock: callable from anywhere, a HeldBlockTaker included.
  void ReleaseHeldBlock(const HeldBlock& block);

  // ---- events and statistics ----
  SubscriptionId Subscribe(KvEventListener listener);
  // The same events, a delivered run at a time (kv_events.h, KvEventBatchListener): for a sink
  // that takes the events' vectors instead of copying them, as VllmKvEventPublisher::Attach does.
  SubscriptionId SubscribeBatch(KvEventBatchListener listener);
  void Unsubscribe(SubscriptionId id);
  CacheStats Stats() const;

  // ---- checking ----
  // OK when every invariant of the contract holds ("Invariants" above), and when no internal
  // error was counted and no pool saw a misuse; otherwise Internal, naming the first violation
  // found (sequence, pool, block, page). Read-only; takes the manager's lock and, one at a time,
  // each sequence's token lock. Cost: O(pages of every pool + table entries + pins + block
  // records), with no allocation after the first call.
  Status CheckInvariants() const;

 private:
  class Impl;
  explicit CacheManager(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsekv
