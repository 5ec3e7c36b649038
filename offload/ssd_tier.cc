// The SSD tier: one data file on io_uring + O_DIRECT, extents allocated by the byte, indexed in
// RocksDB (ssd_tier.h).
//
// Locks: index_mu_ orders every change of the RocksDB index with the matching change of the
// in-memory index, so the two agree in the order a restart replays; it is taken before mu_.
// mu_ guards the in-memory state (entries, free space, pins, statistics) and is never held
// across I/O or a RocksDB call, except while the data file grows.
//
// Extent lifecycle: free -> reserved by a put -> named by an index entry -> (erase, eviction,
// replacement, corruption) removed from memory, its index entry deleted, and only then free
// again. An extent being read is pinned; freeing a pinned extent waits for the last reader. An
// extent whose index entry may or may not have been deleted (the RocksDB write failed) is
// quarantined until the next open, which rebuilds the free space from the index.
//
// Reads (GetAsync): batches queue in read_queue_, and an I/O thread streams every batch queued,
// and those queued while it reads, through one ring run (ReadStream), so the ring never drains
// between the chunks a restore asks for ahead. Within a batch, records whose extents are
// adjacent (or a small gap apart) are read as one range into one buffer the records share, in
// I/Os of io_bytes (PlanRead); each record is checked as soon as its I/Os are done, while later
// ones are in flight, and fails alone.
#include "sparsekv/ssd_tier.h"

#include <fmt/format.h>
#include <pthread.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>
#include <sys/uio.h>

#include <algorithm>
#include <future>
#include <unordered_set>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>
#include <unordered_map>

#include "extent_allocator.h"
#include "io_status.h"
#include "key_codec.h"
#include "record_arena.h"
#include "sparsekv/thread_annotations.h"
#include "tier_eviction.h"
#include "uring_queue.h"
#include "worker_pool.h"

namespace sparsekv {

namespace {

using offload::EncodeBundleKey;
using offload::ErrnoStatus;
using offload::FromRocksDb;
using offload::UringOp;
using offload::UringQueue;

constexpr char kFormatKey[] = "m:format";
// The directory's mark. It followed the bundle format until format 3; records now carry their
// own format version and a reader takes another version for a miss (bundle.h), so the mark
// names the index's own layout and stays the value format 3 wrote: releases of different bundle
// formats open each other's directories and delete none of each other's records.
constexpr char kFormatValue[] = "sparsekv-ssd-index-3";
// Written by releases of bundle format 2, whose c8_mla pages had their scales before the rope.
constexpr char kBundle2FormatValue[] = "sparsekv-ssd-index-2";
// Written by releases that kept one slab file per size class.
constexpr char kSlabFormatValue[] = "sparsekv-ssd-index-1";
constexpr char kDataFileName[] = "data.dat";
constexpr uint8_t kIndexValueVersion = 2;
constexpr uint64_t kUnit = kDirectIoAlignment;

uint64_t UnitsOf(uint64_t bytes) {
  return (bytes + kUnit - 1) / kUnit;
}

// Index value: where a record lies and what it holds.
struct IndexValue {
  uint64_t at = 0;  // first 4 KiB unit of the extent in the data file
  uint64_t record_bytes = 0;
  uint64_t checksum = 0;
  uint64_t sequence = 0;  // the bundle's version (bundle.h)
  uint64_t written = 0;   // put order, to rebuild an eviction order at open
  std::vector<uint32_t> segment_bytes;
};

template <typename T>
void Append(std::string& out, T v) {
  char b[sizeof v];
  std::memcpy(b, &v, sizeof v);
  out.append(b, sizeof v);
}
template <typename T>
bool Take(std::string_view& in, T* v) {
  if (in.size() < sizeof *v) return false;
  std::memcpy(v, in.data(), sizeof *v);
  in.remove_prefix(sizeof *v);
  return true;
}

std::string EncodeIndexValue(const IndexValue& v) {
  std::string out;
  out.reserve(48 + 4 * v.segment_bytes.size());
  Append<uint8_t>(out, kIndexValueVersion);
  Append(out, v.at);
  Append(out, v.record_bytes);
  Append(out, v.checksum);
  Append(out, v.sequence);
  Append(out, v.written);
  Append<uint16_t>(out, static_cast<uint16_t>(v.segment_bytes.size()));
  for (uint32_t s : v.segment_bytes) Append(out, s);
  return out;
}

bool DecodeIndexValue(std::string_view in, IndexValue* v) {
  uint8_t version = 0;
  uint16_t count = 0;
  if (!Take(in, &version) || version != kIndexValueVersion || !Take(in, &v->at) ||
      !Take(in, &v->record_bytes) || !Take(in, &v->checksum) || !Take(in, &v->sequence) ||
      !Take(in, &v->written) || !Take(in, &count) || in.size() != 4ull * count) {
    return false;
  }
  v->segment_bytes.resize(count);
  for (auto& s : v->segment_bytes) Take(in, &s);
  return true;
}

std::vector<uint32_t> SegmentsOf(const Bundle& b) {
  std::vector<uint32_t> out(b.segment_count());
  for (uint32_t i = 0; i < b.segment_count(); ++i)
    out[i] = static_cast<uint32_t>(b.segment_bytes(i));
  return out;
}

class SsdTierImpl final : public SsdTier {
 public:
  SsdTierImpl(SsdTierOptions options, FileSystem* fs)
      : options_(std::move(options)),
        fs_(fs),
        eviction_(options_.eviction, static_cast<uint64_t>(std::clamp(options_.hint_bound, 0.0, 1.0) *
                                                           static_cast<double>(options_.capacity_bytes))) {
    write_options_.sync = options_.durability != Durability::kNone;
  }

  ~SsdTierImpl() override {
    workers_.reset();  // completes every queued operation, handing writes to the committer
    {
      MutexLock lock(commit_mu_);
      commit_stop_ = true;
    }
    commit_cv_.notify_all();
    if (committer_.joinable()) committer_.join();
    if (db_) {
      rocksdb::Status s = db_->Close();
      if (!s.ok()) spdlog::warn("ssd tier {}: closing the index: {}", options_.path, s.ToString());
    }
  }

  Status Init();

  std::string_view name() const override { return options_.name; }
  uint64_t capacity_bytes() const override { return capacity_units_ * kUnit; }
  uint64_t max_record_bytes() const override { return options_.max_record_bytes; }
  uint64_t max_sequence() const override {
    MutexLock lock(mu_);
    return max_sequence_;
  }

  TierStats Stats() const override {
    MutexLock lock(mu_);
    TierStats s = stats_;
    s.name = options_.name;
    s.capacity_bytes = capacity_bytes();
    s.items = entries_.size();
    s.protected_items = eviction_.protected_items();
    s.protected_bytes = eviction_.protected_bytes();
    s.hinted_keys = eviction_.hinted_keys();
    s.hint_cut = eviction_.hint_cut();
    return s;
  }

  void Hint(std::span<const BundleKey> keys, bool on) override {
    MutexLock lock(mu_);
    for (const BundleKey& k : keys) {
      auto e = entries_.find(k);
      eviction_.Hint(k, e == entries_.end() ? offload::TierEviction::kNone : e->second.id, on);
    }
  }

  Status CheckEviction() const override {
    MutexLock lock(mu_);
    SPARSEKV_RETURN_IF_ERROR(eviction_.Check());
    for (const auto& [k, e] : entries_) {
      if (e.id >= id_keys_.size() || !(id_keys_[e.id] == k))
        return Status::Internal(fmt::format("ssd tier: entry {} has id {} of another key", k.ToString(), e.id));
      auto p = parked_at_.find(e.at);
      if (eviction_.Parked(e.id) != (p != parked_at_.end() && p->second == e.id))
        return Status::Internal(fmt::format("ssd tier: entry {} parked in one place only", k.ToString()));
    }
    return Status::OK();
  }

  SsdTierDetails Details() const override {
    MutexLock lock(mu_);
    SsdTierDetails d = details_;
    d.allocated_bytes = file_units_ * kUnit;
    d.free_bytes = free_.free_units() * kUnit;
    d.free_extents = free_.free_extents();
    d.largest_free_bytes = free_.largest_free() * kUnit;
    d.buffers_registered = !queues_.empty() && queues_[0]->registered();
    for (const auto& q : queues_) {
      d.fixed_ios += q->fixed_ios();
      d.plain_ios += q->plain_ios();
    }
    d.arena_bytes_in_use = arena_ ? arena_->used_granules() * offload::RecordArena::kGranule : 0;
    return d;
  }

  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    workers_->Submit(
        [this, bundles = std::move(bundles), done = std::move(done)](size_t w) mutable {
          WriteData(*queues_[w], std::move(bundles), std::move(done));
        });
  }

  void GetAsync(std::vector<BundleKey> keys, BundlesCallback done) override {
    auto batch = std::make_unique<ReadBatch>();
    batch->keys = std::move(keys);
    batch->done = std::move(done);
    {
      MutexLock lock(read_mu_);
      read_queue_.push_back(std::move(batch));
    }
    // The batch may be read by a stream already running on another task: this one then finds
    // nothing left and returns.
    workers_->Submit([this](size_t w) { ReadStream(*queues_[w]); });
  }

  void ContainsAsync(std::vector<BundleKey> keys, ContainsCallback done) override {
    std::vector<bool> out(keys.size());
    {
      MutexLock lock(mu_);
      for (size_t i = 0; i < keys.size(); ++i) {
        auto it = entries_.find(keys[i]);
        out[i] = it != entries_.end() && !it->second.other_version;
      }
    }
    done(std::move(out));
  }

  void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) override {
    EraseOlderAsync(std::move(keys), {}, std::move(done));
  }

  void EraseOlderAsync(std::vector<BundleKey> keys, std::vector<uint64_t> below,
                       StatusesCallback done) override {
    // On the caller's thread: an index write needs no ring, and an erase a put waits for
    // should not queue behind reads and writes (concurrent callers share RocksDB's group commit).
    const Status s = RemoveEntries(keys, nullptr, below.empty() ? nullptr : &below,
                                   /*eviction=*/false);
    done(std::vector<Status>(keys.size(), s));
  }

  Result<SsdRecordLocation> Locate(const BundleKey& key) const override {
    SsdRecordLocation loc;
    {
      MutexLock lock(mu_);
      auto it = entries_.find(key);
      if (it == entries_.end() || it->second.other_version)
        return Status::NotFound("ssd tier: no bundle " + key.ToString());
      loc.file = data_path_;
      loc.offset = it->second.at * kUnit;
      loc.record_bytes = it->second.record_bytes;
      loc.checksum = it->second.checksum;
    }
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), EncodeBundleKey(key), &value);
    IndexValue v;
    if (s.ok() && DecodeIndexValue(value, &v)) loc.segment_bytes = v.segment_bytes;
    return loc;
  }

  std::vector<Status> ReadSectors(std::span<const SectorRead> reads, std::vector<SectorRecord>* records) override {
    std::promise<std::vector<Status>> done;
    auto result = done.get_future();
    workers_->Submit(
        [this, reads, records, &done](size_t w) { done.set_value(DoReadSectors(*queues_[w], reads, records)); });
    return result.get();
  }

  std::optional<std::vector<BundleKey>> ListKeys() const override { return Keys(); }
  bool SetKeyJournal(std::shared_ptr<KeyJournal> journal) override {
    MutexLock lock(mu_);
    journal_ = std::move(journal);
    return true;
  }
  std::vector<BundleKey> Keys() const override {
    MutexLock lock(mu_);
    std::vector<BundleKey> out;
    out.reserve(entries_.size());
    for (const auto& [k, e] : entries_) out.push_back(k);
    return out;
  }

 private:
  struct Entry {
    uint64_t at = 0;  // first unit of the extent
    uint64_t record_bytes = 0;
    uint64_t checksum = 0;
    uint64_t sequence = 0;
    uint32_t id = 0;  // its id in the eviction order (id_keys_[id] is its key)
    // A read found another release's record here (another bundle format): lookups answer
    // absent, as reads do, until a put replaces it. Not persisted: a restart finds out again.
    bool other_version = false;
  };
  // Where a read found a bundle; a corrupt one is removed only if it is still there.
  struct Location {
    uint64_t at = 0;
    uint64_t units = 0;
    uint64_t checksum = 0;
  };

  // A put batch between its data writes (I/O thread) and its index update (committer).
  struct Item {
    bool write = false;
    bool after_eviction = false;  // allocated once this batch had evicted: the victims' index
                                  // entries must be deleted before its data is written
    uint64_t at = 0;
    uint64_t units = 0;
  };
  struct PendingPut {
    std::vector<BundlePtr> bundles;
    std::vector<Item> items;
    std::vector<Status> st;
    uint64_t io_errors = 0;
    StatusesCallback done;
  };
  // Phases A (extents) and B (data) of a put, on an I/O thread; queues the batch for the
  // committer.
  void WriteData(UringQueue& q, std::vector<BundlePtr> bundles, StatusesCallback done)
      SPARSEKV_EXCLUDES(mu_, index_mu_, commit_mu_);
  // The committer thread: takes every batch waiting, syncs the data file once, writes all their
  // index entries in one RocksDB batch, publishes them in order, then acknowledges.
  void CommitLoop() SPARSEKV_EXCLUDES(mu_, index_mu_, commit_mu_);
  void Commit(std::vector<PendingPut>& group) SPARSEKV_EXCLUDES(mu_, index_mu_);
  std::vector<Status> DoReadSectors(UringQueue& q, std::span<const SectorRead> reads,
                                    std::vector<SectorRecord>* records);
  // Reads (GetAsync). A batch's records are sorted by where they lie, and records whose extents
  // are adjacent (or a gap of at most read_gap_bytes apart) form a group: one contiguous range of
  // the data file read into one buffer, in I/Os of io_bytes, each record then a view of its part
  // of that buffer. Each record is checked as soon as the I/Os covering it are done, while the
  // later I/Os are in flight; a damaged record fails alone. A record whose coalesced I/O failed
  // is read again on its own, so that a bad sector fails only the record it lies in.
  struct ReadItem {
    bool found = false;
    Location loc;
    uint64_t record_bytes = 0;
    uint64_t aligned = 0;
    uint64_t offset = 0;  // of the extent in the data file
    RecordBuffer buf;
    uint32_t pieces_left = 0;  // I/Os of its current group still covering it
    bool retried = false;      // read again alone after a coalesced I/O over it failed
    Status st;
    BundlePtr bundle;
  };
  struct ReadGroup {
    uint64_t offset = 0;  // in the data file
    uint64_t bytes = 0;
    std::byte* data = nullptr;  // where `offset` lands
    std::vector<uint32_t> items;  // the records it covers, in file order
    std::shared_ptr<RecordBuffer> owner;  // the group's buffer, when several records share it
  };
  struct ReadBatch {
    std::vector<BundleKey> keys;
    BundlesCallback done;
    std::vector<ReadItem> items;
    std::deque<ReadGroup> groups;  // a deque: retries add groups while others are referenced
    size_t unsettled = 0;          // found records not yet checked or failed
    uint64_t io_errors = 0;
  };
  struct ReadPiece {
    ReadBatch* batch = nullptr;
    uint32_t group = 0;
    uint64_t offset = 0;  // in the data file
    uint64_t length = 0;
    std::byte* data = nullptr;
  };
  // Reads every batch queued, and those queued while it runs (up to a bound, so that puts
  // queued behind get their turn), in one stream through the ring: the ring never drains
  // between batches. Each batch's callback runs once its last record is settled.
  void ReadStream(UringQueue& q) SPARSEKV_EXCLUDES(mu_, index_mu_, read_mu_);
  // Looks up, pins and groups a batch's records, allocates their memory and appends the I/Os.
  void PlanRead(ReadBatch& b, std::deque<ReadPiece>& pieces) SPARSEKV_EXCLUDES(mu_);
  void AddGroupPieces(ReadBatch& b, uint32_t group, std::deque<ReadPiece>& pieces);
  // One I/O of a group finished (`result`: bytes or -errno).
  void PieceDone(const ReadPiece& p, int result, std::deque<ReadPiece>& pieces)
      SPARSEKV_EXCLUDES(mu_, index_mu_);
  // Every I/O covering record i is done: check it, or read it again alone, or fail it.
  void ItemRead(ReadBatch& b, uint32_t i, bool coalesced, std::deque<ReadPiece>& pieces)
      SPARSEKV_EXCLUDES(mu_, index_mu_);
  // Every record of the batch is settled: erases the corrupt, unpins, counts, answers.
  void FinishRead(ReadBatch& b) SPARSEKV_EXCLUDES(mu_, index_mu_);
  // Removes the entries of `keys` (only where they still lie at `only_at[i]`, only if their
  // sequence is below `below[i]`, when given) from memory and the index; their extents are
  // free once the index delete is written.
  Status RemoveEntries(const std::vector<BundleKey>& keys, const std::vector<Location>* only_at,
                       const std::vector<uint64_t>* below, bool eviction)
      SPARSEKV_EXCLUDES(mu_, index_mu_);

  // An extent of `units`: free space, else the file grown, else the eviction order's victims
  // nobody reads evicted (their keys appended to `victims`) until a free extent holds it.
  Result<uint64_t> TakeExtentLocked(uint64_t units, std::vector<BundleKey>* victims,
                                    std::vector<Location>* victim_at) SPARSEKV_REQUIRES(mu_);
  // Takes an entry out of memory (not its extent); `evicted` tells the eviction order so.
  void RemoveEntryLocked(std::unordered_map<BundleKey, Entry, BundleKeyHasher>::iterator it,
                         bool evicted = false) SPARSEKV_REQUIRES(mu_);
  // A new entry of `key` in memory, joining the eviction order as the most recent.
  void AddEntryLocked(const BundleKey& key, Entry e) SPARSEKV_REQUIRES(mu_);
  void FreeExtentLocked(uint64_t at, uint64_t units) SPARSEKV_REQUIRES(mu_);
  void UnpinLocked(uint64_t at) SPARSEKV_REQUIRES(mu_);
  Status LoadIndex() SPARSEKV_EXCLUDES(mu_);

  const SsdTierOptions options_;
  FileSystem* const fs_;
  rocksdb::WriteOptions write_options_;
  std::unique_ptr<rocksdb::DB> db_;
  std::string data_path_;
  std::unique_ptr<RandomRWFile> file_;  // positional I/O needs no lock
  uint64_t capacity_units_ = 0;
  std::shared_ptr<offload::RecordArena> arena_;      // shared with the bundles it holds
  std::vector<std::unique_ptr<UringQueue>> queues_;  // queues_[w] is used only by worker w
  std::unique_ptr<offload::WorkerPool> workers_;

  Mutex read_mu_;
  std::deque<std::unique_ptr<ReadBatch>> read_queue_ SPARSEKV_GUARDED_BY(read_mu_);

  Mutex commit_mu_;
  std::condition_variable_any commit_cv_;
  std::deque<PendingPut> commit_queue_ SPARSEKV_GUARDED_BY(commit_mu_);
  bool commit_stop_ SPARSEKV_GUARDED_BY(commit_mu_) = false;
  std::thread committer_;

  Mutex index_mu_;
  mutable Mutex mu_;
  std::unordered_map<BundleKey, Entry, BundleKeyHasher> entries_ SPARSEKV_GUARDED_BY(mu_);
  std::shared_ptr<KeyJournal> journal_ SPARSEKV_GUARDED_BY(mu_);  // SetKeyJournal
  offload::TierEviction eviction_ SPARSEKV_GUARDED_BY(mu_);  // the entries' eviction order
  std::vector<BundleKey> id_keys_ SPARSEKV_GUARDED_BY(mu_);     // per eviction id: its key
  std::vector<uint32_t> spare_ids_ SPARSEKV_GUARDED_BY(mu_);
  // Entries named as victims while read (pinned), out of the order until unpinned: extent -> id.
  std::unordered_map<uint64_t, uint32_t> parked_at_ SPARSEKV_GUARDED_BY(mu_);
  offload::ExtentAllocator free_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t file_units_ SPARSEKV_GUARDED_BY(mu_) = 0;
  std::unordered_map<uint64_t, uint32_t> pins_ SPARSEKV_GUARDED_BY(mu_);  // extent -> readers
  std::unordered_map<uint64_t, uint64_t> free_when_unpinned_
      SPARSEKV_GUARDED_BY(mu_);  // extent -> units
  // Keys with a put written or being written but not yet in the index: a put of the same bytes
  // as the published bundle must not be skipped then, or the older put would land last.
  std::unordered_map<BundleKey, uint32_t, BundleKeyHasher> unpublished_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t next_written_ SPARSEKV_GUARDED_BY(mu_) = 1;
  uint64_t max_sequence_ SPARSEKV_GUARDED_BY(mu_) = 0;
  TierStats stats_ SPARSEKV_GUARDED_BY(mu_);
  SsdTierDetails details_ SPARSEKV_GUARDED_BY(mu_);
};

Status SsdTierImpl::Init() {
  const SsdTierOptions& o = options_;
  if (o.path.empty()) return Status::InvalidArgument("ssd tier: path must be set");
  if (o.queue_depth == 0 || o.queue_depth > 4096) {
    return Status::InvalidArgument(
        fmt::format("ssd tier: queue_depth {} is not in [1, 4096]", o.queue_depth));
  }
  if (o.io_threads == 0 || o.io_threads > 64) {
    return Status::InvalidArgument(
        fmt::format("ssd tier: io_threads {} is not in [1, 64]", o.io_threads));
  }
  if (o.io_bytes < kDirectIoAlignment || o.io_bytes % kDirectIoAlignment != 0 ||
      o.io_bytes > (64u << 20)) {
    return Status::InvalidArgument(fmt::format(
        "ssd tier: io_bytes {} must be a multiple of 4096 from 4 KiB to 64 MiB", o.io_bytes));
  }
  if (o.read_gap_bytes % kDirectIoAlignment != 0 || o.read_coalesce_bytes > (1ull << 30)) {
    return Status::InvalidArgument(fmt::format(
        "ssd tier: read_gap_bytes {} must be a multiple of 4096 and read_coalesce_bytes {} at most 1 GiB",
        o.read_gap_bytes, o.read_coalesce_bytes));
  }
  if (o.max_record_bytes < BundleHeaderBytes(0) || o.max_record_bytes > (1ull << 32)) {
    return Status::InvalidArgument(
        fmt::format("ssd tier: max_record_bytes {} is not in [{}, 4 GiB]", o.max_record_bytes,
                    BundleHeaderBytes(0)));
  }
  capacity_units_ = o.capacity_bytes / kUnit;
  if (capacity_units_ == 0) {
    return Status::InvalidArgument(
        fmt::format("ssd tier: capacity_bytes {} is below one 4 KiB unit", o.capacity_bytes));
  }
  if (o.slab_grow_bytes == 0)
    return Status::InvalidArgument("ssd tier: slab_grow_bytes must be positive");
  if (!(o.hint_bound >= 0 && o.hint_bound <= 1))
    return Status::InvalidArgument(fmt::format("ssd tier: hint_bound {} must be from 0 to 1", o.hint_bound));
  SPARSEKV_RETURN_IF_ERROR(fs_->CreateDirs(o.path));

  rocksdb::Options ro;
  ro.create_if_missing = true;
  ro.info_log_level = rocksdb::WARN_LEVEL;
  ro.keep_log_file_num = 2;
  ro.max_log_file_size = 1 << 20;
  ro.write_buffer_size = 8 << 20;
  ro.max_write_buffer_number = 2;
  ro.max_open_files = 256;
  rocksdb::DB* db = nullptr;
  rocksdb::Status rs = rocksdb::DB::Open(ro, o.path + "/index", &db);
  if (!rs.ok()) return FromRocksDb(rs, "ssd tier: open index " + o.path + "/index");
  db_.reset(db);
  std::string format;
  rs = db_->Get(rocksdb::ReadOptions(), kFormatKey, &format);
  if (rs.IsNotFound()) {
    rs = db_->Put(write_options_, kFormatKey, kFormatValue);
    if (!rs.ok()) return FromRocksDb(rs, "ssd tier: write index format");
  } else if (!rs.ok()) {
    return FromRocksDb(rs, "ssd tier: read index format");
  } else if (format == kSlabFormatValue) {
    return Status::FailedPrecondition(fmt::format(
        "ssd tier: {} holds the slab-file layout of an earlier sparsekv (index format '{}'); this "
        "version stores one data file (format '{}') and cannot read it: remove the directory to "
        "start the tier empty",
        o.path, format, kFormatValue));
  } else if (format == kBundle2FormatValue) {
    return Status::FailedPrecondition(fmt::format(
        "ssd tier: {} holds records of bundle format 2 (index format '{}'), written before "
        "c8_mla pages took CANN's byte order; this version reads format '{}' only: remove the "
        "directory to start the tier empty",
        o.path, format, kFormatValue));
  } else if (format != kFormatValue) {
    return Status::FailedPrecondition(fmt::format(
        "ssd tier: index in {} has format '{}', expected '{}'", o.path, format, kFormatValue));
  }

  data_path_ = o.path + "/" + kDataFileName;
  FileOpenOptions fo;
  fo.create = true;
  fo.direct = true;
  SPARSEKV_ASSIGN_OR_RETURN(file_, fs_->OpenRandomRW(data_path_, fo));
  SPARSEKV_ASSIGN_OR_RETURN(uint64_t size, file_->Size());
  if (o.durability != Durability::kNone) {
    SPARSEKV_RETURN_IF_ERROR(fs_->SyncDir(o.path));  // the file's name must survive a power cut
  }
  {
    MutexLock lock(mu_);
    // Space past the capacity (a smaller capacity than last time) is never allocated again;
    // entries that lie there stay readable until they are evicted or erased.
    file_units_ = size / kUnit;
  }
  SPARSEKV_RETURN_IF_ERROR(LoadIndex());

  if (o.read_arena_bytes >= offload::RecordArena::kGranule) {
    SPARSEKV_ASSIGN_OR_RETURN(arena_, offload::RecordArena::Create(o.read_arena_bytes));
  }
  for (uint32_t i = 0; i < o.io_threads; ++i) {
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<UringQueue> q, UringQueue::Create(o.queue_depth));
    if (arena_ && o.register_buffers) {
      const Status s = q->RegisterRegion(arena_->base(), arena_->bytes());
      if (!s.ok()) spdlog::warn("ssd tier {}: {}; reads use plain I/O", o.path, s.ToString());
    }
    queues_.push_back(std::move(q));
  }
  committer_ = std::thread([this] { CommitLoop(); });
  pthread_setname_np(committer_.native_handle(), "skv-ssd-commit");
  workers_ = std::make_unique<offload::WorkerPool>("skv-ssd", o.io_threads);
  return Status::OK();
}

Status SsdTierImpl::LoadIndex() {
  struct Loaded {
    BundleKey key;
    IndexValue v;
    std::string raw_key;
  };
  std::vector<Loaded> loaded;
  std::vector<std::string> dropped;
  uint64_t file_units;
  {
    MutexLock lock(mu_);
    file_units = file_units_;
  }
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(std::string(1, offload::kBundleKeyTag)); it->Valid(); it->Next()) {
      const std::string_view k = it->key().ToStringView();
      if (k.empty() || k[0] != offload::kBundleKeyTag) break;
      auto key = offload::DecodeBundleKey(k);
      IndexValue v;
      std::string why;
      const std::string_view raw = it->value().ToStringView();
      if (!raw.empty() && static_cast<uint8_t>(raw[0]) > kIndexValueVersion) {
        // A later release's entry: its extent is unknown to this one, so the tier can neither
        // use it nor hand its bytes out as free space. Refused, nothing deleted.
        return Status::FailedPrecondition(fmt::format(
            "ssd tier {}: index entry {} is of index version {}, written by a later release; this "
            "one reads {}: open the directory with that release, or remove it to start the tier "
            "empty",
            options_.path, key ? key->ToString() : std::string("(bad key)"),
            static_cast<uint8_t>(raw[0]), kIndexValueVersion));
      }
      if (!key || !DecodeIndexValue(raw, &v)) {
        why = "undecodable entry";
      } else if (v.record_bytes < BundleHeaderBytes(0) || v.at >= file_units ||
                 UnitsOf(v.record_bytes) > file_units - v.at) {
        why = fmt::format("a record of {} bytes at {} does not lie inside {} ({} bytes)",
                          v.record_bytes, v.at * kUnit, data_path_, file_units * kUnit);
      }
      if (!why.empty()) {
        spdlog::warn("ssd tier {}: dropping index entry {}: {}", options_.path,
                     key ? key->ToString() : std::string("(bad key)"), why);
        dropped.emplace_back(k);
        continue;
      }
      loaded.push_back({*key, std::move(v), std::string(k)});
    }
    if (!it->status().ok()) return FromRocksDb(it->status(), "ssd tier: scan index");
  }
  // Two entries over the same bytes cannot both be right: the later write wins, and its
  // checksum tells on read whether its bytes are really there.
  std::sort(loaded.begin(), loaded.end(),
            [](const Loaded& a, const Loaded& b) { return a.v.at < b.v.at; });
  std::vector<Loaded> kept;
  for (Loaded& l : loaded) {
    if (!kept.empty() && kept.back().v.at + UnitsOf(kept.back().v.record_bytes) > l.v.at) {
      Loaded& other = kept.back();
      Loaded& loser = other.v.written > l.v.written ? l : other;
      spdlog::warn("ssd tier {}: dropping index entry {}: its extent overlaps another entry's",
                   options_.path, loser.key.ToString());
      dropped.push_back(loser.raw_key);
      if (&loser == &other) other = std::move(l);
      continue;
    }
    kept.push_back(std::move(l));
  }
  if (!dropped.empty()) {
    rocksdb::WriteBatch batch;
    for (const auto& k : dropped) batch.Delete(k);
    rocksdb::Status rs = db_->Write(write_options_, &batch);
    if (!rs.ok()) return FromRocksDb(rs, "ssd tier: drop bad index entries");
  }
  MutexLock lock(mu_);
  // Free space: the gaps between entries, up to the capacity.
  const uint64_t usable = std::min(file_units_, capacity_units_);
  uint64_t cursor = 0;
  for (const Loaded& l : kept) {
    if (l.v.at > cursor && cursor < usable)
      free_.AddFree(cursor, std::min(l.v.at, usable) - cursor);
    cursor = std::max(cursor, l.v.at + UnitsOf(l.v.record_bytes));
  }
  if (cursor < usable) free_.AddFree(cursor, usable - cursor);
  // Least recently written first: the best guess of recency a restart has.
  std::sort(kept.begin(), kept.end(),
            [](const Loaded& a, const Loaded& b) { return a.v.written < b.v.written; });
  for (Loaded& l : kept) {
    Entry e;
    e.at = l.v.at;
    e.record_bytes = l.v.record_bytes;
    e.checksum = l.v.checksum;
    e.sequence = l.v.sequence;
    AddEntryLocked(l.key, e);
    stats_.bytes += l.v.record_bytes;
    next_written_ = std::max(next_written_, l.v.written + 1);
    max_sequence_ = std::max(max_sequence_, l.v.sequence);
  }
  details_.recovered = kept.size();
  details_.dropped_at_open = dropped.size();
  if (!kept.empty() || !dropped.empty()) {
    spdlog::info("ssd tier {}: recovered {} bundles, dropped {} bad index entries", options_.path,
                 kept.size(), dropped.size());
  }
  return Status::OK();
}

Result<uint64_t> SsdTierImpl::TakeExtentLocked(uint64_t units, std::vector<BundleKey>* victims,
                                               std::vector<Location>* victim_at) {
  if (auto at = free_.Allocate(units)) return *at;
  // Grow the file while it is under the capacity: a step, or what this record needs beyond the
  // free space at the file's end.
  Status grow_error;
  while (file_units_ < capacity_units_) {
    const uint64_t step = std::max<uint64_t>(1, options_.slab_grow_bytes / kUnit);
    const uint64_t grow = std::min(capacity_units_ - file_units_, std::max(step, units));
    grow_error = file_->Allocate(file_units_ * kUnit, grow * kUnit);
    if (!grow_error.ok()) {
      spdlog::warn("ssd tier {}: growing {}: {}", options_.path, data_path_, grow_error.ToString());
      break;
    }
    free_.AddFree(file_units_, grow);
    file_units_ += grow;
    if (auto at = free_.Allocate(units)) return *at;
  }
  // Full: the eviction order's victims nobody is reading give their space until one fits.
  for (;;) {
    const uint32_t id = eviction_.Victim([&](uint32_t v) SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
      const uint64_t at = entries_.find(id_keys_[v])->second.at;
      if (pins_.count(at) == 0) return false;
      parked_at_[at] = v;  // back in the order when unpinned
      return true;
    });
    if (id == offload::TierEviction::kNone) break;
    auto e = entries_.find(id_keys_[id]);
    const Location l{e->second.at, UnitsOf(e->second.record_bytes), e->second.checksum};
    victims->push_back(e->first);
    victim_at->push_back(l);
    ++stats_.evictions;
    RemoveEntryLocked(e, /*evicted=*/true);
    free_.Free(l.at, l.units);
    if (auto at = free_.Allocate(units)) return *at;
  }
  if (!grow_error.ok()) return grow_error;
  return Status::ResourceExhausted(fmt::format(
      "ssd tier {}: no room for a record of {} bytes: of {} bytes, {} are free in {} pieces "
      "(the largest {} bytes) and the rest is being read or written",
      options_.path, units * kUnit, capacity_units_ * kUnit, free_.free_units() * kUnit,
      free_.free_extents(), free_.largest_free() * kUnit));
}

void SsdTierImpl::RemoveEntryLocked(
    std::unordered_map<BundleKey, Entry, BundleKeyHasher>::iterator it, bool evicted) {
  const uint32_t id = it->second.id;
  if (eviction_.Parked(id)) parked_at_.erase(it->second.at);
  if (evicted) {
    eviction_.Evicted(id);
  } else {
    eviction_.Erase(id);
  }
  spare_ids_.push_back(id);
  stats_.bytes -= it->second.record_bytes;
  if (journal_) journal_->Note(it->first, false);
  entries_.erase(it);
}

void SsdTierImpl::AddEntryLocked(const BundleKey& key, Entry e) {
  if (!spare_ids_.empty()) {
    e.id = spare_ids_.back();
    spare_ids_.pop_back();
    id_keys_[e.id] = key;
  } else {
    e.id = static_cast<uint32_t>(id_keys_.size());
    id_keys_.push_back(key);
  }
  eviction_.Insert(e.id, key, e.record_bytes);
  entries_.emplace(key, e);
  if (journal_) journal_->Note(key, true);
}

void SsdTierImpl::FreeExtentLocked(uint64_t at, uint64_t units) {
  if (pins_.count(at)) {
    free_when_unpinned_[at] = units;
  } else {
    free_.Free(at, units);
  }
}

void SsdTierImpl::UnpinLocked(uint64_t at) {
  auto it = pins_.find(at);
  if (--it->second > 0) return;
  pins_.erase(it);
  auto p = parked_at_.find(at);
  if (p != parked_at_.end()) {
    eviction_.Unbusy(p->second);
    parked_at_.erase(p);
  }
  auto f = free_when_unpinned_.find(at);
  if (f != free_when_unpinned_.end()) {
    free_.Free(at, f->second);
    free_when_unpinned_.erase(f);
  }
}

Status SsdTierImpl::RemoveEntries(const std::vector<BundleKey>& keys,
                                  const std::vector<Location>* only_at,
                                  const std::vector<uint64_t>* below, bool eviction) {
  MutexLock index_lock(index_mu_);
  std::vector<Location> removed;
  rocksdb::WriteBatch batch;
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = entries_.find(keys[i]);
      if (it == entries_.end()) continue;
      if (only_at &&
          ((*only_at)[i].at != it->second.at || (*only_at)[i].checksum != it->second.checksum)) {
        continue;  // replaced since it was read: the new bundle stays
      }
      if (below && it->second.sequence >= (*below)[i]) continue;  // as new as asked, or newer
      removed.push_back({it->second.at, UnitsOf(it->second.record_bytes), it->second.checksum});
      RemoveEntryLocked(it);
      if (eviction) {
        ++stats_.evictions;
      } else if (!only_at) {
        ++stats_.erased;
      }
      batch.Delete(EncodeBundleKey(keys[i]));
    }
  }
  if (removed.empty()) return Status::OK();
  const rocksdb::Status rs = db_->Write(write_options_, &batch);
  MutexLock lock(mu_);
  if (!rs.ok()) {
    // The entries may still be in the index: their bytes must not be rewritten before a restart.
    for (const Location& l : removed) details_.quarantined_bytes += l.units * kUnit;
    return FromRocksDb(rs, "ssd tier: delete index entries");
  }
  for (const Location& l : removed) FreeExtentLocked(l.at, l.units);
  return Status::OK();
}

void SsdTierImpl::WriteData(UringQueue& q, std::vector<BundlePtr> bundles, StatusesCallback done) {
  const size_t n = bundles.size();
  PendingPut put;
  put.st.resize(n);
  put.items.resize(n);
  std::vector<Status>& st = put.st;
  std::vector<Item>& items = put.items;
  uint64_t& io_errors = put.io_errors;

  // Phase A: extents, evicting if needed; evicted entries leave the index before their space is
  // rewritten.
  {
    MutexLock index_lock(index_mu_);
    std::vector<BundleKey> victims;
    std::vector<Location> victim_at;
    {
      MutexLock lock(mu_);
      for (size_t i = 0; i < n; ++i) {
        const Bundle* b = bundles[i].get();
        if (b == nullptr) {
          st[i] = Status::InvalidArgument("ssd tier: null bundle");
          continue;
        }
        if (b->record_bytes() > options_.max_record_bytes ||
            UnitsOf(b->record_bytes()) > capacity_units_) {
          st[i] = Status::InvalidArgument(fmt::format(
              "ssd tier {}: bundle {} of {} bytes exceeds the largest record the tier takes ({} "
              "bytes: max_record_bytes, at most the capacity)",
              options_.path, b->key().ToString(), b->record_bytes(),
              std::min(options_.max_record_bytes, capacity_units_ * kUnit)));
          continue;
        }
        auto e = entries_.find(b->key());
        if (e != entries_.end() && !unpublished_.count(b->key())) {
          if (e->second.sequence > b->sequence()) {
            ++stats_.superseded;  // a newer copy is held: this one must not replace it
            continue;
          }
          if (e->second.sequence == b->sequence() && e->second.checksum == b->checksum() &&
              e->second.record_bytes == b->record_bytes()) {
            eviction_.Refresh(e->second.id);  // the same bundle: only its recency
            continue;
          }
        }
        const uint64_t units = UnitsOf(b->record_bytes());
        Result<uint64_t> at = TakeExtentLocked(units, &victims, &victim_at);
        if (!at.ok()) {
          st[i] = at.status();
          continue;
        }
        Item& it = items[i];
        it.write = true;
        it.after_eviction = !victims.empty();
        it.at = *at;
        it.units = units;
        ++unpublished_[b->key()];
      }
    }
    if (!victims.empty()) {
      rocksdb::WriteBatch batch;
      for (const BundleKey& v : victims) batch.Delete(EncodeBundleKey(v));
      const rocksdb::Status rs = db_->Write(write_options_, &batch);
      if (!rs.ok()) {
        // The victims may still be named by the index: nothing may be written over them, so the
        // puts that may have taken their space fail, and the space is held back until restart.
        const Status s = FromRocksDb(rs, "ssd tier: delete evicted index entries");
        MutexLock lock(mu_);
        for (size_t i = 0; i < n; ++i) {
          if (!items[i].write || !items[i].after_eviction) continue;
          items[i].write = false;
          auto u = unpublished_.find(bundles[i]->key());
          if (--u->second == 0) unpublished_.erase(u);
          st[i] = s;
          details_.quarantined_bytes += items[i].units * kUnit;
        }
        for (const Location& l : victim_at)
          details_.quarantined_bytes += free_.RemoveFreeWithin(l.at, l.units) * kUnit;
      }
    }
  }

  // Phase B: the data, straight from each bundle's memory, cut into I/Os of at most io_bytes,
  // queue_depth deep.
  std::vector<std::pair<uint32_t, uint32_t>> ops;  // (item, chunk)
  const uint64_t io = options_.io_bytes;
  for (size_t i = 0; i < n; ++i) {
    if (!items[i].write) continue;
    for (uint64_t c = 0; c * io < items[i].units * kUnit; ++c)
      ops.emplace_back(static_cast<uint32_t>(i), static_cast<uint32_t>(c));
  }
  const int rw_flags = options_.durability == Durability::kDsync ? RWF_DSYNC : 0;
  const Status ring = q.Run(
      ops.size(),
      [&](uint64_t k, UringOp& op) {
        const auto [i, c] = ops[k];
        const Item& it = items[i];
        const uint64_t off = uint64_t{c} * io;
        op.file = file_.get();
        op.kind = AsyncIo::Kind::kWrite;
        op.offset = it.at * kUnit + off;
        // Written, never changed: the hooks leave a write's bytes alone (file_system.h).
        op.data = const_cast<std::byte*>(bundles[i]->padded_record().data()) + off;
        op.length = std::min(io, it.units * kUnit - off);
        op.rw_flags = rw_flags;
      },
      [&](uint64_t k, const UringOp& op) {
        const uint32_t i = ops[k].first;
        if (op.result < 0 && st[i].ok()) {
          ++io_errors;
          st[i] = ErrnoStatus(-op.result,
                              fmt::format("ssd tier: write {} at {}", data_path_, op.offset));
        }
      });
  (void)ring;  // its failure reached every op it affected
  put.bundles = std::move(bundles);
  put.done = std::move(done);
  {
    MutexLock lock(commit_mu_);
    commit_queue_.push_back(std::move(put));
  }
  commit_cv_.notify_one();
}

void SsdTierImpl::CommitLoop() {
  for (;;) {
    std::vector<PendingPut> group;
    {
      MutexLock lock(commit_mu_);
      commit_cv_.wait(commit_mu_, [this]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
        return commit_stop_ || !commit_queue_.empty();
      });
      if (commit_queue_.empty()) return;  // stopping, nothing left
      while (!commit_queue_.empty()) {
        group.push_back(std::move(commit_queue_.front()));
        commit_queue_.pop_front();
      }
    }
    Commit(group);
    for (PendingPut& p : group) p.done(std::move(p.st));
  }
}

void SsdTierImpl::Commit(std::vector<PendingPut>& group) {
  // Data first: one fdatasync of the data file for the whole group.
  if (options_.durability == Durability::kFdatasync) {
    bool wrote = false;
    for (const PendingPut& p : group) {
      for (size_t i = 0; i < p.items.size(); ++i) wrote |= p.items[i].write && p.st[i].ok();
    }
    const Status s = wrote ? file_->Sync() : Status::OK();
    if (!s.ok()) {
      for (PendingPut& p : group) {
        ++p.io_errors;
        for (size_t i = 0; i < p.items.size(); ++i) {
          if (p.items[i].write && p.st[i].ok()) p.st[i] = s.WithContext("ssd tier");
        }
      }
    }
  }

  // Then the index entries of the records now durable, and the in-memory index, in batch order.
  // Of several versions of one key, only the newest is published, and none over a newer one
  // already held.
  MutexLock index_lock(index_mu_);
  rocksdb::WriteBatch batch;
  std::unordered_map<BundleKey, std::pair<size_t, size_t>, BundleKeyHasher> newest;  // (p, i)
  {
    MutexLock lock(mu_);
    for (size_t g = 0; g < group.size(); ++g) {
      PendingPut& p = group[g];
      for (size_t i = 0; i < p.items.size(); ++i) {
        const Item& it = p.items[i];
        if (!it.write) continue;
        if (!p.st[i].ok()) continue;
        const Bundle& b = *p.bundles[i];
        auto held = entries_.find(b.key());
        if (held != entries_.end() && held->second.sequence > b.sequence()) {
          p.items[i].write = false;  // superseded: its space goes back below
          ++stats_.superseded;
          FreeExtentLocked(it.at, it.units);
          auto u = unpublished_.find(b.key());
          if (--u->second == 0) unpublished_.erase(u);
          continue;
        }
        auto [slot, fresh] = newest.try_emplace(b.key(), g, i);
        if (!fresh) {
          PendingPut& op = group[slot->second.first];
          const size_t oi = slot->second.second;
          const bool ours_newer = b.sequence() >= op.bundles[oi]->sequence();
          PendingPut& lp = ours_newer ? op : p;  // the loser
          const size_t li = ours_newer ? oi : i;
          lp.items[li].write = false;
          ++stats_.superseded;
          FreeExtentLocked(lp.items[li].at, lp.items[li].units);
          auto u = unpublished_.find(b.key());
          if (--u->second == 0) unpublished_.erase(u);
          if (ours_newer) slot->second = {g, i};
        }
      }
    }
    for (const auto& [key, at] : newest) {
      PendingPut& p = group[at.first];
      const size_t i = at.second;
      const Item& it = p.items[i];
      const Bundle& b = *p.bundles[i];
      IndexValue v;
      v.at = it.at;
      v.record_bytes = b.record_bytes();
      v.checksum = b.checksum();
      v.sequence = b.sequence();
      v.written = next_written_++;
      v.segment_bytes = SegmentsOf(b);
      batch.Put(EncodeBundleKey(b.key()), EncodeIndexValue(v));
    }
  }
  const rocksdb::Status rs =
      batch.Count() ? db_->Write(write_options_, &batch) : rocksdb::Status::OK();
  MutexLock lock(mu_);
  for (PendingPut& p : group) {
    for (size_t i = 0; i < p.items.size(); ++i) {
      const Item& it = p.items[i];
      if (it.write) {
        auto u = unpublished_.find(p.bundles[i]->key());
        if (--u->second == 0) unpublished_.erase(u);
        if (!p.st[i].ok()) {
          FreeExtentLocked(it.at, it.units);  // nothing names it
        } else if (!rs.ok()) {
          p.st[i] = FromRocksDb(rs, "ssd tier: write index entries");
          details_.quarantined_bytes += it.units * kUnit;  // the entry may have landed after all
        } else {
          const Bundle& b = *p.bundles[i];
          auto old = entries_.find(b.key());
          if (old != entries_.end()) {
            const uint64_t oat = old->second.at;
            const uint64_t ounits = UnitsOf(old->second.record_bytes);
            RemoveEntryLocked(old);
            FreeExtentLocked(oat, ounits);  // the index entry just written replaced its entry
          }
          Entry e;
          e.at = it.at;
          e.record_bytes = b.record_bytes();
          e.checksum = b.checksum();
          e.sequence = b.sequence();
          AddEntryLocked(b.key(), e);
          max_sequence_ = std::max(max_sequence_, b.sequence());
          stats_.bytes += b.record_bytes();
          stats_.bytes_written += it.units * kUnit;
        }
      }
      if (p.st[i].ok()) {
        ++stats_.puts;
      } else {
        ++stats_.put_failures;
      }
    }
    stats_.io_errors += p.io_errors;
  }
}

std::vector<Status> SsdTierImpl::DoReadSectors(UringQueue& q, std::span<const SectorRead> reads,
                                               std::vector<SectorRecord>* records) {
  std::vector<Status> out(reads.size());
  if (records != nullptr) records->assign(reads.size(), SectorRecord{});
  std::vector<uint64_t> at(reads.size(), 0);  // file offset of each read, 0: not read
  std::unordered_set<uint64_t> pinned;  // extents, each pinned once
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < reads.size(); ++i) {
      const SectorRead& r = reads[i];
      auto e = entries_.find(r.key);
      if (e == entries_.end()) {
        ++stats_.misses;
        out[i] = Status::NotFound("ssd tier: no bundle " + r.key.ToString());
        continue;
      }
      if (records != nullptr) (*records)[i] = {e->second.record_bytes, e->second.sequence};
      if (r.sector % kUnit != 0 || r.sector >= UnitsOf(e->second.record_bytes) * kUnit ||
          reinterpret_cast<uintptr_t>(r.out) % kUnit != 0) {
        out[i] = Status::InvalidArgument(fmt::format(
            "ssd tier: sector {} of {} (a record of {} bytes), into {}: sectors are 4 KiB-aligned, inside the "
            "record, into 4 KiB-aligned memory",
            r.sector, r.key.ToString(), e->second.record_bytes, static_cast<const void*>(r.out)));
        continue;
      }
      if (pinned.insert(e->second.at).second) {
        ++pins_[e->second.at];
        ++stats_.hits;
        eviction_.Touch(e->second.id);  // read: recently used
      }
      at[i] = e->second.at * kUnit + r.sector + 1;  // + 1: offset 0 is a real place
    }
  }
  std::vector<uint32_t> ops;
  for (size_t i = 0; i < reads.size(); ++i) {
    if (at[i] != 0) ops.push_back(static_cast<uint32_t>(i));
  }
  uint64_t io_errors = 0;
  const Status ring = q.Run(
      ops.size(),
      [&](uint64_t k, UringOp& op) {
        const uint32_t i = ops[k];
        op.file = file_.get();
        op.kind = AsyncIo::Kind::kRead;
        op.offset = at[i] - 1;
        op.data = reads[i].out;
        op.length = kUnit;
      },
      [&](uint64_t k, const UringOp& op) {
        if (op.result == static_cast<int>(kUnit)) return;
        ++io_errors;
        out[ops[k]] = op.result < 0
                          ? ErrnoStatus(-op.result, fmt::format("ssd tier: read {} at {}", data_path_, op.offset))
                          : Status::IOError(fmt::format("ssd tier: read {} at {}: {} bytes of {}", data_path_,
                                                        op.offset, op.result, kUnit));
      });
  MutexLock lock(mu_);
  for (uint64_t a : pinned) UnpinLocked(a);
  stats_.io_errors += io_errors;
  stats_.bytes_read += ops.size() * kUnit;
  if (!ring.ok()) {
    for (uint32_t i : ops) {
      if (out[i].ok()) out[i] = ring;
    }
  }
  return out;
}

void SsdTierImpl::ReadStream(UringQueue& q) {
  // Bytes of records one stream takes on before it lets the tasks queued behind it run.
  constexpr uint64_t kStreamBytes = 1ull << 30;
  std::vector<std::unique_ptr<ReadBatch>> batches;  // kept until the stream ends: pieces point in
  std::deque<ReadPiece> pieces;                     // op k of the ring is pieces[k]
  uint64_t handed = 0;                              // pieces handed to the ring so far
  uint64_t taken_bytes = 0;
  auto more = [&]() -> uint64_t {
    while (pieces.size() == handed && taken_bytes < kStreamBytes) {
      std::unique_ptr<ReadBatch> b;
      {
        MutexLock lock(read_mu_);
        if (read_queue_.empty()) break;
        b = std::move(read_queue_.front());
        read_queue_.pop_front();
      }
      ReadBatch& batch = *b;
      batches.push_back(std::move(b));
      const size_t before = pieces.size();
      PlanRead(batch, pieces);
      for (size_t k = before; k < pieces.size(); ++k) taken_bytes += pieces[k].length;
      if (batch.unsettled == 0) FinishRead(batch);  // nothing to read: every key missed
    }
    const uint64_t n = pieces.size() - handed;
    handed = pieces.size();
    return n;
  };
  const Status ring = q.Run(
      0,
      [&](uint64_t k, UringOp& op) {
        const ReadPiece& p = pieces[k];
        op.file = file_.get();
        op.kind = AsyncIo::Kind::kRead;
        op.offset = p.offset;
        op.data = p.data;
        op.length = p.length;
      },
      [&](uint64_t k, const UringOp& op) {
        const ReadPiece p = pieces[k];  // a copy: a retry may append to `pieces`
        PieceDone(p, op.result, pieces);
      },
      more);
  (void)ring;  // its failure reached every op it affected
  // Every batch is answered, even one whose accounting went wrong: never a record unread.
  for (auto& b : batches) {
    if (!b->done) continue;
    spdlog::error("ssd tier {}: a read batch was left unsettled; failing its unread records", options_.path);
    for (ReadItem& it : b->items) {
      if (it.found && it.bundle == nullptr && it.st.ok())
        it.st = Status::Internal("ssd tier: the read of this record never completed");
    }
    FinishRead(*b);
  }
}

void SsdTierImpl::PlanRead(ReadBatch& b, std::deque<ReadPiece>& pieces) {
  const size_t n = b.keys.size();
  b.items.resize(n);
  std::vector<uint32_t> order;
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      auto e = entries_.find(b.keys[i]);
      if (e == entries_.end()) {
        ++stats_.misses;
        continue;
      }
      ReadItem& it = b.items[i];
      eviction_.Touch(e->second.id);
      it.found = true;
      it.record_bytes = e->second.record_bytes;
      it.aligned = UnitsOf(it.record_bytes) * kUnit;
      it.loc = {e->second.at, UnitsOf(it.record_bytes), e->second.checksum};
      it.offset = e->second.at * kUnit;
      ++pins_[it.loc.at];
      order.push_back(static_cast<uint32_t>(i));
    }
  }
  b.unsettled = order.size();
  std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
    return b.items[x].offset < b.items[y].offset || (b.items[x].offset == b.items[y].offset && x < y);
  });
  // A gap as long as an I/O could leave an I/O covering no record: gaps stay shorter.
  const uint64_t gap_limit = std::min(options_.read_gap_bytes, options_.io_bytes - kUnit);
  const uint64_t group_limit = options_.read_coalesce_bytes;
  std::vector<ReadGroup> ranges;
  for (uint32_t i : order) {
    const ReadItem& it = b.items[i];
    if (!ranges.empty()) {
      ReadGroup& g = ranges.back();
      const uint64_t end = g.offset + g.bytes;
      if (it.offset >= end && it.offset - end <= gap_limit && it.offset + it.aligned - g.offset <= group_limit) {
        g.bytes = it.offset + it.aligned - g.offset;
        g.items.push_back(i);
        continue;
      }
    }
    ReadGroup g;
    g.offset = it.offset;
    g.bytes = it.aligned;
    g.items.push_back(i);
    ranges.push_back(std::move(g));
  }
  // The bundles will own this memory: the registered arena when it has room, else the heap. A
  // range the arena cannot hold is halved (by records) until the parts fit, so that reads keep
  // landing in registered, pre-faulted memory; a single record it cannot hold goes to the heap.
  std::function<void(ReadGroup)> place = [&](ReadGroup g) {
    RecordBuffer buf;
    if (arena_) buf = arena_->TryAllocate(g.bytes);
    if (!buf && arena_ && g.items.size() > 1) {
      for (int half = 0; half < 2; ++half) {
        const size_t mid = g.items.size() / 2;
        ReadGroup part;
        part.items.assign(g.items.begin() + (half ? static_cast<std::ptrdiff_t>(mid) : 0),
                          half ? g.items.end() : g.items.begin() + static_cast<std::ptrdiff_t>(mid));
        const ReadItem& first = b.items[part.items.front()];
        const ReadItem& last = b.items[part.items.back()];
        part.offset = first.offset;
        part.bytes = last.offset + last.aligned - first.offset;
        place(std::move(part));
      }
      return;
    }
    if (!buf) buf = RecordBuffer::Allocate(g.bytes);
    g.data = buf.data();
    b.groups.push_back(std::move(g));
    ReadGroup& placed = b.groups.back();
    placed.data = buf.data();
    if (placed.items.size() == 1) {
      b.items[placed.items[0]].buf = std::move(buf);
    } else {
      placed.owner = std::make_shared<RecordBuffer>(std::move(buf));
      for (uint32_t i : placed.items) {
        ReadItem& it = b.items[i];
        it.buf = RecordBuffer(placed.data + (it.offset - placed.offset), it.aligned,
                              [owner = placed.owner](std::byte*) { (void)owner; });
      }
    }
  };
  for (ReadGroup& g : ranges) place(std::move(g));
  for (uint32_t gi = 0; gi < b.groups.size(); ++gi) AddGroupPieces(b, gi, pieces);
}

void SsdTierImpl::AddGroupPieces(ReadBatch& b, uint32_t group, std::deque<ReadPiece>& pieces) {
  const ReadGroup& g = b.groups[group];
  const uint64_t io = options_.io_bytes;
  for (uint64_t off = 0; off < g.bytes; off += io)
    pieces.push_back({&b, group, g.offset + off, std::min(io, g.bytes - off), g.data + off});
  for (uint32_t i : g.items) {
    ReadItem& it = b.items[i];
    const uint64_t rel = it.offset - g.offset;
    it.pieces_left = static_cast<uint32_t>((rel + it.aligned - 1) / io - rel / io + 1);
  }
}

void SsdTierImpl::PieceDone(const ReadPiece& p, int result, std::deque<ReadPiece>& pieces) {
  ReadBatch& b = *p.batch;
  const ReadGroup& g = b.groups[p.group];
  const bool failed = result < 0;
  if (failed) ++b.io_errors;
  const bool coalesced = g.items.size() > 1;
  const std::vector<uint32_t> items = g.items;  // ItemRead may add groups
  for (uint32_t i : items) {
    ReadItem& it = b.items[i];
    if (it.offset >= p.offset + p.length || it.offset + it.aligned <= p.offset) continue;
    if (failed && it.st.ok()) {
      it.st = ErrnoStatus(-result, fmt::format("ssd tier: read {} at {}", data_path_, p.offset));
    }
    if (--it.pieces_left == 0) ItemRead(b, i, coalesced, pieces);
  }
}

void SsdTierImpl::ItemRead(ReadBatch& b, uint32_t i, bool coalesced, std::deque<ReadPiece>& pieces) {
  ReadItem& it = b.items[i];
  if (!it.st.ok()) {
    if (coalesced && !it.retried) {
      // The failed I/O covered other records too: read this one alone, so that only a record
      // whose own bytes cannot be read fails.
      it.retried = true;
      it.st = Status::OK();
      ReadGroup g;
      g.offset = it.offset;
      g.bytes = it.aligned;
      g.data = it.buf.data();
      g.items.push_back(i);
      b.groups.push_back(std::move(g));
      AddGroupPieces(b, static_cast<uint32_t>(b.groups.size() - 1), pieces);
      return;
    }
  } else {
    // The whole record is here: check it now, while later reads are in flight. The extent's
    // padding is not the bundle's: zero it, as a RecordBuffer promises.
    std::memset(it.buf.data() + it.record_bytes, 0, it.aligned - it.record_bytes);
    Result<BundlePtr> r = Bundle::AdoptRecord(std::move(it.buf), it.record_bytes, b.keys[i]);
    if (!r.ok()) {
      it.st = r.status().WithContext(fmt::format("ssd tier: {} at {}", data_path_, it.offset));
    } else if ((*r)->checksum() != it.loc.checksum) {
      it.st = Status::Corruption(fmt::format(
          "ssd tier: {} at {}: bundle {} holds checksum {:016x}, the index expects {:016x} (a "
          "stale record)",
          data_path_, it.offset, b.keys[i].ToString(), (*r)->checksum(), it.loc.checksum));
    } else {
      it.bundle = std::move(*r);
    }
  }
  if (--b.unsettled == 0) FinishRead(b);
}

void SsdTierImpl::FinishRead(ReadBatch& b) {
  const size_t n = b.keys.size();
  std::vector<BundleKey> corrupt_keys;
  std::vector<Location> corrupt_at;
  for (size_t i = 0; i < n; ++i) {
    if (b.items[i].found && b.items[i].st.Is(StatusCode::kCorruption)) {
      spdlog::warn("{}; erasing it", b.items[i].st.ToString());
      corrupt_keys.push_back(b.keys[i]);
      corrupt_at.push_back(b.items[i].loc);
    }
  }
  if (!corrupt_keys.empty()) {
    const Status s = RemoveEntries(corrupt_keys, &corrupt_at, nullptr, /*eviction=*/false);
    if (!s.ok())
      spdlog::warn("ssd tier {}: erasing corrupt bundles: {}", options_.path, s.ToString());
  }

  std::vector<Result<BundlePtr>> out;
  out.reserve(n);
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      ReadItem& it = b.items[i];
      if (!it.found) {
        out.emplace_back(Status::NotFound("ssd tier: no bundle " + b.keys[i].ToString()));
        continue;
      }
      UnpinLocked(it.loc.at);
      if (it.st.ok()) {
        ++stats_.hits;
        stats_.bytes_read += it.aligned;
        out.emplace_back(std::move(it.bundle));
      } else if (IsOtherBundleVersion(it.st)) {
        // Another release's record (a directory handed between releases): a miss, counted, its
        // entry and bytes left in place for its writer and for eviction.
        auto e = entries_.find(b.keys[i]);
        if (e != entries_.end() && e->second.at == it.loc.at) e->second.other_version = true;
        ++stats_.other_version;
        ++stats_.misses;
        out.emplace_back(Status::NotFound(std::string(it.st.message())));
      } else {
        if (it.st.Is(StatusCode::kCorruption)) ++stats_.corrupt;
        out.emplace_back(std::move(it.st));
      }
    }
    stats_.io_errors += b.io_errors;
    for (const ReadGroup& g : b.groups) {
      ++details_.read_groups;
      if (g.items.size() > 1) details_.coalesced_records += g.items.size();
    }
  }
  // The memory of records that failed goes back now, not when the stream ends.
  b.items.clear();
  for (ReadGroup& g : b.groups) g.owner.reset();
  BundlesCallback done = std::move(b.done);
  done(std::move(out));
}
}  // namespace

Result<std::unique_ptr<SsdTier>> SsdTier::Open(const SsdTierOptions& options, FileSystem* fs) {
  auto tier = std::make_unique<SsdTierImpl>(options, fs ? fs : FileSystem::Default());
  SPARSEKV_RETURN_IF_ERROR(tier->Init());
  return std::unique_ptr<SsdTier>(std::move(tier));
}

}  // namespace sparsekv
