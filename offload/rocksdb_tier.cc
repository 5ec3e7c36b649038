// The RocksDB tier (rocksdb_tier.h): records as values in the default column family (large ones
// in blob files), and key -> (record bytes, checksum, put order, bundle sequence) in a small
// "meta" column family
// written in the same batch, from which the LRU is rebuilt at open without reading values.
//
// index_mu_ orders every write batch with the matching in-memory change, so memory and the
// database agree in the order a restart replays; mu_ guards the in-memory LRU and statistics
// and is never held across a RocksDB call.
#include "sparsekv/rocksdb_tier.h"

#include <fmt/format.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "io_status.h"
#include "key_codec.h"
#include "sparsekv/thread_annotations.h"
#include "worker_pool.h"

namespace sparsekv {
namespace {

using offload::EncodeBundleKey;
using offload::FromRocksDb;

constexpr char kMetaFamily[] = "meta";
// In the data family, beside the fixed-size encoded bundle keys (key_codec.h): the directory's
// mark. A database without it and with records predates it: bundle format 2, whose c8_mla pages
// had their scales before the rope (README, "Storage formats"). The mark was the bundle format
// until format 3; now that every record carries its own format version and a reader takes
// another version for a miss (bundle.h), it names the layout of the tier's keys and metadata
// only, and stays the value format 3 wrote, so that releases of different bundle formats open
// each other's directories and delete none of each other's records.
constexpr char kFormatKey[] = "sparsekv:format";
const std::string& FormatValue() {
  static const std::string v = "sparsekv-bundle-3";
  return v;
}

struct MetaValue {
  uint64_t record_bytes = 0;
  uint64_t checksum = 0;
  uint64_t sequence = 0;  // put order, to rebuild the LRU at open
  uint64_t version = 0;   // the bundle's sequence (bundle.h)
};
// Metadata written before bundles carried a sequence: the first three fields.
constexpr size_t kMetaV1Bytes = 3 * sizeof(uint64_t);

std::string EncodeMeta(const MetaValue& m) {
  std::string out(sizeof m, '\0');
  std::memcpy(out.data(), &m, sizeof m);
  return out;
}

// A longer value is a later release's, which may only append fields: its first bytes are read
// as this release's, so a downgrade keeps the entry. Shorter ones, or lengths between the two
// known ones, are damage.
bool DecodeMeta(std::string_view in, MetaValue* m) {
  if (in.size() < sizeof *m && in.size() != kMetaV1Bytes) return false;
  *m = MetaValue{};
  std::memcpy(m, in.data(), std::min(in.size(), sizeof *m));
  return true;
}

class RocksDbTierImpl final : public RocksDbTier {
 public:
  static constexpr size_t kMinKeysPerPart = 4;

  explicit RocksDbTierImpl(RocksDbTierOptions options) : options_(std::move(options)) {
    write_options_.sync = options_.durability != Durability::kNone;
    read_options_.verify_checksums = false;  // our XXH3 covers every record
  }

  ~RocksDbTierImpl() override {
    workers_.reset();
    if (db_) {
      for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
      handles_.clear();
      const rocksdb::Status s = db_->Close();
      if (!s.ok()) spdlog::warn("rocksdb tier {}: close: {}", options_.path, s.ToString());
    }
  }

  Status Init();

  std::string_view name() const override { return options_.name; }
  uint64_t capacity_bytes() const override { return options_.capacity_bytes; }
  uint64_t max_record_bytes() const override { return options_.max_record_bytes; }
  bool SetKeyJournal(std::shared_ptr<KeyJournal> journal) override {
    MutexLock lock(mu_);
    journal_ = std::move(journal);
    return true;
  }
  std::optional<std::vector<BundleKey>> ListKeys() const override {
    MutexLock lock(mu_);
    std::vector<BundleKey> out;
    out.reserve(entries_.size());
    for (const auto& [k, e] : entries_) out.push_back(k);
    return out;
  }
  uint64_t max_sequence() const override {
    MutexLock lock(mu_);
    return max_version_;
  }

  TierStats Stats() const override {
    MutexLock lock(mu_);
    TierStats s = stats_;
    s.name = options_.name;
    s.capacity_bytes = options_.capacity_bytes;
    s.items = entries_.size();
    return s;
  }

  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    workers_->Submit([this, bundles = std::move(bundles), done = std::move(done)](size_t) mutable {
      done(DoPut(bundles));
    });
  }

  void GetAsync(std::vector<BundleKey> keys, BundlesCallback done) override {
    // RocksDB reads one blob after another within a MultiGet: a large batch is split across the
    // workers so that several reads are in flight.
    const size_t parts =
        std::min<size_t>(workers_->size(), (keys.size() + kMinKeysPerPart - 1) / kMinKeysPerPart);
    if (parts <= 1) {
      workers_->Submit([this, keys = std::move(keys), done = std::move(done)](size_t) mutable {
        done(DoGet(keys));
      });
      return;
    }
    struct Join {
      std::mutex mu;
      std::vector<std::optional<Result<BundlePtr>>> results;
      size_t waiting = 0;
      BundlesCallback done;
    };
    auto join = std::make_shared<Join>();
    join->results.resize(keys.size());
    join->waiting = parts;
    join->done = std::move(done);
    auto shared_keys = std::make_shared<std::vector<BundleKey>>(std::move(keys));
    const size_t n = shared_keys->size();
    for (size_t p = 0; p < parts; ++p) {
      const size_t from = n * p / parts, to = n * (p + 1) / parts;
      workers_->Submit([this, join, shared_keys, from, to](size_t) {
        std::vector<BundleKey> part(shared_keys->begin() + static_cast<std::ptrdiff_t>(from),
                                    shared_keys->begin() + static_cast<std::ptrdiff_t>(to));
        std::vector<Result<BundlePtr>> got = DoGet(part);
        std::vector<Result<BundlePtr>> out;
        {
          std::lock_guard<std::mutex> lock(join->mu);
          for (size_t i = 0; i < got.size(); ++i) join->results[from + i] = std::move(got[i]);
          if (--join->waiting > 0) return;
          out.reserve(join->results.size());
          for (auto& r : join->results) out.push_back(std::move(*r));
        }
        join->done(std::move(out));
      });
    }
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
    // On the caller's thread, as the SSD tier's: one index write, no queueing behind reads.
    const Status s = Remove(keys, nullptr, below.empty() ? nullptr : &below);
    done(std::vector<Status>(keys.size(), s));
  }

  Status PutRawForTesting(const BundleKey& key, std::span<const std::byte> record) override {
    MutexLock index_lock(index_mu_);
    rocksdb::WriteBatch batch;
    const std::string k = EncodeBundleKey(key);
    batch.Put(data_cf(), k,
              rocksdb::Slice(reinterpret_cast<const char*>(record.data()), record.size()));
    bool known;
    {
      MutexLock lock(mu_);
      known = entries_.count(key) != 0;
    }
    if (!known) batch.Put(meta_cf(), k, EncodeMeta({record.size(), 0, 0, 0}));
    SPARSEKV_RETURN_IF_ERROR(
        FromRocksDb(db_->Write(write_options_, &batch), "rocksdb tier: raw put"));
    if (!known) {
      MutexLock lock(mu_);
      InsertLocked(key, record.size(), 0, 0);
    }
    return Status::OK();
  }

 private:
  struct Entry {
    uint64_t record_bytes = 0;
    uint64_t checksum = 0;
    uint64_t version = 0;
    std::list<BundleKey>::iterator lru;
    // A read found another release's record here (another bundle format): lookups answer
    // absent, as reads do, until a put replaces it. Not persisted: a restart finds out again.
    bool other_version = false;
  };

  // Marks a new database with the record format, and refuses one that holds another.
  Status CheckFormat(const std::string& path) {
    std::string format;
    rocksdb::Status rs = db_->Get(rocksdb::ReadOptions(), data_cf(), kFormatKey, &format);
    if (rs.ok()) {
      if (format == FormatValue()) return Status::OK();
      return Status::FailedPrecondition(fmt::format(
          "rocksdb tier: {} holds records of format '{}', this version reads '{}': remove the "
          "directory to start the tier empty",
          path, format, FormatValue()));
    }
    if (!rs.IsNotFound()) return FromRocksDb(rs, "rocksdb tier: read the record format");
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta_cf()));
    it->SeekToFirst();
    if (!it->status().ok()) return FromRocksDb(it->status(), "rocksdb tier: scan metadata");
    if (it->Valid()) {
      return Status::FailedPrecondition(fmt::format(
          "rocksdb tier: {} holds records of an earlier sparsekv (bundle format 2, before "
          "c8_mla pages took CANN's byte order) and this version reads '{}': remove the "
          "directory to start the tier empty",
          path, FormatValue()));
    }
    rs = db_->Put(write_options_, data_cf(), kFormatKey, FormatValue());
    return rs.ok() ? Status::OK() : FromRocksDb(rs, "rocksdb tier: write the record format");
  }

  rocksdb::ColumnFamilyHandle* data_cf() const { return handles_[0]; }
  rocksdb::ColumnFamilyHandle* meta_cf() const { return handles_[1]; }

  void InsertLocked(const BundleKey& key, uint64_t bytes, uint64_t checksum, uint64_t version)
      SPARSEKV_REQUIRES(mu_) {
    Entry e{bytes, checksum, version, lru_.insert(lru_.end(), key), false};
    entries_.emplace(key, e);
    if (journal_) journal_->Note(key, true);
    stats_.bytes += bytes;
    max_version_ = std::max(max_version_, version);
  }
  void EraseLocked(std::unordered_map<BundleKey, Entry, BundleKeyHasher>::iterator it)
      SPARSEKV_REQUIRES(mu_) {
    stats_.bytes -= it->second.record_bytes;
    lru_.erase(it->second.lru);
    if (journal_) journal_->Note(it->first, false);
    entries_.erase(it);
  }

  std::vector<Status> DoPut(const std::vector<BundlePtr>& bundles)
      SPARSEKV_EXCLUDES(mu_, index_mu_);
  std::vector<Result<BundlePtr>> DoGet(const std::vector<BundleKey>& keys)
      SPARSEKV_EXCLUDES(mu_, index_mu_);
  // Erases `keys`; with `only_checksums`, only those still holding that checksum (a corrupt
  // bundle replaced since it was read stays); with `below`, only copies of a smaller sequence.
  Status Remove(const std::vector<BundleKey>& keys, const std::vector<uint64_t>* only_checksums,
                const std::vector<uint64_t>* below = nullptr) SPARSEKV_EXCLUDES(mu_, index_mu_);

  const RocksDbTierOptions options_;
  rocksdb::WriteOptions write_options_;
  rocksdb::ReadOptions read_options_;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // default (records), meta
  std::unique_ptr<offload::WorkerPool> workers_;

  Mutex index_mu_;  // taken before mu_
  mutable Mutex mu_;
  std::unordered_map<BundleKey, Entry, BundleKeyHasher> entries_ SPARSEKV_GUARDED_BY(mu_);
  std::shared_ptr<KeyJournal> journal_ SPARSEKV_GUARDED_BY(mu_);  // SetKeyJournal
  std::list<BundleKey> lru_ SPARSEKV_GUARDED_BY(mu_);  // front: least recent
  uint64_t next_sequence_ SPARSEKV_GUARDED_BY(mu_) = 1;
  uint64_t max_version_ SPARSEKV_GUARDED_BY(mu_) = 0;
  TierStats stats_ SPARSEKV_GUARDED_BY(mu_);
};

Status RocksDbTierImpl::Init() {
  const RocksDbTierOptions& o = options_;
  if (o.path.empty()) return Status::InvalidArgument("rocksdb tier: path must be set");
  if (o.worker_threads == 0 || o.worker_threads > 64) {
    return Status::InvalidArgument(
        fmt::format("rocksdb tier: worker_threads {} is not in [1, 64]", o.worker_threads));
  }
  if (o.max_record_bytes < BundleHeaderBytes(0)) {
    return Status::InvalidArgument(fmt::format(
        "rocksdb tier: max_record_bytes {} is below a bundle header", o.max_record_bytes));
  }
  rocksdb::DBOptions dbo;
  dbo.create_if_missing = true;
  dbo.create_missing_column_families = true;
  dbo.info_log_level = rocksdb::WARN_LEVEL;
  dbo.keep_log_file_num = 2;
  dbo.max_log_file_size = 1 << 20;
  dbo.max_background_jobs = 2;
  dbo.use_direct_reads = o.use_direct_io;
  dbo.use_direct_io_for_flush_and_compaction = o.use_direct_io;

  rocksdb::ColumnFamilyOptions data;
  data.enable_blob_files = true;
  data.min_blob_size = o.min_blob_size;
  data.blob_file_size = o.blob_file_size;
  data.blob_compression_type = rocksdb::kNoCompression;
  data.compression =
      rocksdb::kNoCompression;  // KV bytes do not compress; the CPU is better spent elsewhere
  data.enable_blob_garbage_collection = true;
  data.blob_garbage_collection_age_cutoff = 0.25;
  data.write_buffer_size = 64 << 20;
  data.max_write_buffer_number = 3;
  rocksdb::ColumnFamilyOptions meta;
  meta.write_buffer_size = 4 << 20;

  std::vector<rocksdb::ColumnFamilyDescriptor> families = {
      {rocksdb::kDefaultColumnFamilyName, data}, {kMetaFamily, meta}};
  rocksdb::DB* db = nullptr;
  rocksdb::Status rs = rocksdb::DB::Open(dbo, o.path, families, &handles_, &db);
  if (!rs.ok()) return FromRocksDb(rs, "rocksdb tier: open " + o.path);
  db_.reset(db);
  if (Status s = CheckFormat(o.path); !s.ok()) return s;

  struct Loaded {
    BundleKey key;
    MetaValue m;
  };
  std::vector<Loaded> loaded;
  std::vector<std::string> dropped;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta_cf()));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      auto key = offload::DecodeBundleKey(it->key().ToStringView());
      MetaValue m;
      if (!key || !DecodeMeta(it->value().ToStringView(), &m)) {
        dropped.emplace_back(it->key().ToStringView());
        continue;
      }
      loaded.push_back({*key, m});
    }
    if (!it->status().ok()) return FromRocksDb(it->status(), "rocksdb tier: scan metadata");
  }
  if (!dropped.empty()) {
    spdlog::warn("rocksdb tier {}: dropping {} undecodable metadata entries", o.path,
                 dropped.size());
    rocksdb::WriteBatch batch;
    for (const auto& k : dropped) {
      batch.Delete(meta_cf(), k);
      batch.Delete(data_cf(), k);
    }
    rs = db_->Write(write_options_, &batch);
    if (!rs.ok()) return FromRocksDb(rs, "rocksdb tier: drop bad metadata");
  }
  std::sort(loaded.begin(), loaded.end(),
            [](const Loaded& a, const Loaded& b) { return a.m.sequence < b.m.sequence; });
  {
    MutexLock lock(mu_);
    for (const Loaded& l : loaded) {
      InsertLocked(l.key, l.m.record_bytes, l.m.checksum, l.m.version);
      next_sequence_ = std::max(next_sequence_, l.m.sequence + 1);
    }
  }
  workers_ = std::make_unique<offload::WorkerPool>("skv-rocks", o.worker_threads);
  return Status::OK();
}

std::vector<Status> RocksDbTierImpl::DoPut(const std::vector<BundlePtr>& bundles) {
  const size_t n = bundles.size();
  std::vector<Status> st(n);
  std::vector<bool> write(n, false);
  MutexLock index_lock(index_mu_);
  rocksdb::WriteBatch batch;
  std::vector<BundleKey> victims;
  {
    MutexLock lock(mu_);
    // Of several versions of one key in the batch only the newest is written (the batch's last
    // put of a key is the one RocksDB keeps).
    std::unordered_map<BundleKey, size_t, BundleKeyHasher> newest;
    for (size_t i = 0; i < n; ++i) {
      if (bundles[i] == nullptr) continue;
      auto [it, fresh] = newest.try_emplace(bundles[i]->key(), i);
      if (!fresh && bundles[it->second]->sequence() <= bundles[i]->sequence()) it->second = i;
    }
    uint64_t incoming = 0;
    for (size_t i = 0; i < n; ++i) {
      const Bundle* b = bundles[i].get();
      if (b == nullptr) {
        st[i] = Status::InvalidArgument("rocksdb tier: null bundle");
        continue;
      }
      if (b->record_bytes() > options_.max_record_bytes ||
          b->record_bytes() > options_.capacity_bytes) {
        st[i] = Status::InvalidArgument(
            fmt::format("rocksdb tier {}: bundle {} of {} bytes exceeds max_record_bytes {}",
                        options_.path, b->key().ToString(), b->record_bytes(),
                        std::min(options_.max_record_bytes, options_.capacity_bytes)));
        continue;
      }
      auto e = entries_.find(b->key());
      if (newest.at(b->key()) != i || (e != entries_.end() && e->second.version > b->sequence())) {
        ++stats_.superseded;  // a newer copy is held or comes in this batch
        continue;
      }
      if (e != entries_.end() && e->second.checksum == b->checksum() &&
          e->second.version == b->sequence() && e->second.record_bytes == b->record_bytes()) {
        lru_.splice(lru_.end(), lru_, e->second.lru);  // the same bundle: only its recency changes
        continue;
      }
      write[i] = true;
      incoming += b->record_bytes();
      const std::string k = EncodeBundleKey(b->key());
      batch.Put(
          data_cf(), k,
          rocksdb::Slice(reinterpret_cast<const char*>(b->record().data()), b->record_bytes()));
      batch.Put(meta_cf(), k,
                EncodeMeta({b->record_bytes(), b->checksum(), next_sequence_++, b->sequence()}));
    }
    // Room for the batch: least recently used first, in the same atomic batch as the puts.
    uint64_t projected = stats_.bytes + incoming;
    for (size_t i = 0; i < n; ++i) {
      if (!write[i]) continue;
      auto old = entries_.find(bundles[i]->key());
      if (old != entries_.end())
        projected -= std::min(projected, old->second.record_bytes);  // replaced
    }
    for (auto it = lru_.begin(); it != lru_.end() && projected > options_.capacity_bytes; ++it) {
      bool in_batch = false;
      for (size_t i = 0; i < n && !in_batch; ++i) in_batch = write[i] && bundles[i]->key() == *it;
      if (in_batch) continue;  // replaced by this batch anyway
      victims.push_back(*it);
      const std::string ek = EncodeBundleKey(*it);
      batch.Delete(data_cf(), ek);
      batch.Delete(meta_cf(), ek);
      projected -= std::min(projected, entries_.at(*it).record_bytes);
    }
  }
  const rocksdb::Status rs =
      batch.Count() ? db_->Write(write_options_, &batch) : rocksdb::Status::OK();
  MutexLock lock(mu_);
  if (!rs.ok()) {
    const Status s = FromRocksDb(rs, "rocksdb tier: write batch");
    for (size_t i = 0; i < n; ++i) {
      if (write[i]) st[i] = s;
    }
  } else {
    for (const BundleKey& v : victims) {
      auto it = entries_.find(v);
      if (it != entries_.end()) {
        EraseLocked(it);
        ++stats_.evictions;
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (!write[i]) continue;
      const Bundle& b = *bundles[i];
      auto old = entries_.find(b.key());
      if (old != entries_.end()) EraseLocked(old);
      InsertLocked(b.key(), b.record_bytes(), b.checksum(), b.sequence());
      stats_.bytes_written += b.record_bytes();
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (st[i].ok()) {
      ++stats_.puts;
    } else {
      ++stats_.put_failures;
    }
  }
  return st;
}

std::vector<Result<BundlePtr>> RocksDbTierImpl::DoGet(const std::vector<BundleKey>& keys) {
  const size_t n = keys.size();
  std::vector<uint64_t> expected_checksum(n, 0);
  std::vector<std::string> encoded;
  std::vector<rocksdb::Slice> slices;
  std::vector<size_t> which;
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      auto it = entries_.find(keys[i]);
      if (it == entries_.end()) {
        ++stats_.misses;
        continue;
      }
      expected_checksum[i] = it->second.checksum;
      lru_.splice(lru_.end(), lru_, it->second.lru);
      which.push_back(i);
    }
  }
  encoded.reserve(which.size());
  for (size_t i : which) encoded.push_back(EncodeBundleKey(keys[i]));
  for (const auto& e : encoded) slices.emplace_back(e);
  std::vector<rocksdb::PinnableSlice> values(which.size());
  std::vector<rocksdb::Status> statuses(which.size());
  if (!which.empty()) {
    db_->MultiGet(read_options_, data_cf(), which.size(), slices.data(), values.data(),
                  statuses.data());
  }
  std::vector<std::optional<Result<BundlePtr>>> results(n);
  std::vector<BundleKey> corrupt;
  std::vector<uint64_t> corrupt_checksums;
  uint64_t hits = 0, corrupt_count = 0, io_errors = 0, bytes_read = 0, other_version = 0;
  std::vector<size_t> foreign;  // reads that found another release's record
  for (size_t j = 0; j < which.size(); ++j) {
    const size_t i = which[j];
    if (statuses[j].IsNotFound()) {
      // Erased since the lookup, or metadata without a value: either way not here.
      results[i] = Status::NotFound("rocksdb tier: no bundle " + keys[i].ToString());
      continue;
    }
    if (!statuses[j].ok()) {
      ++io_errors;
      results[i] = FromRocksDb(statuses[j], "rocksdb tier: read " + keys[i].ToString());
      continue;
    }
    const std::span<const std::byte> rec(reinterpret_cast<const std::byte*>(values[j].data()),
                                         values[j].size());
    Result<BundlePtr> b = Bundle::ParseRecord(rec, keys[i]);
    if (b.ok() && (*b)->checksum() != expected_checksum[i]) {
      b = Status::Corruption(
          fmt::format("rocksdb tier: bundle {} holds checksum {:016x}, its metadata says {:016x}",
                      keys[i].ToString(), (*b)->checksum(), expected_checksum[i]));
    }
    if (!b.ok() && IsOtherBundleVersion(b.status())) {
      // Another release's record (a directory handed between releases): a miss, counted, left
      // in place for its writer and for eviction.
      ++other_version;
      foreign.push_back(i);
      results[i] = Status::NotFound(fmt::format("rocksdb tier: {}", b.status().message()));
      continue;
    }
    if (!b.ok()) {
      ++corrupt_count;
      spdlog::warn("rocksdb tier {}: {}; erasing it", options_.path, b.status().ToString());
      corrupt.push_back(keys[i]);
      corrupt_checksums.push_back(expected_checksum[i]);
      results[i] = b.status().WithContext("rocksdb tier");
      continue;
    }
    ++hits;
    bytes_read += rec.size();
    results[i] = std::move(b);
  }
  if (!corrupt.empty()) {
    const Status s = Remove(corrupt, &corrupt_checksums);
    if (!s.ok())
      spdlog::warn("rocksdb tier {}: erasing corrupt bundles: {}", options_.path, s.ToString());
  }
  std::vector<Result<BundlePtr>> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (results[i]) {
      out.push_back(std::move(*results[i]));
    } else {
      out.emplace_back(Status::NotFound("rocksdb tier: no bundle " + keys[i].ToString()));
    }
  }
  MutexLock lock(mu_);
  for (size_t i : foreign) {
    auto e = entries_.find(keys[i]);
    if (e != entries_.end() && e->second.checksum == expected_checksum[i]) e->second.other_version = true;
  }
  stats_.hits += hits;
  stats_.misses += other_version;
  stats_.other_version += other_version;
  stats_.corrupt += corrupt_count;
  stats_.io_errors += io_errors;
  stats_.bytes_read += bytes_read;
  return out;
}

Status RocksDbTierImpl::Remove(const std::vector<BundleKey>& keys,
                               const std::vector<uint64_t>* only_checksums,
                               const std::vector<uint64_t>* below) {
  MutexLock index_lock(index_mu_);
  rocksdb::WriteBatch batch;
  {
    MutexLock lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      const BundleKey& k = keys[i];
      auto it = entries_.find(k);
      if (it == entries_.end()) continue;
      if (only_checksums && it->second.checksum != (*only_checksums)[i]) continue;
      if (below && it->second.version >= (*below)[i]) continue;
      EraseLocked(it);
      if (!only_checksums) ++stats_.erased;
      const std::string ek = EncodeBundleKey(k);
      batch.Delete(data_cf(), ek);
      batch.Delete(meta_cf(), ek);
    }
  }
  if (batch.Count() == 0) return Status::OK();
  return FromRocksDb(db_->Write(write_options_, &batch), "rocksdb tier: delete");
}

}  // namespace

Result<std::unique_ptr<RocksDbTier>> RocksDbTier::Open(const RocksDbTierOptions& options) {
  auto tier = std::make_unique<RocksDbTierImpl>(options);
  SPARSEKV_RETURN_IF_ERROR(tier->Init());
  return std::unique_ptr<RocksDbTier>(std::move(tier));
}

}  // namespace sparsekv
