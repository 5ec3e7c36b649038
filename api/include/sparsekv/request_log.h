// RequestLog: a token-granular write-ahead log of generation requests (issue 35).
//
// An engine appends each request's generated tokens as it produces them; an append is
// acknowledged once it is durable (Durability), so after a crash Recover() gives every
// unfinished request with every acknowledged token and the last state it was suspended at
// (a tail record's key, CacheManager's suspend), and resuming computes only what came after.
//
// Files. "<dir>/<16 hex digits>.skvlog" segments, numbered in order, each a 16-byte header
// (magic "SKVLOG01": "SKVLOG" and a two-digit format version; u64 its number) and records:
//   u32 checksum  low 32 bits of XXH3-64 over the rest of the record, seeded with the segment's
//                 number (bytes of another segment, or zeros past the end, never pass)
//   u32 body bytes
//   u8  type      1 tokens, 2 suspended, 3 finished
//   u8 x 7        zero
//   u64 request   the engine's id
//   body          tokens: u64 first token index, u32 count, u32 zero, count x i32 tokens;
//                 suspended: u64 tokens covered, 16-byte tail key, u64 engine tag; finished: none
// Appends from many threads are group-committed: a committer thread writes everything waiting
// in one write at the end of the active segment, syncs once (fdatasync under kFdatasync), then
// acknowledges them all. A segment past `segment_bytes` is closed and a new one started.
//
// Recovery. Open reads every segment in order and tells a torn write from damage, as RocksDB's
// WAL recovery modes do (RocksDB wiki, "WAL Recovery Modes"; include/rocksdb/options.h,
// WALRecoveryMode): the idea is carried over, not the code.
//   - A torn tail: the newest segment's last record fails its check and nothing after it
//     verifies (no record that passes its checksum starts at any later byte): the damage reaches
//     the end of the file, as a write cut short by a crash leaves it. That write was never
//     acknowledged; the segment is cut after its last whole record (counted in torn_bytes_cut).
//     A newest segment whose header fails its check (short, zero-filled, not a segment's), with
//     nothing verifying after it, was created just before a crash: it is deleted. (A header with
//     this release's magic but another segment's number is never taken for a torn one.)
//   - Damage: a record (or header) that fails its check with a record that verifies after it, in
//     the newest segment, or any failure in an older one (closed segments were synced whole).
//     Open refuses with Corruption naming the file and the byte offset, and changes nothing:
//     every file stays byte-identical. Under RequestLogRecovery::kPointInTime the log is cut
//     there instead.
//   - A newer release's data: a segment header "SKVLOG" with a version other than "01", or a
//     record whose checksum holds but whose type (or layout, or reserved bytes) this release does
//     not know. Open refuses with NotSupported naming the file and offset, in either mode, and
//     changes nothing: an older reader never cuts or deletes what a newer one wrote.
//   - A record whose checksum holds but which does not continue its request: Corruption, in any
//     segment and either mode.
// Format evolution: a new kind of record gets a new type number; a change to a record's layout or
// to the header gets a new magic version ("SKVLOG02"); the reserved bytes stay zero.
// New appends go to a new segment.
//
// Reclaiming. Finish(request) logs that the request is done; from then on its records are
// garbage. The oldest segments are deleted while no unfinished request has records in them
// (oldest first, so a finish record never outlives the tokens it ends).
//
// Errors. An append that does not continue its request (first token index not the count so
// far), a suspension past the tokens logged, or a request already finished is refused
// (FailedPrecondition), nothing written. A write or sync error fails every append waiting and
// every later one (IOError): what reached the disk is unknown until the log is opened again.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsekv/block_hash.h"
#include "sparsekv/file_system.h"
#include "sparsekv/status.h"
#include "sparsekv/tier.h"

namespace sparsekv {

// What Open does with damage (see Recovery above). RocksDB's WALRecoveryMode is the model.
enum class RequestLogRecovery : uint8_t {
  // "tolerate_torn_tail": cut a torn tail of the newest segment; refuse damage anywhere else
  // (RocksDB's kTolerateCorruptedTailRecords for the tail, kAbsoluteConsistency for the rest).
  kTolerateTornTail,
  // "point_in_time": also cut at damage: the damaged segment is cut at the first record that
  // fails its check and every later segment is deleted, so the log holds exactly what came
  // before the damage (RocksDB's kPointInTimeRecovery). What is cut is logged (file, offset,
  // bytes, records, tokens) and counted in RequestLogStats::damage_*. A newer release's header
  // or record is still refused, even in the part that would be cut. Meant for one open by an
  // operator who has read the refusal and kept a copy of the directory, not as a standing setting.
  kPointInTime,
};
std::string_view RequestLogRecoveryName(RequestLogRecovery r);
// "tolerate_torn_tail" or "point_in_time"; InvalidArgument for anything else.
Result<RequestLogRecovery> ParseRequestLogRecovery(std::string_view name);

struct RequestLogOptions {
  // Directory of the segments; created if missing. Must be set.
  std::string path;
  // When an append is acknowledged (tier.h): kFdatasync syncs each group commit; kDsync writes
  // with O_DSYNC; kNone acknowledges once written (a process crash loses nothing, a power cut
  // may). Default: kFdatasync.
  Durability durability = Durability::kFdatasync;
  // A segment is closed once it holds this many bytes. Default: 64 MiB.
  uint64_t segment_bytes = 64ull << 20;
  // Tokens in one append at most. Default: 1 Mi.
  uint32_t max_append_tokens = 1u << 20;
  // What Open does with damage. Default: kTolerateTornTail (damage refuses to open).
  RequestLogRecovery recovery = RequestLogRecovery::kTolerateTornTail;
  // The file system (tests put a FaultInjectionFileSystem here). Default: FileSystem::Default().
  FileSystem* fs = nullptr;
};

struct RequestLogStats {
  uint64_t appends = 0;         // appends acknowledged
  uint64_t tokens = 0;          // tokens acknowledged
  uint64_t commits = 0;         // group commits (one write, one sync each)
  uint64_t syncs = 0;
  uint64_t bytes_written = 0;
  uint64_t segments = 0;        // segment files now
  uint64_t segments_deleted = 0;
  uint64_t live_requests = 0;   // requests with records and no finish
  uint64_t torn_bytes_cut = 0;  // at the last Open: a torn tail (never acknowledged)
  // At the last Open, under kPointInTime only: what was cut at damage, from the first record that
  // failed its check to the end of the log (acknowledged data lost).
  uint64_t damage_bytes_cut = 0;
  uint64_t damage_records_cut = 0;  // records among those bytes whose checksums held
  uint64_t damage_tokens_cut = 0;   // tokens in those records
};

class RequestLog {
 public:
  // What a request's log says (Recover).
  struct Suspension {
    uint64_t tokens = 0;  // tokens the suspended state covers
    BlockHash tail;       // the tail record's key
    uint64_t tag = 0;     // the engine's own
  };
  struct Request {
    uint64_t id = 0;
    std::vector<int32_t> tokens;  // every acknowledged token, in order
    std::optional<Suspension> suspension;  // the last one logged
  };

  // Opens (and recovers) the log in options.path. Errors: bad options, an unreadable
  // directory, damage that is not a torn tail (Corruption, unless options.recovery is
  // kPointInTime), a newer release's header or record (NotSupported). A refusal changes no file.
  static Result<std::unique_ptr<RequestLog>> Open(const RequestLogOptions& options);
  virtual ~RequestLog() = default;

  // Appends tokens[0..n) as tokens first_token.. of `request` (a new request starts at 0).
  // Returns once durable; AppendAsync calls `done` then, on the committer's thread.
  virtual Status Append(uint64_t request, uint64_t first_token, std::span<const int32_t> tokens) = 0;
  virtual void AppendAsync(uint64_t request, uint64_t first_token, std::span<const int32_t> tokens,
                           std::function<void(Status)> done) = 0;
  // Logs that `request` was suspended with its state at `s.tokens` tokens (at most those logged).
  virtual Status Suspended(uint64_t request, const Suspension& s) = 0;
  // Logs that `request` is done; its records become garbage. NotFound for an unknown request.
  virtual Status Finish(uint64_t request) = 0;

  // Every unfinished request as Open found it: what the last run (or a crash) left.
  virtual std::vector<Request> Recover() const = 0;
  // Every unfinished request now: what Open found, with every append and suspension
  // acknowledged since (a daemon answers an engine that restarted while it ran), by id.
  virtual std::vector<Request> Unfinished() const = 0;
  virtual RequestLogStats Stats() const = 0;
};

}  // namespace sparsekv
