// FaultInjectionFileSystem: a FileSystem in front of another that makes chosen operations fail
// or lie, for tests and the offload stress command.
//
// A fault is a rule: which operation (read, write, sync, allocate, open), on which files (a
// substring of the path; empty matches all), what happens, and how often (the next `count`
// matching operations, each with `probability`). Faults apply alike to the synchronous calls
// and to io_uring submissions through the RandomRWFile hooks:
//   kEio       the operation fails with EIO and does nothing;
//   kEnospc    a write or allocate fails with ENOSPC and does nothing;
//   kShortRead a read of more than 4 KiB returns fewer bytes than asked (a whole number of 4 KiB
//              blocks, at least one), as a kernel may when interrupted; the caller must go on;
//   kTornWrite a write puts only its first part (whole 4 KiB blocks) on disk, then fails
//              with EIO, as a crash in the middle of a write would leave it;
//   kFlipBit   a read returns its bytes with one bit flipped (media corruption seen on read);
//              for a write, the flipped bytes are what reaches the disk and the write
//              succeeds (silent corruption, found only by a checksum on a later read).
// FlipBitInFile damages a stored file directly (the stress command's "bit rot" phase).
//
// Ownership: does not own `base`, which must outlive it and every file it opened. Thread safety:
// every method is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/file_system.h"
#include "sparsekv/thread_annotations.h"

namespace sparsekv {

enum class FaultOp : uint8_t { kRead, kWrite, kSync, kAllocate, kOpen };
enum class FaultKind : uint8_t { kEio, kEnospc, kShortRead, kTornWrite, kFlipBit };

struct FaultRule {
  FaultOp op = FaultOp::kWrite;
  FaultKind kind = FaultKind::kEio;
  // Only files whose path contains this. Default: "" (every file).
  std::string path_substring;
  // How many matching operations may still be hit; UINT64_MAX for unlimited. Default: 1.
  uint64_t count = 1;
  // Chance that a matching operation is hit. Default: 1.
  double probability = 1.0;
};

struct FaultStats {
  uint64_t injected = 0;  // faults applied, all kinds
  uint64_t eio = 0;
  uint64_t enospc = 0;
  uint64_t short_reads = 0;
  uint64_t torn_writes = 0;
  uint64_t flipped_bits = 0;
};

class FaultInjectionFileSystem : public FileSystem {
 public:
  explicit FaultInjectionFileSystem(FileSystem* base, uint64_t seed = 42);
  ~FaultInjectionFileSystem() override;

  void AddRule(FaultRule rule) SPARSEKV_EXCLUDES(mu_);
  void ClearRules() SPARSEKV_EXCLUDES(mu_);
  FaultStats Stats() const SPARSEKV_EXCLUDES(mu_);

  // Flips bit `bit` (0-7) of the byte at `offset` of `path`, through the base file system.
  Status FlipBitInFile(const std::string& path, uint64_t offset, int bit);

  Result<std::unique_ptr<RandomRWFile>> OpenRandomRW(const std::string& path,
                                                     const FileOpenOptions& options) override;
  Status CreateDirs(const std::string& path) override { return base_->CreateDirs(path); }
  Result<std::vector<std::string>> ListDir(const std::string& path) override {
    return base_->ListDir(path);
  }
  Status DeleteFile(const std::string& path) override { return base_->DeleteFile(path); }
  Result<bool> FileExists(const std::string& path) override { return base_->FileExists(path); }
  Status SyncDir(const std::string& path) override { return base_->SyncDir(path); }

  // For the files it opens: the fault to apply to one operation, if any (rule counts are
  // consumed). Returns false when the operation runs normally.
  bool Draw(FaultOp op, const std::string& path, FaultKind* kind) SPARSEKV_EXCLUDES(mu_);
  // A random value for choosing a bit or a cut point.
  uint64_t Random() SPARSEKV_EXCLUDES(mu_);
  void Count(FaultKind kind) SPARSEKV_EXCLUDES(mu_);

 private:
  FileSystem* const base_;
  mutable Mutex mu_;
  std::vector<FaultRule> rules_ SPARSEKV_GUARDED_BY(mu_);
  std::mt19937_64 rng_ SPARSEKV_GUARDED_BY(mu_);
  FaultStats stats_ SPARSEKV_GUARDED_BY(mu_);
};

}  // namespace sparsekv
