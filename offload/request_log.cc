// RequestLog (request_log.h): segments of checksummed records, group-committed by one thread;
// recovery tells a torn tail from damage and from a newer release's data (RocksDB's WAL
// recovery modes are the model).
#include "sparsekv/request_log.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "sparsekv/thread_annotations.h"

namespace sparsekv {
namespace {

constexpr char kMagic[8] = {'S', 'K', 'V', 'L', 'O', 'G', '0', '1'};
constexpr uint64_t kSegmentHeaderBytes = 16;
constexpr uint64_t kRecordHeaderBytes = 24;
constexpr uint8_t kTokens = 1, kSuspended = 2, kFinished = 3;
constexpr uint64_t kTokensBodyHeader = 16;
constexpr uint64_t kSuspendedBody = 32;
constexpr const char* kSuffix = ".skvlog";

template <class T>
void Put(std::vector<std::byte>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

template <class T>
T Get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

uint32_t Checksum(const std::byte* from, size_t bytes, uint64_t segment) {
  return static_cast<uint32_t>(XXH3_64bits_withSeed(from, bytes, segment));
}

// Appends one record: header (checksum filled last) and body.
void EncodeRecord(std::vector<std::byte>& out, uint64_t segment, uint8_t type, uint64_t request,
                  std::span<const std::byte> body) {
  const size_t at = out.size();
  Put<uint32_t>(out, 0);
  Put<uint32_t>(out, static_cast<uint32_t>(body.size()));
  Put<uint8_t>(out, type);
  for (int i = 0; i < 7; ++i) Put<uint8_t>(out, 0);
  Put<uint64_t>(out, request);
  out.insert(out.end(), body.begin(), body.end());
  const uint32_t sum = Checksum(out.data() + at + 4, out.size() - at - 4, segment);
  std::memcpy(out.data() + at, &sum, 4);
}

std::string SegmentName(uint64_t number) { return fmt::format("{:016x}{}", number, kSuffix); }

class RequestLogImpl final : public RequestLog {
 public:
  explicit RequestLogImpl(RequestLogOptions o) : o_(std::move(o)), fs_(o_.fs ? o_.fs : FileSystem::Default()) {}

  ~RequestLogImpl() override {
    {
      MutexLock l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (committer_.joinable()) committer_.join();
  }

  Status Init() {
    if (o_.path.empty()) return Status::InvalidArgument("request log: path must be set");
    if (o_.segment_bytes < 4096) {
      return Status::InvalidArgument(fmt::format("request log: segment_bytes {} is below 4096", o_.segment_bytes));
    }
    if (o_.max_append_tokens == 0) return Status::InvalidArgument("request log: max_append_tokens must be positive");
    SPARSEKV_RETURN_IF_ERROR(fs_->CreateDirs(o_.path));
    SPARSEKV_RETURN_IF_ERROR(RecoverSegments());
    {
      MutexLock l(mu_);
      SPARSEKV_RETURN_IF_ERROR(StartSegmentLocked());
    }
    committer_ = std::thread([this] { CommitLoop(); });
    return Status::OK();
  }

  Status Append(uint64_t request, uint64_t first_token, std::span<const int32_t> tokens) override {
    std::promise<Status> p;
    auto f = p.get_future();
    AppendAsync(request, first_token, tokens, [&p](Status s) { p.set_value(std::move(s)); });
    return f.get();
  }

  void AppendAsync(uint64_t request, uint64_t first_token, std::span<const int32_t> tokens,
                   std::function<void(Status)> done) override {
    if (tokens.empty()) return done(Status::InvalidArgument("request log: an append of no tokens"));
    if (tokens.size() > o_.max_append_tokens) {
      return done(Status::InvalidArgument(fmt::format("request log: an append of {} tokens; at most {}",
                                                      tokens.size(), o_.max_append_tokens)));
    }
    std::vector<std::byte> body;
    body.reserve(kTokensBodyHeader + 4 * tokens.size());
    Put<uint64_t>(body, first_token);
    Put<uint32_t>(body, static_cast<uint32_t>(tokens.size()));
    Put<uint32_t>(body, 0);
    const size_t at = body.size();
    body.resize(at + 4 * tokens.size());
    std::memcpy(body.data() + at, tokens.data(), 4 * tokens.size());
    Status refused;
    {
      MutexLock l(mu_);
      auto it = live_.find(request);
      const uint64_t have = it == live_.end() ? 0 : it->second.queued;
      if (!failed_.ok()) {
        refused = failed_;
      } else if (it != live_.end() && it->second.finished) {
        refused = Status::FailedPrecondition(fmt::format("request log: request {} is finished", request));
      } else if (first_token != have) {
        refused = Status::FailedPrecondition(fmt::format(
            "request log: request {} has {} tokens logged or queued; an append must start there, not at {}", request,
            have, first_token));
      } else {
        live_[request].queued += tokens.size();
        Queue(kTokens, request, body, tokens.size(), std::move(done));
        return;
      }
    }
    done(refused);  // outside the lock: `done` may call the log
  }

  Status Suspended(uint64_t request, const Suspension& s) override {
    std::vector<std::byte> body;
    Put<uint64_t>(body, s.tokens);
    Put<uint64_t>(body, s.tail.lo);
    Put<uint64_t>(body, s.tail.hi);
    Put<uint64_t>(body, s.tag);
    return LogAndWait(kSuspended, request, body, [&](Live* r) SPARSEKV_NO_THREAD_SAFETY_ANALYSIS {
      if (r == nullptr || r->finished) {
        return Status::FailedPrecondition(
            fmt::format("request log: request {} has no tokens logged, or is finished", request));
      }
      if (s.tokens > r->queued) {
        return Status::FailedPrecondition(fmt::format(
            "request log: a suspension at token {} of request {}, which has {} tokens logged", s.tokens, request,
            r->queued));
      }
      return Status::OK();
    });
  }

  Status Finish(uint64_t request) override {
    return LogAndWait(kFinished, request, {}, [&](Live* r) {
      if (r == nullptr || r->finished) {
        return Status::NotFound(fmt::format("request log: no unfinished request {}", request));
      }
      r->finished = true;  // no more appends; reclaimed once the record is durable
      return Status::OK();
    });
  }

  std::vector<Request> Recover() const override {
    MutexLock l(mu_);
    return recovered_;
  }

  std::vector<Request> Unfinished() const override {
    MutexLock l(mu_);
    std::vector<Request> out;
    for (const auto& [id, r] : live_) {
      if (r.finished) continue;
      out.push_back(Request{id, r.tokens, r.suspension});
    }
    std::sort(out.begin(), out.end(), [](const Request& a, const Request& b) { return a.id < b.id; });
    return out;
  }

  RequestLogStats Stats() const override {
    MutexLock l(mu_);
    RequestLogStats s = stats_;
    s.segments = segments_.size();
    s.live_requests = 0;
    for (const auto& [id, r] : live_) s.live_requests += !r.finished;
    return s;
  }

 private:
  // A request with records in the log: its tokens logged or queued, the segments holding its
  // records (they stay while it is unfinished), and whether Finish was called.
  struct Live {
    uint64_t queued = 0;
    bool finished = false;
    std::vector<int32_t> tokens;            // acknowledged
    std::optional<Suspension> suspension;   // the last acknowledged
    std::unordered_set<uint64_t> segments;
  };
  struct Pending {
    uint8_t type;
    uint64_t request;
    std::vector<std::byte> body;
    uint64_t tokens;
    std::function<void(Status)> done;
  };
  struct Segment {
    std::unique_ptr<RandomRWFile> file;  // open only for the active one
    uint64_t bytes = 0;
    uint64_t holders = 0;  // unfinished requests with records here
  };

  // Logs one record of `request` unless `check` (given the request's entry, or null when it
  // has none, under the lock) refuses; returns once the record is durable.
  template <class Check>
  Status LogAndWait(uint8_t type, uint64_t request, std::span<const std::byte> body, Check&& check)
      SPARSEKV_EXCLUDES(mu_) {
    std::promise<Status> p;
    auto f = p.get_future();
    {
      MutexLock l(mu_);
      if (!failed_.ok()) return failed_;
      auto it = live_.find(request);
      SPARSEKV_RETURN_IF_ERROR(check(it == live_.end() ? nullptr : &it->second));
      Queue(type, request, body, 0, [&p](Status st) { p.set_value(std::move(st)); });
    }
    return f.get();
  }

  void Queue(uint8_t type, uint64_t request, std::span<const std::byte> body, uint64_t tokens,
             std::function<void(Status)> done) SPARSEKV_REQUIRES(mu_) {
    pending_.push_back(Pending{type, request, {body.begin(), body.end()}, tokens, std::move(done)});
    cv_.notify_one();
  }

  std::string PathOf(uint64_t number) const { return o_.path + "/" + SegmentName(number); }

  Status StartSegmentLocked() SPARSEKV_REQUIRES(mu_) {
    const uint64_t number = next_segment_++;
    FileOpenOptions fo;
    fo.create = true;
    fo.dsync = o_.durability == Durability::kDsync;
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RandomRWFile> f, fs_->OpenRandomRW(PathOf(number), fo));
    std::vector<std::byte> header(kSegmentHeaderBytes);
    std::memcpy(header.data(), kMagic, 8);
    std::memcpy(header.data() + 8, &number, 8);
    SPARSEKV_RETURN_IF_ERROR(f->Write(0, header));
    if (o_.durability != Durability::kNone) {
      SPARSEKV_RETURN_IF_ERROR(f->Sync());
      SPARSEKV_RETURN_IF_ERROR(fs_->SyncDir(o_.path));
    }
    if (active_ != 0) segments_[active_].file.reset();
    Segment& s = segments_[number];
    s.file = std::move(f);
    s.bytes = kSegmentHeaderBytes;
    active_ = number;
    return Status::OK();
  }

  void CommitLoop() {
    for (;;) {
      std::deque<Pending> batch;
      {
        MutexLock l(mu_);
        cv_.wait(mu_, [&]() SPARSEKV_NO_THREAD_SAFETY_ANALYSIS { return stop_ || !pending_.empty(); });
        if (pending_.empty()) return;  // stopping, nothing left
        batch.swap(pending_);
      }
      Commit(batch);
    }
  }

  void Commit(std::deque<Pending>& batch) SPARSEKV_EXCLUDES(mu_) {
    Status st;
    uint64_t segment = 0;
    RandomRWFile* file = nullptr;
    uint64_t offset = 0;
    {
      MutexLock l(mu_);
      st = failed_;
      if (st.ok() && segments_[active_].bytes >= o_.segment_bytes) st = StartSegmentLocked();
      if (st.ok()) {
        segment = active_;
        file = segments_[active_].file.get();
        offset = segments_[active_].bytes;
      }
    }
    std::vector<std::byte> bytes;
    if (st.ok()) {
      for (const Pending& p : batch) EncodeRecord(bytes, segment, p.type, p.request, p.body);
      st = file->Write(offset, bytes);
      if (st.ok() && o_.durability == Durability::kFdatasync) st = file->Sync();
    }
    std::vector<uint64_t> to_delete;
    {
      MutexLock l(mu_);
      if (!st.ok()) {
        if (failed_.ok()) {
          failed_ = st.WithContext("request log: a group commit failed; reopen the log to recover");
          spdlog::error("{}", failed_.ToString());
        }
        st = failed_;
      } else {
        Segment& s = segments_[segment];
        s.bytes += bytes.size();
        ++stats_.commits;
        stats_.syncs += o_.durability == Durability::kFdatasync;
        stats_.bytes_written += bytes.size();
        for (const Pending& p : batch) {
          auto it = live_.find(p.request);
          if (it == live_.end()) continue;
          if (p.type == kFinished) {
            for (uint64_t seg : it->second.segments) --segments_[seg].holders;
            live_.erase(it);
          } else {
            if (it->second.segments.insert(segment).second) ++s.holders;
            if (p.type == kTokens) {
              ++stats_.appends;
              stats_.tokens += p.tokens;
              std::vector<int32_t>& t = it->second.tokens;
              const size_t n = t.size();
              t.resize(n + p.tokens);
              std::memcpy(t.data() + n, p.body.data() + kTokensBodyHeader, 4 * p.tokens);
            } else if (p.type == kSuspended) {
              Suspension su;
              std::memcpy(&su.tokens, p.body.data(), 8);
              std::memcpy(&su.tail.lo, p.body.data() + 8, 8);
              std::memcpy(&su.tail.hi, p.body.data() + 16, 8);
              std::memcpy(&su.tag, p.body.data() + 24, 8);
              it->second.suspension = su;
            }
          }
        }
        // Oldest first, never the active one: a finish record goes only after every older
        // segment, so it never outlives the tokens it ends.
        while (!segments_.empty() && segments_.begin()->first != active_ && segments_.begin()->second.holders == 0) {
          to_delete.push_back(segments_.begin()->first);
          segments_.erase(segments_.begin());
        }
        stats_.segments_deleted += to_delete.size();
      }
    }
    for (uint64_t n : to_delete) {
      const Status d = fs_->DeleteFile(PathOf(n));
      if (!d.ok()) spdlog::warn("request log: deleting {}: {}", PathOf(n), d.ToString());
    }
    if (!to_delete.empty() && o_.durability != Durability::kNone) (void)fs_->SyncDir(o_.path);
    for (Pending& p : batch) p.done(st);
  }

  // Reads every segment, rebuilding the requests and their segments. Decides everything first
  // (a refusal changes no file), then cuts: a torn tail, or under kPointInTime the damage.
  Status RecoverSegments() SPARSEKV_EXCLUDES(mu_) {
    MutexLock l(mu_);  // no other thread yet; for the annotations
    SPARSEKV_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->ListDir(o_.path));
    std::vector<uint64_t> numbers;
    for (const std::string& n : names) {
      if (n.size() != 16 + std::strlen(kSuffix) || n.compare(16, std::string::npos, kSuffix) != 0) continue;
      uint64_t v = 0;
      bool ok = true;
      for (int i = 0; i < 16 && ok; ++i) {
        const char c = n[i];
        const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        ok = d >= 0;
        v = v << 4 | static_cast<uint64_t>(d < 0 ? 0 : d);
      }
      if (ok) numbers.push_back(v);
    }
    std::sort(numbers.begin(), numbers.end());
    const bool point_in_time = o_.recovery == RequestLogRecovery::kPointInTime;
    std::map<uint64_t, Partial> requests;  // unfinished, by id
    std::unordered_map<uint64_t, std::unordered_set<uint64_t>> held;
    std::map<uint64_t, uint64_t> kept;  // segment -> the bytes it keeps
    struct Cut {
      uint64_t number;
      uint64_t keep;  // bytes kept; 0: the file is deleted
    };
    std::vector<Cut> cuts;  // oldest first
    uint64_t torn = 0;
    // Under kPointInTime, once damage is found: where, and what is cut from there on.
    std::optional<std::string> damage;
    uint64_t damage_segments = 0;
    Found lost;
    for (size_t k = 0; k < numbers.size(); ++k) {
      const uint64_t number = numbers[k];
      const bool last = k + 1 == numbers.size();
      const std::string path = PathOf(number);
      SPARSEKV_ASSIGN_OR_RETURN(std::vector<std::byte> data, ReadWhole(path));
      const uint64_t size = data.size();
      const HeaderIs header = CheckHeader(data, number);
      if (header == HeaderIs::kNewer) return NewerHeader(path, data);
      if (damage) {
        // After the damage: all of it goes. Counted, and a newer release's record refuses.
        const Found f = FindRecords(data, header == HeaderIs::kOk ? kSegmentHeaderBytes : 0, number, false);
        if (f.newer) return NewerRecordInTheCut(path, *f.newer, *damage);
        lost.Add(f);
        lost.bytes += size;
        ++damage_segments;
        cuts.push_back({number, 0});
        continue;
      }
      uint64_t good = 0;  // bytes up to the end of the last whole record
      std::string fault;  // why the bytes at `good` are not a whole record
      if (header != HeaderIs::kOk) {
        fault = header == HeaderIs::kTorn          ? "its header is short or zero-filled"
                : header == HeaderIs::kOtherNumber ? fmt::format("its header is segment {}'s",
                                                                 Get<uint64_t>(data.data() + 8))
                                                   : "its header is not a request log segment's";
      } else {
        good = kSegmentHeaderBytes;
        while (good < size) {
          const Parsed r = ReadRecord(data, good, number, requests, held);
          if (r.is == Parsed::kNewer) {
            return Status::NotSupported(fmt::format(
                "request log: {} at byte {}: {}: written by a newer release of sparsekv. Open the log with that "
                "release (or let it finish its requests); this one neither reads nor cuts it. Nothing was changed",
                path, good, r.why));
          }
          if (r.is == Parsed::kBroken) {
            // A whole record whose checksum holds but which does not follow its request: not a
            // torn write, whatever segment it is in.
            return Status::Corruption(fmt::format("request log: {} at byte {}: {}", path, good, r.why));
          }
          if (r.is == Parsed::kBad) {
            fault = r.why;
            break;
          }
          good += r.bytes;
        }
      }
      if (fault.empty()) {
        kept[number] = size;
        continue;
      }
      // Torn, or damage? A torn write leaves nothing whole after it: the damage reaches the end
      // of the file. (A header that is another segment's is never taken for a torn one.)
      const Found after = FindRecords(data, std::max(good, kSegmentHeaderBytes - 1) + 1, number, true);
      if (last && after.records == 0 && header != HeaderIs::kOtherNumber) {
        spdlog::warn("request log: cutting {} bytes of a torn tail off {} at byte {} ({})", size - good, path, good,
                     fault);
        torn += size - good;
        cuts.push_back({number, good});
        if (good > 0) kept[number] = good;
        continue;
      }
      std::string where = fmt::format("{} at byte {}: {}", path, good, fault);
      if (after.records > 0) {
        where += fmt::format(", and a whole record follows at byte {}", after.first);
      } else if (!last) {
        where += ", in a segment older than the newest";
      }
      if (ZeroBlockIn(data, good, RecordEnd(data, good))) {
        where += " (the damaged bytes include a zero-filled 4 KiB block, as a power cut in the middle of an "
                 "unsynced write can leave on some file systems: if that is what happened, cutting there loses only "
                 "appends that were never acknowledged)";
      }
      if (!point_in_time) {
        return Status::Corruption(fmt::format(
            "request log: {}. This is damage, not a torn write: open refused and nothing changed. To open the log "
            "cut there, losing every record from that byte on (this segment's rest and every later segment), copy "
            "the directory aside and open it once with recovery \"point_in_time\" (RequestLogOptions::recovery; "
            "Python: sparsekv.RequestLog(path, recovery=\"point_in_time\"))",
            where));
      }
      damage = where;
      const Found f = FindRecords(data, good, number, false);
      if (f.newer) return NewerRecordInTheCut(path, *f.newer, where);
      lost.Add(f);
      lost.bytes += size - good;
      cuts.push_back({number, good < kSegmentHeaderBytes ? 0 : good});
      if (good >= kSegmentHeaderBytes) kept[number] = good;
    }
    // Requests seen without their head: their first records were reclaimed, which happens only
    // once their finish record is durable. A cut at damage may have taken that finish record.
    std::vector<uint64_t> finished_in_cut;
    for (auto it = requests.begin(); it != requests.end();) {
      if (!it->second.headless) {
        ++it;
      } else if (damage) {
        finished_in_cut.push_back(it->first);
        held.erase(it->first);
        it = requests.erase(it);
      } else {
        return Status::Corruption(fmt::format(
            "request log: request {} is unfinished but its first tokens are in no segment", it->first));
      }
    }
    // Decided: now change the files. Newest first, so that a crash part-way leaves the damaged
    // segment whole, to be found (and cut) again by the next open, never a cut segment with
    // later segments after it.
    bool deleted = false;
    for (auto c = cuts.rbegin(); c != cuts.rend(); ++c) {
      const std::string path = PathOf(c->number);
      if (c->keep == 0) {
        SPARSEKV_RETURN_IF_ERROR(fs_->DeleteFile(path));
        deleted = true;
        continue;
      }
      if (deleted) {
        SPARSEKV_RETURN_IF_ERROR(fs_->SyncDir(o_.path));
        deleted = false;
      }
      SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RandomRWFile> f, fs_->OpenRandomRW(path, FileOpenOptions{}));
      SPARSEKV_RETURN_IF_ERROR(f->Truncate(c->keep));
      SPARSEKV_RETURN_IF_ERROR(f->Sync());
    }
    if (deleted) SPARSEKV_RETURN_IF_ERROR(fs_->SyncDir(o_.path));
    if (damage) {
      spdlog::error(
          "request log: recovery point_in_time: cut the log at {}: {} bytes, {} whole records and {} tokens dropped, "
          "{} later segments deleted{}",
          *damage, lost.bytes, lost.records, lost.tokens, damage_segments,
          finished_in_cut.empty() ? std::string()
                                  : fmt::format("; requests whose finish record was cut, taken as finished: {}",
                                                fmt::join(finished_in_cut, ", ")));
      stats_.damage_bytes_cut = lost.bytes;
      stats_.damage_records_cut = lost.records;
      stats_.damage_tokens_cut = lost.tokens;
    }
    stats_.torn_bytes_cut = torn;
    for (const auto& [number, bytes] : kept) segments_[number].bytes = bytes;
    if (!numbers.empty()) next_segment_ = numbers.back() + 1;
    for (auto& [id, p] : requests) {
      Request& r = p.r;
      Live& live = live_[id];
      live.queued = r.tokens.size();
      live.tokens = r.tokens;
      live.suspension = r.suspension;
      for (uint64_t seg : held[id]) {
        if (segments_.count(seg)) {
          live.segments.insert(seg);
          ++segments_[seg].holders;
        }
      }
      recovered_.push_back(std::move(r));
    }
    return Status::OK();
  }

  Result<std::vector<std::byte>> ReadWhole(const std::string& path) {
    SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RandomRWFile> f, fs_->OpenRandomRW(path, FileOpenOptions{}));
    SPARSEKV_ASSIGN_OR_RETURN(uint64_t size, f->Size());
    std::vector<std::byte> data(size);
    uint64_t got = 0;
    while (got < size) {  // a short read is continued, never taken for the end of the file
      SPARSEKV_ASSIGN_OR_RETURN(uint64_t n, f->Read(got, std::span(data).subspan(got)));
      if (n == 0) break;
      got += n;
    }
    data.resize(got);
    return data;
  }

  enum class HeaderIs : uint8_t { kOk, kTorn, kNewer, kOtherNumber, kGarbage };

  // kTorn: every byte there is either what this release writes or zero, and the file may be short
  // (the header write did not finish); kNewer: "SKVLOG" with another version; kOtherNumber: this
  // release's magic with another segment's number (a file renamed or copied: never cut as torn).
  static HeaderIs CheckHeader(const std::vector<std::byte>& data, uint64_t number) {
    std::byte expected[kSegmentHeaderBytes];
    std::memcpy(expected, kMagic, 8);
    std::memcpy(expected + 8, &number, 8);
    const size_t n = std::min<size_t>(data.size(), kSegmentHeaderBytes);
    if (n == kSegmentHeaderBytes && std::memcmp(data.data(), expected, n) == 0) return HeaderIs::kOk;
    bool torn = true;
    for (size_t i = 0; i < n && torn; ++i) torn = data[i] == std::byte{0} || data[i] == expected[i];
    if (torn) return HeaderIs::kTorn;
    if (n >= 8 && std::memcmp(data.data(), kMagic, 6) == 0 && std::memcmp(data.data() + 6, kMagic + 6, 2) != 0) {
      return HeaderIs::kNewer;
    }
    if (n == kSegmentHeaderBytes && std::memcmp(data.data(), kMagic, 8) == 0) return HeaderIs::kOtherNumber;
    return HeaderIs::kGarbage;
  }

  static Status NewerHeader(const std::string& path, const std::vector<std::byte>& data) {
    std::string version;
    for (int i = 6; i < 8; ++i) {
      const auto c = static_cast<unsigned char>(data[i]);
      version += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c)) : fmt::format("\\x{:02x}", c);
    }
    return Status::NotSupported(fmt::format(
        "request log: {} at byte 0: a segment header of version \"{}\" (magic SKVLOG{}); this release reads and "
        "writes version \"01\": written by a newer release of sparsekv. Open the log with that release (or let it "
        "finish its requests); this one neither reads nor cuts it. Nothing was changed",
        path, version, version));
  }

  static Status NewerRecordInTheCut(const std::string& path, const std::string& newer, const std::string& damage) {
    return Status::NotSupported(fmt::format(
        "request log: {} {}, written by a newer release of sparsekv, lies in what recovery point_in_time would cut "
        "at the damage ({}); this release does not cut what a newer one wrote. Open the log with that release. "
        "Nothing was changed",
        path, newer, damage));
  }

  // Where the record at `at` ends as its length says, or the end of the file when that is past it.
  static uint64_t RecordEnd(const std::vector<std::byte>& data, uint64_t at) {
    if (data.size() - at < kRecordHeaderBytes) return data.size();
    return std::min<uint64_t>(data.size(), at + kRecordHeaderBytes + Get<uint32_t>(data.data() + at + 4));
  }

  // Whether a whole 4 KiB block of the file that overlaps [from, to) holds only zeros.
  static bool ZeroBlockIn(const std::vector<std::byte>& data, uint64_t from, uint64_t to) {
    constexpr uint64_t kBlock = 4096;
    for (uint64_t b = from / kBlock * kBlock; b < to && b + kBlock <= data.size(); b += kBlock) {
      if (std::all_of(data.begin() + b, data.begin() + b + kBlock, [](std::byte x) { return x == std::byte{0}; })) {
        return true;
      }
    }
    return false;
  }

  // Records that verify in data[from..): their checksum holds (reserved bytes zero, body within
  // the file). Scans every byte offset, hopping over each record found; with `first_only`, stops
  // at the first.
  struct Found {
    uint64_t records = 0;
    uint64_t tokens = 0;
    uint64_t first = 0;                 // offset of the first found
    std::optional<std::string> newer;   // the first of a type this release does not know
    uint64_t bytes = 0;                 // not set here: the caller's total of bytes cut
    void Add(const Found& f) {
      records += f.records;
      tokens += f.tokens;
    }
  };
  static Found FindRecords(const std::vector<std::byte>& data, uint64_t from, uint64_t segment, bool first_only) {
    Found out;
    for (uint64_t at = from; at + kRecordHeaderBytes <= data.size();) {
      const uint64_t n = VerifiesAt(data, at, segment);
      if (n == 0) {
        ++at;
        continue;
      }
      if (out.records++ == 0) out.first = at;
      if (first_only) break;
      const std::byte* p = data.data() + at;
      const uint8_t type = Get<uint8_t>(p + 8);
      const uint32_t body = Get<uint32_t>(p + 4);
      const bool tokens = type == kTokens && body >= kTokensBodyHeader &&
                          body == kTokensBodyHeader + 4ull * Get<uint32_t>(p + kRecordHeaderBytes + 8);
      if (tokens) out.tokens += Get<uint32_t>(p + kRecordHeaderBytes + 8);
      const bool known = tokens || (type == kSuspended && body == kSuspendedBody) || (type == kFinished && body == 0);
      if (!known && !out.newer) {
        out.newer = fmt::format("at byte {}: a record of type {} with a body of {} bytes", at, type, body);
      }
      at += n;
    }
    return out;
  }

  // The bytes of the record at `at` when its checksum holds (its reserved bytes zero, as every
  // release writes them), else 0.
  static uint64_t VerifiesAt(const std::vector<std::byte>& data, uint64_t at, uint64_t segment) {
    if (data.size() - at < kRecordHeaderBytes) return 0;
    const std::byte* p = data.data() + at;
    for (int i = 9; i < 16; ++i) {
      if (p[i] != std::byte{0}) return 0;
    }
    const uint32_t body = Get<uint32_t>(p + 4);
    if (body > data.size() - at - kRecordHeaderBytes) return 0;
    if (Checksum(p + 4, kRecordHeaderBytes - 4 + body, segment) != Get<uint32_t>(p)) return 0;
    return kRecordHeaderBytes + body;
  }

  // A request as recovery reads it. Its first records may be gone with a reclaimed segment when
  // it was finished: then its tokens start at `base`, and its finish record comes later.
  struct Partial {
    Request r;
    uint64_t base = 0;
    bool headless = false;  // seen first mid-stream (base > 0) or by a suspension alone
  };

  // What ReadRecord found at an offset.
  struct Parsed {
    enum Is : uint8_t {
      kRecord,  // a whole record of this release, applied; `bytes` long
      kBad,     // fails its check: cut short, a length past the end, or a checksum mismatch
      kNewer,   // its checksum holds, but this release does not know its type, layout or flags
      kBroken,  // whole and known, but does not continue its request
    };
    Is is = kRecord;
    uint64_t bytes = 0;
    std::string why;
  };

  // Parses the record at `at` and applies it to `requests` and `held`.
  static Parsed ReadRecord(const std::vector<std::byte>& data, uint64_t at, uint64_t segment,
                           std::map<uint64_t, Partial>& requests,
                           std::unordered_map<uint64_t, std::unordered_set<uint64_t>>& held) {
    const uint64_t left = data.size() - at;
    if (left < kRecordHeaderBytes) {
      return {Parsed::kBad, 0, fmt::format("a record header cut short ({} of {} bytes)", left, kRecordHeaderBytes)};
    }
    const std::byte* p = data.data() + at;
    const uint32_t body = Get<uint32_t>(p + 4);
    if (body > left - kRecordHeaderBytes) {
      return {Parsed::kBad, 0,
              fmt::format("a record whose body of {} bytes runs past the end of the file ({} bytes left)", body,
                          left - kRecordHeaderBytes)};
    }
    if (Checksum(p + 4, kRecordHeaderBytes - 4 + body, segment) != Get<uint32_t>(p)) {
      return {Parsed::kBad, 0,
              fmt::format("a record ({} bytes) whose checksum does not match", kRecordHeaderBytes + body)};
    }
    const uint8_t type = Get<uint8_t>(p + 8);
    for (int i = 9; i < 16; ++i) {
      if (p[i] != std::byte{0}) {
        return {Parsed::kNewer, 0,
                fmt::format("a record of type {} with its reserved byte {} set ({:#04x})", type, i,
                            static_cast<unsigned>(p[i]))};
      }
    }
    const uint64_t request = Get<uint64_t>(p + 16);
    const std::byte* b = p + kRecordHeaderBytes;
    const uint64_t bytes = kRecordHeaderBytes + body;
    switch (type) {
      case kTokens: {
        if (body < kTokensBodyHeader || body != kTokensBodyHeader + 4ull * Get<uint32_t>(b + 8)) break;
        const uint64_t first = Get<uint64_t>(b);
        const uint32_t count = Get<uint32_t>(b + 8);
        auto [it, fresh] = requests.try_emplace(request);
        Partial& q = it->second;
        if (fresh || (q.headless && q.r.tokens.empty())) {
          q.r.id = request;
          q.base = first;  // 0 unless its head was reclaimed (it must be finished later)
          q.headless = q.headless || first != 0;
        }
        if (first != q.base + q.r.tokens.size()) {
          return {Parsed::kBroken, 0,
                  fmt::format("tokens from {} of request {}, which has {}", first, request,
                              q.base + q.r.tokens.size())};
        }
        const size_t was = q.r.tokens.size();
        q.r.tokens.resize(was + count);
        std::memcpy(q.r.tokens.data() + was, b + kTokensBodyHeader, 4ull * count);
        held[request].insert(segment);
        return {Parsed::kRecord, bytes, {}};
      }
      case kSuspended: {
        if (body != kSuspendedBody) break;
        auto [it, fresh] = requests.try_emplace(request);
        Suspension s{Get<uint64_t>(b), BlockHash{Get<uint64_t>(b + 8), Get<uint64_t>(b + 16)}, Get<uint64_t>(b + 24)};
        if (fresh) {  // its tokens were reclaimed: it must be finished later
          it->second.r.id = request;
          it->second.headless = true;
        } else if (!it->second.headless && s.tokens > it->second.base + it->second.r.tokens.size()) {
          return {Parsed::kBroken, 0, fmt::format("a suspension of request {} past its tokens", request)};
        }
        it->second.r.suspension = s;
        held[request].insert(segment);
        return {Parsed::kRecord, bytes, {}};
      }
      case kFinished:
        if (body != 0) break;
        requests.erase(request);
        held.erase(request);
        return {Parsed::kRecord, bytes, {}};
      default:
        return {Parsed::kNewer, 0, fmt::format("a record of type {} ({} bytes), a type this release does not know",
                                               type, bytes)};
    }
    return {Parsed::kNewer, 0,
            fmt::format("a record of type {} with a body of {} bytes, not this release's layout of that type", type,
                        body)};
  }

  const RequestLogOptions o_;
  FileSystem* const fs_;
  mutable Mutex mu_;
  std::condition_variable_any cv_;
  bool stop_ SPARSEKV_GUARDED_BY(mu_) = false;
  Status failed_ SPARSEKV_GUARDED_BY(mu_);
  std::deque<Pending> pending_ SPARSEKV_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, Live> live_ SPARSEKV_GUARDED_BY(mu_);
  std::map<uint64_t, Segment> segments_ SPARSEKV_GUARDED_BY(mu_);
  uint64_t active_ SPARSEKV_GUARDED_BY(mu_) = 0;
  uint64_t next_segment_ SPARSEKV_GUARDED_BY(mu_) = 1;
  std::vector<Request> recovered_ SPARSEKV_GUARDED_BY(mu_);
  RequestLogStats stats_ SPARSEKV_GUARDED_BY(mu_);
  std::thread committer_;
};

}  // namespace

std::string_view RequestLogRecoveryName(RequestLogRecovery r) {
  switch (r) {
    case RequestLogRecovery::kTolerateTornTail: return "tolerate_torn_tail";
    case RequestLogRecovery::kPointInTime: return "point_in_time";
  }
  return "unknown";
}

Result<RequestLogRecovery> ParseRequestLogRecovery(std::string_view name) {
  if (name == "tolerate_torn_tail") return RequestLogRecovery::kTolerateTornTail;
  if (name == "point_in_time") return RequestLogRecovery::kPointInTime;
  return Status::InvalidArgument(fmt::format(
      "unknown request log recovery '{}', expected tolerate_torn_tail or point_in_time", name));
}

Result<std::unique_ptr<RequestLog>> RequestLog::Open(const RequestLogOptions& options) {
  auto log = std::make_unique<RequestLogImpl>(options);
  SPARSEKV_RETURN_IF_ERROR(log->Init());
  return std::unique_ptr<RequestLog>(std::move(log));
}

}  // namespace sparsekv
