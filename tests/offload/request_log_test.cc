// RequestLog: round trips through a reopen, group commit, refusals, torn tails cut at every
// byte, damage refused (before the tail, and in the newest segment when whole records follow
// it) with every file byte-identical, or cut and reported under recovery point_in_time, a newer
// release's header or record refused, reclaiming finished requests, write errors, short reads,
// and SIGKILL of a child appending from many threads (every acknowledged token survives).
#include "sparsekv/request_log.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "sparsekv/fault_injection_file_system.h"
#include "tests/offload/test_util.h"

#define XXH_INLINE_ALL  // the test writes records of its own (a newer release's)
#include <xxhash.h>

namespace sparsekv {
namespace {

namespace fs = std::filesystem;

// Token j of request r: deterministic, so a recovered log can be checked without a copy.
int32_t TokenOf(uint64_t r, uint64_t j) { return static_cast<int32_t>((r * 1000003 + j * 7919) % 129280); }

std::vector<int32_t> Tokens(uint64_t r, uint64_t first, uint64_t n) {
  std::vector<int32_t> t(n);
  for (uint64_t i = 0; i < n; ++i) t[i] = TokenOf(r, first + i);
  return t;
}

RequestLogOptions Options(const std::string& dir, uint64_t segment_bytes = 64ull << 20) {
  RequestLogOptions o;
  o.path = dir;
  o.segment_bytes = segment_bytes;
  return o;
}

std::unique_ptr<RequestLog> Open(const RequestLogOptions& o) {
  auto log = RequestLog::Open(o);
  EXPECT_TRUE(log.ok()) << log.status().ToString();
  return log.ok() ? std::move(*log) : nullptr;
}

std::map<uint64_t, RequestLog::Request> ById(const RequestLog& log) {
  std::map<uint64_t, RequestLog::Request> out;
  for (auto& r : log.Recover()) out[r.id] = r;
  return out;
}

std::vector<fs::path> Segments(const std::string& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".skvlog") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Every file under `dir` (names and bytes): to show that a refused open changed nothing.
std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    out[fs::relative(e.path(), dir).string()] = std::string(std::istreambuf_iterator<char>(f), {});
  }
  return out;
}

std::string ReadFile(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void WriteFile(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

uint64_t SegmentNumber(const fs::path& p) { return std::stoull(p.stem().string(), nullptr, 16); }

// A record as request_log.h lays it out, its checksum seeded with the segment's number; `type`,
// `reserved` and the body as given (a newer release's record, when they are not this one's).
std::string Record(uint64_t segment, uint8_t type, uint64_t request, const std::string& body, uint8_t reserved = 0) {
  std::string r(24, '\0');
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::memcpy(r.data() + 4, &n, 4);
  r[8] = static_cast<char>(type);
  r[9] = static_cast<char>(reserved);
  std::memcpy(r.data() + 16, &request, 8);
  r += body;
  const uint32_t sum = static_cast<uint32_t>(XXH3_64bits_withSeed(r.data() + 4, r.size() - 4, segment));
  std::memcpy(r.data(), &sum, 4);
  return r;
}

// The body of a tokens record (type 1).
std::string TokensBody(uint64_t first, const std::vector<int32_t>& t) {
  std::string b(16 + 4 * t.size(), '\0');
  const uint32_t n = static_cast<uint32_t>(t.size());
  std::memcpy(b.data(), &first, 8);
  std::memcpy(b.data() + 8, &n, 4);
  std::memcpy(b.data() + 16, t.data(), 4 * t.size());
  return b;
}

RequestLogOptions PointInTime(RequestLogOptions o) {
  o.recovery = RequestLogRecovery::kPointInTime;
  return o;
}

// Opens, expecting a refusal of `code` whose message names `file` and "byte <at>", with every
// file under the directory byte-identical afterwards.
void ExpectRefused(const RequestLogOptions& o, StatusCode code, const std::string& file, uint64_t at,
                   const std::string& what) {
  const auto before = Snapshot(o.path);
  auto log = RequestLog::Open(o);
  ASSERT_FALSE(log.ok()) << what;
  EXPECT_TRUE(log.status().Is(code)) << what << ": " << log.status().ToString();
  EXPECT_NE(log.status().message().find(file), std::string::npos) << what << ": " << log.status().ToString();
  EXPECT_NE(log.status().message().find("byte " + std::to_string(at) + ":"), std::string::npos)
      << what << ": " << log.status().ToString();
  EXPECT_TRUE(Snapshot(o.path) == before) << what << ": a refused open changed the files";
}

TEST(RequestLog, TokensAndSuspensionsSurviveAReopenAndFinishedRequestsDoNot) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path()));
    for (uint64_t step = 0; step < 10; ++step) {
      for (uint64_t r : {7u, 8u, 9u}) ASSERT_TRUE(log->Append(r, step * 5, Tokens(r, step * 5, 5)).ok());
    }
    ASSERT_TRUE(log->Suspended(8, {30, BlockHash{11, 22}, 5}).ok());
    ASSERT_TRUE(log->Suspended(8, {45, BlockHash{33, 44}, 6}).ok());
    ASSERT_TRUE(log->Finish(9).ok());
    EXPECT_EQ(log->Stats().tokens, 150u);
    EXPECT_EQ(log->Stats().live_requests, 2u);
  }
  auto log = Open(Options(dir.path()));
  auto got = ById(*log);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[7].tokens, Tokens(7, 0, 50));
  EXPECT_EQ(got[8].tokens, Tokens(8, 0, 50));
  EXPECT_FALSE(got[7].suspension.has_value());
  ASSERT_TRUE(got[8].suspension.has_value());
  EXPECT_EQ(got[8].suspension->tokens, 45u);
  EXPECT_EQ(got[8].suspension->tail, (BlockHash{33, 44}));
  EXPECT_EQ(got[8].suspension->tag, 6u);
  // Appends go on where they stopped; a finished id may start again at 0.
  EXPECT_TRUE(log->Append(7, 50, Tokens(7, 50, 3)).ok());
  EXPECT_TRUE(log->Append(9, 0, Tokens(9, 0, 2)).ok());
  // Unfinished: the state now (Recover stays what the open found).
  ASSERT_TRUE(log->Suspended(9, {1, BlockHash{5, 6}, 0}).ok());
  ASSERT_TRUE(log->Finish(8).ok());
  const std::vector<RequestLog::Request> now = log->Unfinished();
  ASSERT_EQ(now.size(), 2u);
  EXPECT_EQ(now[0].id, 7u);
  EXPECT_EQ(now[0].tokens, Tokens(7, 0, 53));
  EXPECT_FALSE(now[0].suspension.has_value());
  EXPECT_EQ(now[1].id, 9u);
  EXPECT_EQ(now[1].tokens, Tokens(9, 0, 2));
  ASSERT_TRUE(now[1].suspension.has_value());
  EXPECT_EQ(now[1].suspension->tail, (BlockHash{5, 6}));
  EXPECT_EQ(log->Recover().size(), 2u);
}

TEST(RequestLog, RefusesWhatWouldNotContinueARequest) {
  testing::TempDir dir("rlog");
  auto log = Open(Options(dir.path()));
  ASSERT_TRUE(log->Append(1, 0, Tokens(1, 0, 4)).ok());
  EXPECT_TRUE(log->Append(1, 5, Tokens(1, 5, 1)).Is(StatusCode::kFailedPrecondition)) << "a gap";
  EXPECT_TRUE(log->Append(1, 3, Tokens(1, 3, 1)).Is(StatusCode::kFailedPrecondition)) << "an overlap";
  EXPECT_TRUE(log->Append(2, 1, Tokens(2, 1, 1)).Is(StatusCode::kFailedPrecondition)) << "a new one not at 0";
  EXPECT_TRUE(log->Append(1, 4, {}).Is(StatusCode::kInvalidArgument));
  EXPECT_TRUE(log->Suspended(1, {5, {}, 0}).Is(StatusCode::kFailedPrecondition)) << "past the tokens";
  EXPECT_TRUE(log->Suspended(3, {0, {}, 0}).Is(StatusCode::kFailedPrecondition)) << "unknown";
  EXPECT_TRUE(log->Finish(3).Is(StatusCode::kNotFound));
  ASSERT_TRUE(log->Finish(1).ok());
  EXPECT_TRUE(log->Finish(1).Is(StatusCode::kNotFound));
  EXPECT_TRUE(log->Append(1, 4, Tokens(1, 4, 1)).Is(StatusCode::kFailedPrecondition)) << "finished";
  EXPECT_EQ(log->Stats().tokens, 4u);
  log.reset();
  RequestLogOptions bad = Options("");
  EXPECT_TRUE(RequestLog::Open(bad).status().Is(StatusCode::kInvalidArgument));
  bad = Options(dir.path(), 100);
  EXPECT_TRUE(RequestLog::Open(bad).status().Is(StatusCode::kInvalidArgument));
}

TEST(RequestLog, ConcurrentAppendsAreGroupCommitted) {
  testing::TempDir dir("rlog");
  auto log = Open(Options(dir.path()));
  constexpr int kThreads = 16, kAppends = 200;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int a = 0; a < kAppends; ++a) {
        if (!log->Append(100 + t, uint64_t(a) * 3, Tokens(100 + t, uint64_t(a) * 3, 3)).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  const RequestLogStats s = log->Stats();
  EXPECT_EQ(s.appends, uint64_t{kThreads} * kAppends);
  EXPECT_LT(s.commits, s.appends) << "appends waiting together share one sync";
  EXPECT_EQ(s.syncs, s.commits);
  log.reset();
  log = Open(Options(dir.path()));
  auto got = ById(*log);
  ASSERT_EQ(got.size(), size_t{kThreads});
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(got[100 + t].tokens, Tokens(100 + t, 0, 3 * kAppends));
}

// Cuts the newest segment at every one of its last 200 bytes: Open keeps exactly the whole
// records before the cut (a prefix of each request), reports what it cut, and the log goes on.
// The same under recovery point_in_time: a torn tail is not damage.
TEST(RequestLog, ATornTailIsCutAtEveryByte) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path()));
    for (uint64_t i = 0; i < 6; ++i) {
      ASSERT_TRUE(log->Append(1, i * 4, Tokens(1, i * 4, 4)).ok());
      ASSERT_TRUE(log->Append(2, i * 2, Tokens(2, i * 2, 2)).ok());
    }
  }
  const fs::path last = Segments(dir.path()).back();
  const uint64_t full = fs::file_size(last);
  // Record ends: a 16-byte header, then records of 24 + 16 + 4 x tokens bytes, 1 and 2 in turn.
  std::vector<uint64_t> ends{16};
  for (uint64_t i = 0; i < 12; ++i) ends.push_back(ends.back() + 40 + (i % 2 == 0 ? 16 : 8));
  ASSERT_EQ(ends.back(), full);
  const std::string copy = dir.path() + "/copy";
  for (const bool point_in_time : {false, true}) {
    for (uint64_t cut = full - 200; cut < full; ++cut) {
      fs::remove_all(copy);
      fs::create_directories(copy);
      for (const auto& p : Segments(dir.path())) fs::copy_file(p, copy + "/" + p.filename().string());
      fs::resize_file(copy + "/" + last.filename().string(), cut);
      RequestLogOptions o = Options(copy);
      if (point_in_time) o = PointInTime(o);
      auto log = Open(o);
      ASSERT_NE(log, nullptr) << "cut at " << cut;
      size_t whole = 0;  // records that end at or before the cut
      while (whole + 1 < ends.size() && ends[whole + 1] <= cut) ++whole;
      auto got = ById(*log);
      ASSERT_EQ(got[1].tokens, Tokens(1, 0, 4 * ((whole + 1) / 2))) << cut;
      ASSERT_EQ(got[2].tokens, Tokens(2, 0, 2 * (whole / 2))) << cut;
      const uint64_t kept = fs::file_size(copy + "/" + last.filename().string());
      EXPECT_EQ(kept, ends[whole]) << cut;
      EXPECT_EQ(log->Stats().torn_bytes_cut, cut - kept) << cut;
      EXPECT_EQ(log->Stats().damage_bytes_cut, 0u) << cut;
      // The log goes on after the cut, and a second open finds nothing more to cut.
      ASSERT_TRUE(log->Append(1, got[1].tokens.size(), Tokens(1, got[1].tokens.size(), 1)).ok());
      log.reset();
      log = Open(Options(copy));
      EXPECT_EQ(log->Stats().torn_bytes_cut, 0u) << cut;
      EXPECT_EQ(ById(*log)[1].tokens.size(), got[1].tokens.size() + 1);
    }
  }
}

// What a crash can leave past the last whole record besides a cut: zeros (the file's size
// reached the disk, its data did not), bytes that never verify, or a last record that fails its
// check. Nothing whole follows: the damage reaches the end of the file, a torn tail.
TEST(RequestLog, ZerosGarbageOrABadLastRecordToTheEndAreATornTail) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path()));
    for (uint64_t i = 0; i < 20; ++i) ASSERT_TRUE(log->Append(3, i * 5, Tokens(3, i * 5, 5)).ok());
  }
  const fs::path last = Segments(dir.path()).back();
  const std::string whole = ReadFile(last);
  constexpr uint64_t kRecordBytes = 24 + 16 + 4 * 5;
  std::mt19937_64 rng(5);
  for (int kind = 0; kind < 3; ++kind) {
    std::string bytes = whole;
    uint64_t cut = 0, tokens = 100;
    if (kind == 0) bytes += std::string(8192, '\0');
    if (kind == 1) {
      for (int i = 0; i < 5000; ++i) bytes += static_cast<char>(rng());
    }
    if (kind == 2) {
      bytes[bytes.size() - 7] ^= 1;
      cut = kRecordBytes;
      tokens = 95;
    }
    cut += bytes.size() - whole.size();
    WriteFile(last, bytes);
    auto log = Open(Options(dir.path()));
    ASSERT_NE(log, nullptr) << kind;
    EXPECT_EQ(ById(*log)[3].tokens, Tokens(3, 0, tokens)) << kind;
    EXPECT_EQ(log->Stats().torn_bytes_cut, cut) << kind;
    log.reset();
    EXPECT_EQ(ReadFile(last), whole.substr(0, whole.size() - (kind == 2 ? kRecordBytes : 0))) << kind;
    // Remove the segment the open started, so that `last` is the newest again.
    for (const auto& p : Segments(dir.path())) {
      if (p > last) fs::remove(p);
    }
  }
}

// A flipped bit in the middle of the newest segment, with whole records after it, is damage,
// not a torn write: refused by default, naming the file and the damaged record's offset, every
// file byte-identical; under point_in_time cut there, the loss logged and counted.
TEST(RequestLog, ABitFlippedInTheMiddleOfTheNewestSegmentIsRefusedOrCutWhenAsked) {
  testing::TempDir dir("rlog");
  FaultInjectionFileSystem faults(FileSystem::Default(), 3);
  RequestLogOptions o = Options(dir.path());
  o.fs = &faults;
  constexpr uint64_t kRecords = 100, kRecordBytes = 24 + 16 + 4 * 6;  // 6 tokens each
  {
    auto log = Open(o);
    for (uint64_t i = 0; i < kRecords; ++i) ASSERT_TRUE(log->Append(4, i * 6, Tokens(4, i * 6, 6)).ok());
  }
  const fs::path seg = Segments(dir.path()).back();
  ASSERT_EQ(fs::file_size(seg), 16 + kRecords * kRecordBytes);
  const std::string name = seg.filename().string();
  // Every byte of a record in the middle, each bit position once: checksum, length, type,
  // reserved bytes, request id, body.
  const uint64_t middle = kRecords / 2;
  const uint64_t at = 16 + middle * kRecordBytes;
  for (uint64_t b = 0; b < kRecordBytes; ++b) {
    ASSERT_TRUE(faults.FlipBitInFile(seg.string(), at + b, static_cast<int>(b % 8)).ok());
    ExpectRefused(o, StatusCode::kCorruption, name, at, "flip at byte " + std::to_string(at + b));
    ExpectRefused(o, StatusCode::kCorruption, name, at, "again: nothing changed the first time");
    ASSERT_TRUE(faults.FlipBitInFile(seg.string(), at + b, static_cast<int>(b % 8)).ok());  // mended
  }
  {
    auto log = Open(o);  // mended: whole
    ASSERT_NE(log, nullptr);
    EXPECT_EQ(ById(*log)[4].tokens, Tokens(4, 0, 6 * kRecords));
    EXPECT_EQ(log->Stats().torn_bytes_cut, 0u);
  }
  for (const auto& p : Segments(dir.path())) {
    if (p != seg) fs::remove(p);
  }
  // The same flip, cut when asked.
  ASSERT_TRUE(faults.FlipBitInFile(seg.string(), at + kRecordBytes / 2, 3).ok());
  ExpectRefused(o, StatusCode::kCorruption, name, at, "before the cut");
  {
    auto log = Open(PointInTime(o));
    ASSERT_NE(log, nullptr);
    EXPECT_EQ(ById(*log)[4].tokens, Tokens(4, 0, 6 * middle)) << "every record before the damage";
    const RequestLogStats s = log->Stats();
    EXPECT_EQ(s.damage_bytes_cut, (kRecords - middle) * kRecordBytes);
    EXPECT_EQ(s.damage_records_cut, kRecords - middle - 1) << "the damaged one does not verify";
    EXPECT_EQ(s.damage_tokens_cut, 6 * (kRecords - middle - 1));
    EXPECT_EQ(s.torn_bytes_cut, 0u);
    EXPECT_EQ(fs::file_size(seg), at);
    ASSERT_TRUE(log->Append(4, 6 * middle, Tokens(4, 6 * middle, 2)).ok()) << "the log goes on";
  }
  auto log = Open(o);  // and opens by default again, nothing more to cut
  ASSERT_NE(log, nullptr);
  EXPECT_EQ(ById(*log)[4].tokens, Tokens(4, 0, 6 * middle + 2));
  EXPECT_EQ(log->Stats().damage_bytes_cut, 0u);
}

// A zero-filled 4 KiB block with whole records after it is refused too; the message says that
// a power cut in the middle of an unsynced write can leave one.
TEST(RequestLog, AZeroFilledBlockWithRecordsAfterItIsRefusedAndSaysWhatItMayBe) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path()));
    for (uint64_t i = 0; i < 300; ++i) ASSERT_TRUE(log->Append(6, i * 8, Tokens(6, i * 8, 8)).ok());
  }
  const fs::path seg = Segments(dir.path()).back();
  std::string bytes = ReadFile(seg);
  ASSERT_GT(bytes.size(), 3u * 4096);
  std::fill(bytes.begin() + 4096, bytes.begin() + 8192, '\0');
  WriteFile(seg, bytes);
  const uint64_t first_bad = 16 + (4096 - 16) / 72 * 72;  // records of 72 bytes; the one holding byte 4096
  ExpectRefused(Options(dir.path()), StatusCode::kCorruption, seg.filename().string(), first_bad, "zero block");
  auto refused = RequestLog::Open(Options(dir.path()));
  EXPECT_NE(refused.status().message().find("zero-filled 4 KiB block"), std::string::npos)
      << refused.status().ToString();
}

// A short read (a kernel may return fewer bytes than asked) is continued, never taken for the
// end of a segment: nothing is cut.
TEST(RequestLog, ShortReadsAtOpenAreContinuedNotCut) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path()));
    for (uint64_t i = 0; i < 300; ++i) ASSERT_TRUE(log->Append(7, i * 8, Tokens(7, i * 8, 8)).ok());
  }
  const auto before = Snapshot(dir.path());
  FaultInjectionFileSystem faults(FileSystem::Default(), 9);
  faults.AddRule({FaultOp::kRead, FaultKind::kShortRead, ".skvlog", UINT64_MAX, 1.0});
  RequestLogOptions o = Options(dir.path());
  o.fs = &faults;
  auto log = Open(o);
  ASSERT_NE(log, nullptr);
  EXPECT_GT(faults.Stats().short_reads, 0u);
  EXPECT_EQ(ById(*log)[7].tokens, Tokens(7, 0, 2400));
  EXPECT_EQ(log->Stats().torn_bytes_cut, 0u);
  log.reset();
  for (const auto& [name, data] : before) EXPECT_EQ(ReadFile(dir.path() + "/" + name), data) << name;
}

// A newer release's segment header or record is refused in either recovery mode, naming the
// file and offset, and nothing is deleted or cut: a rollback keeps what the newer release logged.
TEST(RequestLog, ANewerReleasesHeaderOrRecordIsRefusedAndNothingChanges) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path(), 4096));
    for (uint64_t i = 0; i < 120; ++i) ASSERT_TRUE(log->Append(8, i * 8, Tokens(8, i * 8, 8)).ok());
  }
  auto segs = Segments(dir.path());
  ASSERT_GE(segs.size(), 2u);
  const fs::path newest = segs.back(), older = segs.front();
  const uint64_t n = SegmentNumber(newest);
  const std::string whole = ReadFile(newest), whole_older = ReadFile(older);
  auto both = [&](StatusCode code, const std::string& file, uint64_t at, const std::string& what) {
    ExpectRefused(Options(dir.path(), 4096), code, file, at, what);
    ExpectRefused(PointInTime(Options(dir.path(), 4096)), code, file, at, what + " (point_in_time)");
  };
  // A newer segment header: on the newest segment, on a segment past it, on an older one.
  std::string h = whole;
  h[7] = '2';
  WriteFile(newest, h);
  both(StatusCode::kNotSupported, newest.filename().string(), 0, "SKVLOG02 newest");
  WriteFile(newest, whole);
  char next[64];
  std::snprintf(next, sizeof next, "%016llx.skvlog", static_cast<unsigned long long>(n + 1));
  std::string header = "SKVLOG02";
  header.append(8, '\0');
  WriteFile(dir.path() + "/" + next, header + std::string(100, 'x'));
  both(StatusCode::kNotSupported, next, 0, "a newer release's new segment");
  WriteFile(dir.path() + "/" + next, header.substr(0, 8));  // even its first 8 bytes alone
  both(StatusCode::kNotSupported, next, 0, "a newer release's header, short");
  fs::remove(dir.path() + "/" + next);
  h = whole_older;
  h[6] = '1', h[7] = '0';
  WriteFile(older, h);
  both(StatusCode::kNotSupported, older.filename().string(), 0, "SKVLOG10 older");
  WriteFile(older, whole_older);
  // A newer record type as the newest segment's last record (where a torn tail would be), and
  // with this release's records after it.
  const std::string type9 = Record(n, 9, 8, std::string(40, 'n'));
  WriteFile(newest, whole + type9);
  both(StatusCode::kNotSupported, newest.filename().string(), whole.size(), "type 9 last");
  const std::string more = Record(n, 1, 8, TokensBody(960, Tokens(8, 960, 2)));
  WriteFile(newest, whole + type9 + more);
  both(StatusCode::kNotSupported, newest.filename().string(), whole.size(), "type 9, then tokens");
  // A known type in a layout this release does not write, and a reserved byte set.
  WriteFile(newest, whole + Record(n, 2, 8, std::string(40, 's')));
  both(StatusCode::kNotSupported, newest.filename().string(), whole.size(), "a 40-byte suspension");
  WriteFile(newest, whole + Record(n, 1, 8, TokensBody(960, Tokens(8, 960, 2)), 1));
  both(StatusCode::kNotSupported, newest.filename().string(), whole.size(), "a reserved byte set");
  // Point in time never cuts a newer release's record that lies after the damage.
  std::string damaged = whole + more + type9;
  damaged[whole.size() - 20] ^= 4;  // in the last record this release wrote, whole records after it
  WriteFile(newest, damaged);
  ExpectRefused(Options(dir.path(), 4096), StatusCode::kCorruption, newest.filename().string(),
                whole.size() - 72, "damage before a newer record");
  ExpectRefused(PointInTime(Options(dir.path(), 4096)), StatusCode::kNotSupported, newest.filename().string(),
                whole.size() + more.size(), "point_in_time would cut a newer record");
  // This release's record after the last one opens as before; a torn header is still a torn
  // header (deleted: a segment created just before a crash).
  WriteFile(newest, whole + more);
  WriteFile(dir.path() + "/" + next, std::string("SKVLOG0\0\0\0", 10));
  auto log = Open(Options(dir.path(), 4096));
  ASSERT_NE(log, nullptr);
  EXPECT_EQ(ById(*log)[8].tokens, Tokens(8, 0, 962));
  EXPECT_EQ(log->Stats().torn_bytes_cut, 10u);
  EXPECT_FALSE(fs::exists(dir.path() + "/" + next));
}

// A newest segment's header that fails its check: with whole records after it, damage
// (refused); with nothing that verifies after it, a segment created just before a crash (deleted,
// as a torn tail). A header naming another segment's number is never taken for a torn one.
TEST(RequestLog, ADamagedSegmentHeaderIsRefusedUnlessNothingWholeFollowsIt) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path()));
    for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(log->Append(2, i * 3, Tokens(2, i * 3, 3)).ok());
  }
  const fs::path seg = Segments(dir.path()).back();
  const std::string name = seg.filename().string(), whole = ReadFile(seg);
  std::string bytes = whole;
  bytes[2] ^= 1;  // "SKVLOG01" -> "SKWLOG01"
  WriteFile(seg, bytes);
  ExpectRefused(Options(dir.path()), StatusCode::kCorruption, name, 0, "a flipped magic");
  bytes = whole;
  bytes[8] ^= 2;  // another segment's number (3, not 1)
  WriteFile(seg, bytes);
  ExpectRefused(Options(dir.path()), StatusCode::kCorruption, name, 0, "another number");
  WriteFile(seg, bytes.substr(0, 16) + std::string(100, '\0'));
  ExpectRefused(Options(dir.path()), StatusCode::kCorruption, name, 0, "another number, nothing after");
  bytes = whole;
  std::fill(bytes.begin(), bytes.begin() + 16, '\0');
  WriteFile(seg, bytes);
  ExpectRefused(Options(dir.path()), StatusCode::kCorruption, name, 0, "a zeroed header, whole records after");
  std::fill(bytes.begin() + 16, bytes.end(), '\x5a');  // a torn header, bytes that never verify after it
  bytes[3] = '\x11';
  WriteFile(seg, bytes);
  auto log = Open(Options(dir.path()));
  ASSERT_NE(log, nullptr);
  EXPECT_TRUE(log->Recover().empty());
  EXPECT_EQ(log->Stats().torn_bytes_cut, whole.size());
  EXPECT_FALSE(fs::exists(seg));
}

// Damage in a segment older than the newest is never a torn write: refused, every file
// byte-identical; under point_in_time the log is cut there and every later segment deleted.
// Damage in the newest segment's last record reaches the end of the file: cut as a torn tail.
TEST(RequestLog, DamageBeforeTheTailIsRefusedAndDamageInTheTailIsCut) {
  testing::TempDir dir("rlog");
  {
    auto log = Open(Options(dir.path(), 4096));  // small segments: several files
    for (uint64_t i = 0; i < 200; ++i) ASSERT_TRUE(log->Append(5, i * 8, Tokens(5, i * 8, 8)).ok());
  }
  auto segs = Segments(dir.path());
  ASSERT_GE(segs.size(), 3u);
  auto flip = [](const fs::path& p, uint64_t at) {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char c;
    f.read(&c, 1);
    c ^= 0x20;
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&c, 1);
  };
  flip(segs.front(), 100);  // in its second record (72 bytes each, from byte 16)
  ExpectRefused(Options(dir.path(), 4096), StatusCode::kCorruption, segs.front().filename().string(), 88,
                "an older segment");
  {
    // Cut when asked, on a copy: the first record is all that is left.
    const std::string copy = dir.path() + "/copy";
    fs::create_directories(copy);
    uint64_t after = 0;
    for (const auto& p : segs) {
      fs::copy_file(p, copy + "/" + p.filename().string());
      after += fs::file_size(p);
    }
    after -= 88;
    auto log = Open(PointInTime(Options(copy, 4096)));
    ASSERT_NE(log, nullptr);
    EXPECT_EQ(ById(*log)[5].tokens, Tokens(5, 0, 8));
    EXPECT_EQ(log->Stats().damage_bytes_cut, after);
    EXPECT_EQ(log->Stats().damage_records_cut, 198u) << "every record but the first and the damaged one";
    EXPECT_EQ(log->Stats().damage_tokens_cut, 198u * 8);
    EXPECT_EQ(fs::file_size(copy + "/" + segs.front().filename().string()), 88u);
    EXPECT_EQ(Segments(copy).size(), 2u) << "the cut one and the one this open started";
    fs::remove_all(copy);
  }
  flip(segs.front(), 100);  // mended
  flip(segs.back(), fs::file_size(segs.back()) - 10);
  auto log = Open(Options(dir.path(), 4096));
  ASSERT_NE(log, nullptr);
  const auto got = ById(*log)[5].tokens;
  EXPECT_EQ(got, Tokens(5, 0, 1600 - 8)) << "the last record only";
  EXPECT_EQ(log->Stats().torn_bytes_cut, 72u);
}

// A cut at damage can take the finish record of a request whose head was reclaimed (which
// happens only once its finish was durable): such a request is taken as finished.
TEST(RequestLog, PointInTimeTakesARequestWhoseFinishWasCutAsFinished) {
  testing::TempDir dir("rlog");
  const RequestLogOptions o = Options(dir.path(), 4096);
  {
    auto log = Open(o);
    for (uint64_t i = 0; i < 200; ++i) ASSERT_TRUE(log->Append(5, i * 8, Tokens(5, i * 8, 8)).ok());
    ASSERT_TRUE(log->Finish(5).ok());
    ASSERT_TRUE(log->Append(6, 0, Tokens(6, 0, 1)).ok());
  }
  // 57 records of 72 bytes fill a segment: the fourth holds request 5's last 29, its finish and
  // request 6; the first three were reclaimed.
  const auto segs = Segments(dir.path());
  ASSERT_EQ(segs.size(), 1u);
  ASSERT_EQ(fs::file_size(segs[0]), 16 + 29 * 72 + 24 + 44);
  std::string bytes = ReadFile(segs[0]);
  bytes[16 + 72 + 30] ^= 1;
  WriteFile(segs[0], bytes);
  ExpectRefused(o, StatusCode::kCorruption, segs[0].filename().string(), 88, "request 5's second record");
  auto log = Open(PointInTime(o));
  ASSERT_NE(log, nullptr);
  EXPECT_TRUE(log->Recover().empty()) << "request 5 finished; request 6 was cut";
  EXPECT_EQ(log->Stats().damage_records_cut, 27u + 2);
  EXPECT_EQ(log->Stats().damage_tokens_cut, 27u * 8 + 1);
}

TEST(RequestLog, FinishedRequestsGiveTheirSegmentsBack) {
  testing::TempDir dir("rlog");
  auto log = Open(Options(dir.path(), 4096));
  // Request 1 lives long; 2.. come and go.
  ASSERT_TRUE(log->Append(1, 0, Tokens(1, 0, 8)).ok());
  for (uint64_t r = 2; r < 120; ++r) {
    for (uint64_t i = 0; i < 8; ++i) ASSERT_TRUE(log->Append(r, i * 8, Tokens(r, i * 8, 8)).ok());
    ASSERT_TRUE(log->Finish(r).ok());
  }
  const size_t while_held = Segments(dir.path()).size();
  EXPECT_GT(while_held, 10u) << "request 1 holds the oldest segment, so none is deleted";
  ASSERT_TRUE(log->Finish(1).ok());
  ASSERT_TRUE(log->Append(99, 0, Tokens(99, 0, 1)).ok());  // a commit after the finish
  EXPECT_LE(Segments(dir.path()).size(), 2u);
  EXPECT_GT(log->Stats().segments_deleted, 8u);
  log.reset();
  log = Open(Options(dir.path(), 4096));
  EXPECT_EQ(log->Stats().torn_bytes_cut, 0u) << "a segment starting mid-request (its head reclaimed) is whole";
  auto got = ById(*log);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[99].tokens, Tokens(99, 0, 1));
}

TEST(RequestLog, AWriteErrorFailsTheLogUntilItIsOpenedAgain) {
  testing::TempDir dir("rlog");
  FaultInjectionFileSystem faults(FileSystem::Default(), 7);
  RequestLogOptions o = Options(dir.path());
  o.fs = &faults;
  {
    auto log = Open(o);
    ASSERT_TRUE(log->Append(1, 0, Tokens(1, 0, 10)).ok());
    faults.AddRule({FaultOp::kWrite, FaultKind::kEio, ".skvlog", 1, 1.0});
    EXPECT_TRUE(log->Append(1, 10, Tokens(1, 10, 10)).Is(StatusCode::kIOError));
    EXPECT_TRUE(log->Append(2, 0, Tokens(2, 0, 1)).Is(StatusCode::kIOError)) << "failed until reopened";
  }
  o.fs = nullptr;
  auto log = Open(o);
  auto got = ById(*log);
  EXPECT_EQ(got[1].tokens, Tokens(1, 0, got[1].tokens.size()));
  EXPECT_GE(got[1].tokens.size(), 10u) << "the acknowledged tokens";
}

// ---- SIGKILL ----

// Run only when re-executed by the test below: appends from 8 threads, reporting each
// acknowledged append (request, end) through a pipe, until killed.
TEST(RequestLogCrashChild, DISABLED_AppendUntilKilled) {
  const char* dir = std::getenv("SPARSEKV_RLOG_DIR");
  if (dir == nullptr) GTEST_SKIP();
  const int fd = std::atoi(std::getenv("SPARSEKV_RLOG_FD"));
  auto log = RequestLog::Open(Options(dir, 64 << 10));
  ASSERT_TRUE(log.ok()) << log.status().ToString();
  std::map<uint64_t, uint64_t> start;
  for (const auto& r : (*log)->Recover()) start[r.id] = r.tokens.size();
  std::vector<std::thread> threads;
  for (uint64_t t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t r = t;  // each thread its own request, across cycles
      uint64_t at = start.count(r) ? start[r] : 0;
      for (uint64_t i = 0; at < 2'000'000; ++i) {
        const uint64_t n = 1 + (i * 7 + t) % 9;
        if (!(*log)->Append(r, at, Tokens(r, at, n)).ok()) return;
        at += n;
        const uint64_t msg[2] = {r, at};
        if (write(fd, msg, sizeof msg) != sizeof msg) return;
      }
    });
  }
  for (auto& th : threads) th.join();
  pause();
}

TEST(RequestLogCrash, EveryAcknowledgedTokenSurvivesSigkill) {
  testing::TempDir dir("rlog_crash");
  std::map<uint64_t, uint64_t> acked;  // request -> tokens acknowledged
  std::mt19937_64 rng(std::random_device{}());
  uint64_t cut_total = 0;
  for (int cycle = 0; cycle < 4; ++cycle) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = testing::SpawnChildTest(
        "RequestLogCrashChild.DISABLED_AppendUntilKilled",
        {"SPARSEKV_RLOG_DIR=" + dir.path(), "SPARSEKV_RLOG_FD=" + std::to_string(fds[1])}, fds);
    ASSERT_GE(pid, 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200 + rng() % 500);
    auto drain = [&](int timeout_ms) {
      pollfd p{fds[0], POLLIN, 0};
      if (poll(&p, 1, timeout_ms) <= 0) return false;
      uint64_t buf[512];
      const ssize_t n = read(fds[0], buf, sizeof buf);
      if (n <= 0) return false;
      for (ssize_t i = 0; i + 1 < n / 8; i += 2) acked[buf[i]] = std::max(acked[buf[i]], buf[i + 1]);
      return true;
    };
    while (std::chrono::steady_clock::now() < deadline) drain(10);
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status)) << "the child ended on its own: status " << status;
    while (drain(0)) {
    }
    close(fds[0]);
    // What a restart finds: at least every acknowledged token, each request a prefix of its
    // stream, whatever the kill tore off the tail cut cleanly.
    auto log = Open(Options(dir.path(), 64 << 10));
    ASSERT_NE(log, nullptr);
    cut_total += log->Stats().torn_bytes_cut;
    auto got = ById(*log);
    for (const auto& [r, n] : acked) {
      ASSERT_GE(got[r].tokens.size(), n) << "request " << r << " lost acknowledged tokens in cycle " << cycle;
      ASSERT_EQ(got[r].tokens, Tokens(r, 0, got[r].tokens.size())) << "request " << r;
    }
  }
  uint64_t total = 0;
  for (const auto& [r, n] : acked) total += n;
  EXPECT_GT(total, 100u) << "the child acknowledged too little to test anything";
  std::printf("acknowledged %llu tokens over 4 kills; %llu torn bytes cut\n", static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(cut_total));
}

}  // namespace
}  // namespace sparsekv
