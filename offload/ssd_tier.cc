// The SSD tier: slab files on io_uring + O_DIRECT, indexed in RocksDB (ssd_tier.h).
//
// Locks: index_mu_ orders every change of the RocksDB index with the matching change of the
// in-memory index, so the two agree in the order a restart replays; it is taken before mu_.
// mu_ guards the in-memory state (entries, slab classes, free slots, pins, statistics) and is
// never held across I/O or a RocksDB call, except while a slab file is created or grown.
//
// Slot lifecycle: free -> reserved by a put -> named by an index entry -> (erase, eviction,
// replacement, corruption) removed from memory, its index entry deleted, and only then free
// again. A slot being read is pinned; freeing a pinned slot waits for the last reader. A slot
// whose index entry may or may not have been deleted (the RocksDB write failed) is quarantined
// until the next open, which rebuilds the free lists from the index.
#include "sparsekv/ssd_tier.h"

#include <fmt/format.h>
#include <pthread.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>
#include <sys/uio.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <queue>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "io_status.h"
#include "key_codec.h"
#include "record_arena.h"
#include "sparsekv/thread_annotations.h"
#include "uring_queue.h"
#include "worker_pool.h"

namespace sparsekv {

uint64_t SsdSlabClassBytes(uint64_t record_bytes) {
  const uint64_t a = (std::max<uint64_t>(record_bytes, 1) + kDirectIoAlignment - 1) /
                     kDirectIoAlignment * kDirectIoAlignment;
  if (a <= 8 * kDirectIoAlignment) return a;
  // Eight classes per doubling: at most 1/8 of a slot is padding.
  const uint64_t step = std::bit_floor(a) / 8;
  return (a + step - 1) / step * step;
}

namespace {

using offload::EncodeBundleKey;
using offload::ErrnoStatus;
using offload::FromRocksDb;
using offload::UringOp;
using offload::UringQueue;

constexpr char kFormatKey[] = "m:format";
constexpr char kFormatValue[] = "sparsekv-ssd-index-1";
constexpr uint8_t kIndexValueVersion = 1;

uint64_t AlignUp(uint64_t v) {
  return (v + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
}

std::string SlabFileName(uint64_t class_bytes) {
  return fmt::format("slab-{}.dat", class_bytes);
}

// Class bytes of a slab file name, or 0 if the name is not one.
uint64_t ParseSlabFileName(std::string_view name) {
  if (!name.starts_with("slab-") || !name.ends_with(".dat")) return 0;
  const std::string_view digits = name.substr(5, name.size() - 9);
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || p != digits.data() + digits.size()) return 0;
  return v;
}

// Index value: where a record lies and what it holds.
struct IndexValue {
  uint64_t class_bytes = 0;
  uint32_t slot = 0;
  uint64_t record_bytes = 0;
  uint64_t checksum = 0;
  uint64_t sequence = 0;  // put order, to rebuild the LRU at open
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
  Append(out, v.class_bytes);
  Append(out, v.slot);
  Append(out, v.record_bytes);
  Append(out, v.checksum);
  Append(out, v.sequence);
  Append<uint16_t>(out, static_cast<uint16_t>(v.segment_bytes.size()));
  for (uint32_t s : v.segment_bytes) Append(out, s);
  return out;
}

bool DecodeIndexValue(std::string_view in, IndexValue* v) {
  uint8_t version = 0;
  uint16_t count = 0;
  if (!Take(in, &version) || version != kIndexValueVersion || !Take(in, &v->class_bytes) ||
      !Take(in, &v->slot) || !Take(in, &v->record_bytes) || !Take(in, &v->checksum) ||
      !Take(in, &v->sequence) || !Take(in, &count) || in.size() != 4ull * count) {
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

uint64_t SlotKey(uint32_t cls, uint32_t slot) {
  return (uint64_t{cls} << 32) | slot;
}

class SsdTierImpl final : public SsdTier {
 public:
  SsdTierImpl(SsdTierOptions options, FileSystem* fs) : options_(std::move(options)), fs_(fs) {
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
  uint64_t capacity_bytes() const override { return options_.capacity_bytes; }
  uint64_t max_record_bytes() const override { return options_.max_record_bytes; }

  TierStats Stats() const override {
    MutexLock lock(mu_);
    TierStats s = stats_;
    s.name = options_.name;
    s.capacity_bytes = options_.capacity_bytes;
    s.items = entries_.size();
    return s;
  }

  SsdTierDetails Details() const override {
    MutexLock lock(mu_);
    SsdTierDetails d = details_;
    d.slab_files = classes_.size();
    d.allocated_bytes = allocated_bytes_;
    d.free_slots = 0;
    for (const auto& c : classes_) d.free_slots += c->free_slots.size();
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
    workers_->Submit([this, keys = std::move(keys), done = std::move(done)](size_t w) mutable {
      done(DoGet(*queues_[w], keys));
    });
  }

  void ContainsAsync(std::vector<BundleKey> keys, ContainsCallback done) override {
    std::vector<bool> out(keys.size());
    {
      MutexLock lock(mu_);
      for (size_t i = 0; i < keys.size(); ++i) out[i] = entries_.count(keys[i]) != 0;
    }
    done(std::move(out));
  }

  void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) override {
    workers_->Submit([this, keys = std::move(keys), done = std::move(done)](size_t) mutable {
      std::vector<Status> out(keys.size());
      const Status s = RemoveEntries(keys, nullptr, /*eviction=*/false);
      for (auto& o : out) o = s;
      done(std::move(out));
    });
  }

  Result<SsdRecordLocation> Locate(const BundleKey& key) const override {
    SsdRecordLocation loc;
    {
      MutexLock lock(mu_);
      auto it = entries_.find(key);
      if (it == entries_.end()) return Status::NotFound("ssd tier: no bundle " + key.ToString());
      const SlabClass& c = *classes_[it->second.cls];
      loc.file = c.path;
      loc.offset = uint64_t{it->second.slot} * c.class_bytes;
      loc.record_bytes = it->second.record_bytes;
      loc.checksum = it->second.checksum;
    }
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), EncodeBundleKey(key), &value);
    IndexValue v;
    if (s.ok() && DecodeIndexValue(value, &v)) loc.segment_bytes = v.segment_bytes;
    return loc;
  }

  std::vector<BundleKey> Keys() const override {
    MutexLock lock(mu_);
    std::vector<BundleKey> out;
    out.reserve(entries_.size());
    for (const auto& [k, e] : entries_) out.push_back(k);
    return out;
  }

 private:
  struct SlabClass {
    uint64_t class_bytes = 0;
    std::string path;
    std::unique_ptr<RandomRWFile> file;  // never replaced once open: I/O uses it unlocked
    uint32_t slot_count = 0;
    std::priority_queue<uint32_t, std::vector<uint32_t>, std::greater<>>
        free_slots;            // lowest first
    std::list<BundleKey> lru;  // front: least recent
  };
  struct Entry {
    uint32_t cls = 0;
    uint32_t slot = 0;
    uint64_t record_bytes = 0;
    uint64_t checksum = 0;
    std::list<BundleKey>::iterator lru;
  };
  // Where a read found a bundle; a corrupt one is removed only if it is still there.
  struct Location {
    uint32_t cls = 0;
    uint32_t slot = 0;
    uint64_t checksum = 0;
  };

  // A put batch between its data writes (I/O thread) and its index update (committer).
  struct Item {
    bool write = false;
    bool reused_victim = false;  // the slot came from an eviction in this batch
    uint32_t cls = 0;
    uint32_t slot = 0;
    uint64_t class_bytes = 0;
    uint64_t aligned = 0;
    RandomRWFile* file = nullptr;
  };
  struct PendingPut {
    std::vector<BundlePtr> bundles;
    std::vector<Item> items;
    std::vector<Status> st;
    uint64_t io_errors = 0;
    StatusesCallback done;
  };
  // Phases A (slots) and B (data) of a put, on an I/O thread; queues the batch for the committer.
  void WriteData(UringQueue& q, std::vector<BundlePtr> bundles, StatusesCallback done)
      SPARSEKV_EXCLUDES(mu_, index_mu_, commit_mu_);
  // The committer thread: takes every batch waiting, syncs each slab file they wrote once, writes
  // all their index entries in one RocksDB batch, publishes them in order, then acknowledges.
  void CommitLoop() SPARSEKV_EXCLUDES(mu_, index_mu_, commit_mu_);
  void Commit(std::vector<PendingPut>& group) SPARSEKV_EXCLUDES(mu_, index_mu_);
  std::vector<Result<BundlePtr>> DoGet(UringQueue& q, const std::vector<BundleKey>& keys)
      SPARSEKV_EXCLUDES(mu_, index_mu_);
  Status RemoveEntries(const std::vector<BundleKey>& keys, const std::vector<Location>* only_at,
                       bool eviction) SPARSEKV_EXCLUDES(mu_, index_mu_);

  Result<uint32_t> ClassForLocked(uint64_t record_bytes) SPARSEKV_REQUIRES(mu_);
  Result<uint32_t> TakeSlotLocked(uint32_t cls, std::vector<BundleKey>* victims)
      SPARSEKV_REQUIRES(mu_);
  void RemoveEntryLocked(std::unordered_map<BundleKey, Entry, BundleKeyHasher>::iterator it)
      SPARSEKV_REQUIRES(mu_);
  void FreeSlotLocked(uint32_t cls, uint32_t slot) SPARSEKV_REQUIRES(mu_);
  void UnpinLocked(uint32_t cls, uint32_t slot) SPARSEKV_REQUIRES(mu_);
  Status OpenSlabFileLocked(uint64_t class_bytes, bool create) SPARSEKV_REQUIRES(mu_);
  Status LoadIndex() SPARSEKV_EXCLUDES(mu_);

  const SsdTierOptions options_;
  FileSystem* const fs_;
  rocksdb::WriteOptions write_options_;
  std::unique_ptr<rocksdb::DB> db_;
  std::shared_ptr<offload::RecordArena> arena_;      // shared with the bundles it holds
  std::vector<std::unique_ptr<UringQueue>> queues_;  // queues_[w] is used only by worker w
  std::unique_ptr<offload::WorkerPool> workers_;

  Mutex commit_mu_;
  std::condition_variable_any commit_cv_;
  std::deque<PendingPut> commit_queue_ SPARSEKV_GUARDED_BY(commit_mu_);
  bool commit_stop_ SPARSEKV_GUARDED_BY(commit_mu_) = false;
  std::thread committer_;

  Mutex index_mu_;
  mutable Mutex mu_;
  std::unordered_map<BundleKey, Entry, BundleKeyHasher> entries_ SPARSEKV_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<SlabClass>> classes_ SPARSEKV_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, uint32_t> class_index_
      SPARSEKV_GUARDED_BY(mu_);  // class bytes -> classes_ index
  std::unordered_map<uint64_t, uint32_t> pins_ SPARSEKV_GUARDED_BY(mu_);  // SlotKey -> readers
  std::unordered_set<uint64_t> free_when_unpinned_ SPARSEKV_GUARDED_BY(mu_);
  // Keys with a put written or being written but not yet in the index: a put of the same bytes
  // as the published bundle must not be skipped then, or the older put would land last.
  std::unordered_map<BundleKey, uint32_t, BundleKeyHasher> unpublished_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t allocated_bytes_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t next_sequence_ SPARSEKV_GUARDED_BY(mu_) = 1;
  TierStats stats_ SPARSEKV_GUARDED_BY(mu_);
  SsdTierDetails details_ SPARSEKV_GUARDED_BY(mu_);
};

Status SsdTierImpl::OpenSlabFileLocked(uint64_t class_bytes, bool create) {
  auto c = std::make_unique<SlabClass>();
  c->class_bytes = class_bytes;
  c->path = options_.path + "/" + SlabFileName(class_bytes);
  FileOpenOptions fo;
  fo.create = create;
  fo.direct = true;
  SPARSEKV_ASSIGN_OR_RETURN(c->file, fs_->OpenRandomRW(c->path, fo));
  SPARSEKV_ASSIGN_OR_RETURN(uint64_t size, c->file->Size());
  c->slot_count = static_cast<uint32_t>(std::min<uint64_t>(size / class_bytes, UINT32_MAX));
  if (create && options_.durability != Durability::kNone) {
    SPARSEKV_RETURN_IF_ERROR(
        fs_->SyncDir(options_.path));  // the new file's name must survive a power cut
  }
  allocated_bytes_ += uint64_t{c->slot_count} * class_bytes;
  class_index_[class_bytes] = static_cast<uint32_t>(classes_.size());
  classes_.push_back(std::move(c));
  return Status::OK();
}

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
  if (o.max_record_bytes < BundleHeaderBytes(0) || o.max_record_bytes > (1ull << 32)) {
    return Status::InvalidArgument(
        fmt::format("ssd tier: max_record_bytes {} is not in [{}, 4 GiB]", o.max_record_bytes,
                    BundleHeaderBytes(0)));
  }
  if (o.capacity_bytes < SsdSlabClassBytes(1)) {
    return Status::InvalidArgument(
        fmt::format("ssd tier: capacity_bytes {} is below one 4 KiB slot", o.capacity_bytes));
  }
  if (o.slab_grow_bytes == 0)
    return Status::InvalidArgument("ssd tier: slab_grow_bytes must be positive");
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
  } else if (format != kFormatValue) {
    return Status::FailedPrecondition(fmt::format(
        "ssd tier: index in {} has format '{}', expected '{}'", o.path, format, kFormatValue));
  }

  {
    SPARSEKV_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->ListDir(o.path));
    std::sort(names.begin(), names.end());
    MutexLock lock(mu_);
    for (const std::string& n : names) {
      const uint64_t cb = ParseSlabFileName(n);
      if (cb == 0) continue;
      if (SsdSlabClassBytes(cb) != cb) {
        spdlog::warn("ssd tier {}: ignoring {}: {} is not a slab class", o.path, n, cb);
        continue;
      }
      SPARSEKV_RETURN_IF_ERROR(OpenSlabFileLocked(cb, /*create=*/false));
    }
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
    uint32_t cls;
  };
  std::vector<Loaded> loaded;
  std::vector<std::string> dropped;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    MutexLock lock(mu_);
    std::unordered_set<uint64_t> claimed;
    for (it->Seek(std::string(1, offload::kBundleKeyTag)); it->Valid(); it->Next()) {
      const std::string_view k = it->key().ToStringView();
      if (k.empty() || k[0] != offload::kBundleKeyTag) break;
      auto key = offload::DecodeBundleKey(k);
      IndexValue v;
      std::string why;
      uint32_t cls = 0;
      if (!key || !DecodeIndexValue(it->value().ToStringView(), &v)) {
        why = "undecodable entry";
      } else if (auto ci = class_index_.find(v.class_bytes); ci == class_index_.end()) {
        why = fmt::format("no slab file for class {}", v.class_bytes);
      } else if (cls = ci->second; v.slot >= classes_[cls]->slot_count) {
        why = fmt::format("slot {} is past the end of {} ({} slots)", v.slot, classes_[cls]->path,
                          classes_[cls]->slot_count);
      } else if (v.record_bytes > v.class_bytes ||
                 SsdSlabClassBytes(v.record_bytes) != v.class_bytes) {
        why = fmt::format("record of {} bytes does not belong in class {}", v.record_bytes,
                          v.class_bytes);
      } else if (!claimed.insert(SlotKey(cls, v.slot)).second) {
        why = fmt::format("slot {} of {} is named twice", v.slot, classes_[cls]->path);
      }
      if (!why.empty()) {
        spdlog::warn("ssd tier {}: dropping index entry {}: {}", options_.path,
                     key ? key->ToString() : std::string("(bad key)"), why);
        dropped.emplace_back(k);
        continue;
      }
      loaded.push_back({*key, std::move(v), cls});
    }
    if (!it->status().ok()) return FromRocksDb(it->status(), "ssd tier: scan index");
  }
  if (!dropped.empty()) {
    rocksdb::WriteBatch batch;
    for (const auto& k : dropped) batch.Delete(k);
    rocksdb::Status rs = db_->Write(write_options_, &batch);
    if (!rs.ok()) return FromRocksDb(rs, "ssd tier: drop bad index entries");
  }
  // Least recently written first: the best guess of recency a restart has.
  std::sort(loaded.begin(), loaded.end(),
            [](const Loaded& a, const Loaded& b) { return a.v.sequence < b.v.sequence; });
  MutexLock lock(mu_);
  std::vector<std::vector<bool>> used(classes_.size());
  for (size_t c = 0; c < classes_.size(); ++c) used[c].assign(classes_[c]->slot_count, false);
  for (Loaded& l : loaded) {
    SlabClass& c = *classes_[l.cls];
    Entry e;
    e.cls = l.cls;
    e.slot = l.v.slot;
    e.record_bytes = l.v.record_bytes;
    e.checksum = l.v.checksum;
    e.lru = c.lru.insert(c.lru.end(), l.key);
    entries_.emplace(l.key, e);
    used[l.cls][l.v.slot] = true;
    stats_.bytes += l.v.record_bytes;
    next_sequence_ = std::max(next_sequence_, l.v.sequence + 1);
  }
  for (size_t c = 0; c < classes_.size(); ++c) {
    for (uint32_t s = 0; s < classes_[c]->slot_count; ++s) {
      if (!used[c][s]) classes_[c]->free_slots.push(s);
    }
  }
  details_.recovered = loaded.size();
  details_.dropped_at_open = dropped.size();
  if (!loaded.empty() || !dropped.empty()) {
    spdlog::info("ssd tier {}: recovered {} bundles, dropped {} bad index entries", options_.path,
                 loaded.size(), dropped.size());
  }
  return Status::OK();
}

Result<uint32_t> SsdTierImpl::ClassForLocked(uint64_t record_bytes) {
  const uint64_t cb = SsdSlabClassBytes(record_bytes);
  auto it = class_index_.find(cb);
  if (it != class_index_.end()) return it->second;
  SPARSEKV_RETURN_IF_ERROR(OpenSlabFileLocked(cb, /*create=*/true));
  return static_cast<uint32_t>(classes_.size() - 1);
}

Result<uint32_t> SsdTierImpl::TakeSlotLocked(uint32_t cls, std::vector<BundleKey>* victims) {
  SlabClass& c = *classes_[cls];
  if (!c.free_slots.empty()) {
    const uint32_t s = c.free_slots.top();
    c.free_slots.pop();
    return s;
  }
  Status grow_error;
  if (allocated_bytes_ + c.class_bytes <= options_.capacity_bytes && c.slot_count < UINT32_MAX) {
    const uint64_t room = (options_.capacity_bytes - allocated_bytes_) / c.class_bytes;
    const uint64_t want = std::max<uint64_t>(1, options_.slab_grow_bytes / c.class_bytes);
    const auto grow =
        static_cast<uint32_t>(std::min({room, want, uint64_t{UINT32_MAX - c.slot_count}}));
    grow_error =
        c.file->Allocate(uint64_t{c.slot_count} * c.class_bytes, uint64_t{grow} * c.class_bytes);
    if (grow_error.ok()) {
      const uint32_t first = c.slot_count;
      c.slot_count += grow;
      allocated_bytes_ += uint64_t{grow} * c.class_bytes;
      for (uint32_t s = first + 1; s < c.slot_count; ++s) c.free_slots.push(s);
      return first;
    }
    spdlog::warn("ssd tier {}: growing {}: {}", options_.path, c.path, grow_error.ToString());
  }
  // Full: the least recently used bundle of this class that nobody is reading gives its slot.
  for (auto it = c.lru.begin(); it != c.lru.end(); ++it) {
    auto e = entries_.find(*it);
    if (pins_.count(SlotKey(cls, e->second.slot))) continue;
    const uint32_t s = e->second.slot;
    victims->push_back(e->first);
    ++stats_.evictions;
    RemoveEntryLocked(e);
    return s;
  }
  if (!grow_error.ok()) return grow_error;
  return Status::ResourceExhausted(
      fmt::format("ssd tier {}: full ({} of {} bytes allocated) and no bundle of class {} to evict",
                  options_.path, allocated_bytes_, options_.capacity_bytes, c.class_bytes));
}

void SsdTierImpl::RemoveEntryLocked(
    std::unordered_map<BundleKey, Entry, BundleKeyHasher>::iterator it) {
  classes_[it->second.cls]->lru.erase(it->second.lru);
  stats_.bytes -= it->second.record_bytes;
  entries_.erase(it);
}

void SsdTierImpl::FreeSlotLocked(uint32_t cls, uint32_t slot) {
  if (pins_.count(SlotKey(cls, slot))) {
    free_when_unpinned_.insert(SlotKey(cls, slot));
  } else {
    classes_[cls]->free_slots.push(slot);
  }
}

void SsdTierImpl::UnpinLocked(uint32_t cls, uint32_t slot) {
  auto it = pins_.find(SlotKey(cls, slot));
  if (--it->second > 0) return;
  pins_.erase(it);
  if (free_when_unpinned_.erase(SlotKey(cls, slot))) classes_[cls]->free_slots.push(slot);
}

Status SsdTierImpl::RemoveEntries(const std::vector<BundleKey>& keys,
                                  const std::vector<Location>* only_at, bool eviction) {
  MutexLock index_lock(index_mu_);
  std::vector<Location> removed;
  rocksdb::WriteBatch batch;
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = entries_.find(keys[i]);
      if (it == entries_.end()) continue;
      if (only_at &&
          ((*only_at)[i].cls != it->second.cls || (*only_at)[i].slot != it->second.slot ||
           (*only_at)[i].checksum != it->second.checksum)) {
        continue;  // replaced since it was read: the new bundle stays
      }
      removed.push_back({it->second.cls, it->second.slot, it->second.checksum});
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
    // The entries may still be in the index: their slots must not be rewritten before a restart.
    details_.quarantined_slots += removed.size();
    return FromRocksDb(rs, "ssd tier: delete index entries");
  }
  for (const Location& l : removed) FreeSlotLocked(l.cls, l.slot);
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

  // Phase A: slots, evicting if needed; evicted entries leave the index before their slots are
  // rewritten.
  {
    MutexLock index_lock(index_mu_);
    std::vector<BundleKey> victims;
    {
      MutexLock lock(mu_);
      for (size_t i = 0; i < n; ++i) {
        const Bundle* b = bundles[i].get();
        if (b == nullptr) {
          st[i] = Status::InvalidArgument("ssd tier: null bundle");
          continue;
        }
        if (b->record_bytes() > options_.max_record_bytes) {
          st[i] = Status::InvalidArgument(fmt::format(
              "ssd tier {}: bundle {} of {} bytes exceeds max_record_bytes {}", options_.path,
              b->key().ToString(), b->record_bytes(), options_.max_record_bytes));
          continue;
        }
        auto e = entries_.find(b->key());
        if (e != entries_.end() && e->second.checksum == b->checksum() &&
            e->second.record_bytes == b->record_bytes() && !unpublished_.count(b->key())) {
          SlabClass& c = *classes_[e->second.cls];
          c.lru.splice(c.lru.end(), c.lru,
                       e->second.lru);  // the same bundle: only its recency changes
          continue;
        }
        Result<uint32_t> cls = ClassForLocked(b->record_bytes());
        if (!cls.ok()) {
          st[i] = cls.status();
          continue;
        }
        const size_t victims_before = victims.size();
        Result<uint32_t> slot = TakeSlotLocked(*cls, &victims);
        if (!slot.ok()) {
          st[i] = slot.status();
          continue;
        }
        Item& it = items[i];
        it.write = true;
        it.reused_victim = victims.size() > victims_before;
        it.cls = *cls;
        it.slot = *slot;
        it.class_bytes = classes_[*cls]->class_bytes;
        it.aligned = AlignUp(b->record_bytes());
        it.file = classes_[*cls]->file.get();
        ++unpublished_[b->key()];
      }
    }
    if (!victims.empty()) {
      rocksdb::WriteBatch batch;
      for (const BundleKey& v : victims) batch.Delete(EncodeBundleKey(v));
      const rocksdb::Status rs = db_->Write(write_options_, &batch);
      if (!rs.ok()) {
        const Status s = FromRocksDb(rs, "ssd tier: delete evicted index entries");
        MutexLock lock(mu_);
        for (size_t i = 0; i < n; ++i) {
          if (items[i].write && items[i].reused_victim) {
            items[i].write = false;
            auto u = unpublished_.find(bundles[i]->key());
            if (--u->second == 0) unpublished_.erase(u);
            st[i] = s;
            ++details_.quarantined_slots;
          }
        }
      }
    }
  }

  // Phase B: the data, straight from each bundle's memory, cut into I/Os of at most io_bytes,
  // queue_depth deep.
  std::vector<std::pair<uint32_t, uint32_t>> ops;  // (item, chunk)
  const uint64_t io = options_.io_bytes;
  for (size_t i = 0; i < n; ++i) {
    if (!items[i].write) continue;
    for (uint64_t c = 0; c * io < items[i].aligned; ++c)
      ops.emplace_back(static_cast<uint32_t>(i), static_cast<uint32_t>(c));
  }
  const int rw_flags = options_.durability == Durability::kDsync ? RWF_DSYNC : 0;
  const Status ring = q.Run(
      ops.size(),
      [&](uint64_t k, UringOp& op) {
        const auto [i, c] = ops[k];
        const Item& it = items[i];
        const uint64_t off = uint64_t{c} * io;
        op.file = it.file;
        op.kind = AsyncIo::Kind::kWrite;
        op.offset = uint64_t{it.slot} * it.class_bytes + off;
        // Written, never changed: the hooks leave a write's bytes alone (file_system.h).
        op.data = const_cast<std::byte*>(bundles[i]->padded_record().data()) + off;
        op.length = std::min(io, it.aligned - off);
        op.rw_flags = rw_flags;
      },
      [&](uint64_t k, const UringOp& op) {
        const uint32_t i = ops[k].first;
        if (op.result < 0 && st[i].ok()) {
          ++io_errors;
          st[i] = ErrnoStatus(-op.result, fmt::format("ssd tier: write {} at {}",
                                                      items[i].file->path(), op.offset));
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
  // Data first: one fdatasync per slab file for the whole group.
  if (options_.durability == Durability::kFdatasync) {
    std::vector<RandomRWFile*> files;
    for (const PendingPut& p : group) {
      for (size_t i = 0; i < p.items.size(); ++i) {
        if (p.items[i].write && p.st[i].ok()) files.push_back(p.items[i].file);
      }
    }
    std::sort(files.begin(), files.end());
    files.erase(std::unique(files.begin(), files.end()), files.end());
    for (RandomRWFile* f : files) {
      const Status s = f->Sync();
      if (s.ok()) continue;
      for (PendingPut& p : group) {
        ++p.io_errors;
        for (size_t i = 0; i < p.items.size(); ++i) {
          if (p.items[i].write && p.items[i].file == f && p.st[i].ok())
            p.st[i] = s.WithContext("ssd tier");
        }
      }
    }
  }

  // Then the index entries of the records now durable, and the in-memory index, in batch order.
  MutexLock index_lock(index_mu_);
  rocksdb::WriteBatch batch;
  {
    MutexLock lock(mu_);
    for (PendingPut& p : group) {
      for (size_t i = 0; i < p.items.size(); ++i) {
        const Item& it = p.items[i];
        if (!it.write) continue;
        if (!p.st[i].ok()) {
          FreeSlotLocked(it.cls, it.slot);  // nothing names it
          continue;
        }
        const Bundle& b = *p.bundles[i];
        IndexValue v;
        v.class_bytes = it.class_bytes;
        v.slot = it.slot;
        v.record_bytes = b.record_bytes();
        v.checksum = b.checksum();
        v.sequence = next_sequence_++;
        v.segment_bytes = SegmentsOf(b);
        batch.Put(EncodeBundleKey(b.key()), EncodeIndexValue(v));
      }
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
      }
      if (it.write && p.st[i].ok()) {
        if (!rs.ok()) {
          p.st[i] = FromRocksDb(rs, "ssd tier: write index entries");
          ++details_.quarantined_slots;  // the entry may have reached the index after all
        } else {
          const Bundle& b = *p.bundles[i];
          auto old = entries_.find(b.key());
          if (old != entries_.end()) {
            const uint32_t oc = old->second.cls;
            const uint32_t os = old->second.slot;
            RemoveEntryLocked(old);
            FreeSlotLocked(oc, os);  // the index entry just written replaced its entry
          }
          SlabClass& c = *classes_[it.cls];
          Entry e;
          e.cls = it.cls;
          e.slot = it.slot;
          e.record_bytes = b.record_bytes();
          e.checksum = b.checksum();
          e.lru = c.lru.insert(c.lru.end(), b.key());
          entries_.emplace(b.key(), e);
          stats_.bytes += b.record_bytes();
          stats_.bytes_written += it.aligned;
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

std::vector<Result<BundlePtr>> SsdTierImpl::DoGet(UringQueue& q,
                                                  const std::vector<BundleKey>& keys) {
  const size_t n = keys.size();
  struct Item {
    bool found = false;
    Location loc;
    uint64_t record_bytes = 0;
    uint64_t aligned = 0;
    uint64_t offset = 0;
    RandomRWFile* file = nullptr;
    RecordBuffer buf;
    uint64_t chunks_left = 0;
    Status st;
    BundlePtr bundle;
  };
  std::vector<Item> items(n);
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      auto e = entries_.find(keys[i]);
      if (e == entries_.end()) {
        ++stats_.misses;
        continue;
      }
      Item& it = items[i];
      SlabClass& c = *classes_[e->second.cls];
      c.lru.splice(c.lru.end(), c.lru, e->second.lru);
      it.found = true;
      it.loc = {e->second.cls, e->second.slot, e->second.checksum};
      it.record_bytes = e->second.record_bytes;
      it.aligned = AlignUp(it.record_bytes);
      it.offset = uint64_t{e->second.slot} * c.class_bytes;
      it.file = c.file.get();
      ++pins_[SlotKey(it.loc.cls, it.loc.slot)];
    }
  }
  std::vector<std::pair<uint32_t, uint32_t>> ops;
  const uint64_t io = options_.io_bytes;
  for (size_t i = 0; i < n; ++i) {
    Item& it = items[i];
    if (!it.found) continue;
    // The bundle will own this memory: the registered arena when it has room, else the heap.
    if (arena_) it.buf = arena_->TryAllocate(it.aligned);
    if (!it.buf) it.buf = RecordBuffer::Allocate(it.aligned);
    for (uint64_t c = 0; c * io < it.aligned; ++c) {
      ops.emplace_back(static_cast<uint32_t>(i), static_cast<uint32_t>(c));
      ++it.chunks_left;
    }
  }
  uint64_t io_errors = 0;
  const Status ring = q.Run(
      ops.size(),
      [&](uint64_t k, UringOp& op) {
        const auto [i, c] = ops[k];
        Item& it = items[i];
        const uint64_t off = uint64_t{c} * io;
        op.file = it.file;
        op.kind = AsyncIo::Kind::kRead;
        op.offset = it.offset + off;
        op.data = it.buf.data() + off;
        op.length = std::min(io, it.aligned - off);
      },
      [&](uint64_t k, const UringOp& op) {
        const uint32_t i = ops[k].first;
        Item& it = items[i];
        if (op.result < 0 && it.st.ok()) {
          ++io_errors;
          it.st = ErrnoStatus(-op.result,
                              fmt::format("ssd tier: read {} at {}", it.file->path(), op.offset));
        }
        if (--it.chunks_left > 0 || !it.st.ok()) return;
        // The whole record is here: check it now, while later reads are in flight. The slot's
        // padding is not the bundle's: zero it, as a RecordBuffer promises.
        std::memset(it.buf.data() + it.record_bytes, 0, it.aligned - it.record_bytes);
        Result<BundlePtr> b = Bundle::AdoptRecord(std::move(it.buf), it.record_bytes, keys[i]);
        if (!b.ok()) {
          it.st =
              b.status().WithContext(fmt::format("ssd tier: {} at {}", it.file->path(), it.offset));
        } else if ((*b)->checksum() != it.loc.checksum) {
          it.st = Status::Corruption(fmt::format(
              "ssd tier: {} at {}: bundle {} holds checksum {:016x}, the index expects {:016x} (a "
              "stale record)",
              it.file->path(), it.offset, keys[i].ToString(), (*b)->checksum(), it.loc.checksum));
        } else {
          it.bundle = std::move(*b);
        }
      });
  (void)ring;

  std::vector<BundleKey> corrupt_keys;
  std::vector<Location> corrupt_at;
  for (size_t i = 0; i < n; ++i) {
    if (items[i].found && items[i].st.Is(StatusCode::kCorruption)) {
      spdlog::warn("{}; erasing it", items[i].st.ToString());
      corrupt_keys.push_back(keys[i]);
      corrupt_at.push_back(items[i].loc);
    }
  }
  if (!corrupt_keys.empty()) {
    const Status s = RemoveEntries(corrupt_keys, &corrupt_at, /*eviction=*/false);
    if (!s.ok())
      spdlog::warn("ssd tier {}: erasing corrupt bundles: {}", options_.path, s.ToString());
  }

  std::vector<Result<BundlePtr>> out;
  out.reserve(n);
  MutexLock lock(mu_);
  for (size_t i = 0; i < n; ++i) {
    Item& it = items[i];
    if (!it.found) {
      out.emplace_back(Status::NotFound("ssd tier: no bundle " + keys[i].ToString()));
      continue;
    }
    UnpinLocked(it.loc.cls, it.loc.slot);
    if (it.st.ok()) {
      ++stats_.hits;
      stats_.bytes_read += it.aligned;
      out.emplace_back(std::move(it.bundle));
    } else {
      if (it.st.Is(StatusCode::kCorruption)) ++stats_.corrupt;
      out.emplace_back(std::move(it.st));
    }
  }
  stats_.io_errors += io_errors;
  return out;
}

}  // namespace

Result<std::unique_ptr<SsdTier>> SsdTier::Open(const SsdTierOptions& options, FileSystem* fs) {
  auto tier = std::make_unique<SsdTierImpl>(options, fs ? fs : FileSystem::Default());
  SPARSEKV_RETURN_IF_ERROR(tier->Init());
  return std::unique_ptr<SsdTier>(std::move(tier));
}

}  // namespace sparsekv
