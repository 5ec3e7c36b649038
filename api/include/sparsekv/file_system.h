// FileSystem: the one door through which the offload tiers reach files (LevelDB's Env).
//
// Every byte the tiers write or read in their own files goes through a RandomRWFile from a
// FileSystem, so tests can put a FaultInjectionFileSystem (fault_injection_file_system.h) in
// front of the real one and inject torn writes, short reads, EIO, ENOSPC and flipped bits
// without touching the code under test. RocksDB's own files (the SSD tier's index, the RocksDB
// tier) go through RocksDB's Env instead.
//
// Asynchronous I/O (io_uring) cannot call into the file for every byte, so a RandomRWFile also
// hands out its descriptor and two hooks that the submitting code must call around each
// submission: BeforeSubmit may fail the operation or shorten it (a torn write), AfterComplete
// may change the result (EIO, a short read) or the bytes read (flipped bits). The default
// hooks do nothing.
//
// Ownership: Default() is a process-wide object that lives forever; a RandomRWFile owns its
// descriptor and closes it when destroyed. Thread safety: a FileSystem is thread-safe; a
// RandomRWFile's positional calls (Read, Write, Sync, Allocate) may run concurrently from
// several threads, as pread/pwrite may.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv {

struct FileOpenOptions {
  // Create the file if it does not exist. Default: false.
  bool create = false;
  // O_DIRECT: offsets, lengths and buffers must be multiples of kDirectIoAlignment. Default: false.
  bool direct = false;
  // O_DSYNC: every write is durable when it returns (or completes). Default: false.
  bool dsync = false;
};

inline constexpr uint64_t kDirectIoAlignment = 4096;

// One asynchronous operation as its submitter describes it to the file's hooks.
struct AsyncIo {
  enum class Kind : uint8_t { kRead, kWrite };
  Kind kind = Kind::kRead;
  uint64_t offset = 0;
  // The operation's memory. A write's bytes may be shared with others and must not be changed;
  // AfterComplete may change a read's bytes.
  std::span<std::byte> buffer;
  // Bytes to submit; BeforeSubmit may lower it (a torn write).
  uint64_t submit_bytes = 0;
  // Set by BeforeSubmit: complete with -fail_errno without submitting anything.
  int fail_errno = 0;
  // Set by BeforeSubmit: submit, then report -error_after_submit (a torn write).
  int error_after_submit = 0;
  // Free for the hooks to carry something from BeforeSubmit to AfterComplete.
  uint64_t hook_cookie = 0;
};

class RandomRWFile {
 public:
  virtual ~RandomRWFile() = default;

  // Writes all of `data` at `offset` (retrying short writes); an error names the file.
  virtual Status Write(uint64_t offset, std::span<const std::byte> data) = 0;
  // Reads up to `out.size()` bytes at `offset`; returns how many (fewer only at end of file).
  virtual Result<uint64_t> Read(uint64_t offset, std::span<std::byte> out) = 0;
  // fdatasync: data written so far, and the metadata needed to read it, is durable.
  virtual Status Sync() = 0;
  // Reserves [offset, offset + length) on disk (fallocate), growing the file if needed.
  virtual Status Allocate(uint64_t offset, uint64_t length) = 0;
  virtual Result<uint64_t> Size() = 0;
  // Cuts the file to `size` bytes (ftruncate), as the request log cuts a torn tail.
  virtual Status Truncate(uint64_t size) = 0;
  virtual const std::string& path() const = 0;

  // io_uring support: the descriptor to submit against, and the hooks (see the top).
  virtual int fd() const = 0;
  virtual void BeforeSubmit(AsyncIo& io) {}
  // `result` is the completion's res (bytes or -errno); returns the result to act on.
  virtual int AfterComplete(const AsyncIo& io, int result) { return result; }
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // The POSIX file system.
  static FileSystem* Default();

  virtual Result<std::unique_ptr<RandomRWFile>> OpenRandomRW(const std::string& path,
                                                             const FileOpenOptions& options) = 0;
  // Creates the directory and missing parents; OK if it exists.
  virtual Status CreateDirs(const std::string& path) = 0;
  // Names (not paths) of the entries of a directory.
  virtual Result<std::vector<std::string>> ListDir(const std::string& path) = 0;
  virtual Status DeleteFile(const std::string& path) = 0;
  virtual Result<bool> FileExists(const std::string& path) = 0;
  // fsync of a directory: makes created and deleted entries in it durable.
  virtual Status SyncDir(const std::string& path) = 0;
};

}  // namespace sparsekv
