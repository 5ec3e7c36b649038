// RequestLog: a token-granular write-ahead log of generation requests (issue 35).
//
// An engine appends each request's generated tokens as it produces them; an append is
// acknowledged once it is durable (Durability), so after a crash Recover() gives every
// unfinished request with every acknowledged token and the last state it was suspended at
// (a tail record's key, CacheManager's suspend), and resuming computes only what came after.
//
// Files. "<dir>/<16 hex digits>.skvlog" segments, numbered in order, each a 16-byte header
// (magic "SKVLOG01", its number) and records:
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
// Recovery. Open reads every segment in order. A record that fails its check in the last
// segment is a torn tail: the segment is cut there (the bytes after it were never
// acknowledged). One that fails in an earlier segment is damage, not a crash: Open refuses with
// Corruption, naming the file and offset, and changes nothing. New appends go to a new segment.
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
#include <vector>

#include "sparsekv/block_hash.h"
#include "sparsekv/file_system.h"
#include "sparsekv/status.h"
#include "sparsekv/tier.h"

namespace sparsekv {

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
  uint64_t torn_bytes_cut = 0;  // at the last Open
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
  // directory, damage before the last segment's tail (Corruption).
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
