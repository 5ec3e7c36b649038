#include "sparsekv/fault_injection_file_system.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "io_status.h"

namespace sparsekv {
namespace {

using offload::ErrnoStatus;

// A random whole number of 4 KiB blocks, at least one, strictly fewer bytes than `bytes`; 0
// when `bytes` is one block or less.
uint64_t ShorterAligned(uint64_t bytes, uint64_t random) {
  const uint64_t blocks = (bytes - 1) / kDirectIoAlignment;
  return blocks == 0 ? 0 : (random % blocks + 1) * kDirectIoAlignment;
}

class FaultRandomRWFile final : public RandomRWFile {
 public:
  FaultRandomRWFile(FaultInjectionFileSystem* fs, std::unique_ptr<RandomRWFile> base)
      : fs_(fs), base_(std::move(base)) {}

  Status Write(uint64_t offset, std::span<const std::byte> data) override {
    FaultKind kind;
    if (!data.empty() && fs_->Draw(FaultOp::kWrite, path(), &kind)) {
      switch (kind) {
        case FaultKind::kEio:
          fs_->Count(kind);
          return ErrnoStatus(EIO, fmt::format("pwrite {} at {} (injected)", path(), offset));
        case FaultKind::kEnospc:
          fs_->Count(kind);
          return ErrnoStatus(ENOSPC, fmt::format("pwrite {} at {} (injected)", path(), offset));
        case FaultKind::kTornWrite: {
          fs_->Count(kind);
          const uint64_t keep = ShorterAligned(data.size(), fs_->Random());
          if (keep > 0) SPARSEKV_RETURN_IF_ERROR(base_->Write(offset, data.first(keep)));
          return ErrnoStatus(
              EIO, fmt::format("pwrite {} at {}: torn after {} of {} bytes (injected)", path(),
                               offset, keep, data.size()));
        }
        case FaultKind::kFlipBit: {
          fs_->Count(kind);
          std::vector<std::byte> copy(data.begin(), data.end());
          const uint64_t r = fs_->Random();
          copy[r % copy.size()] ^= std::byte(1u << ((r >> 40) % 8));
          return base_->Write(offset, copy);
        }
        case FaultKind::kShortRead:
          break;
      }
    }
    return base_->Write(offset, data);
  }

  Result<uint64_t> Read(uint64_t offset, std::span<std::byte> out) override {
    FaultKind kind;
    const bool hit = !out.empty() && fs_->Draw(FaultOp::kRead, path(), &kind);
    if (hit && kind == FaultKind::kEio) {
      fs_->Count(kind);
      return ErrnoStatus(EIO, fmt::format("pread {} at {} (injected)", path(), offset));
    }
    SPARSEKV_ASSIGN_OR_RETURN(uint64_t n, base_->Read(offset, out));
    if (hit && kind == FaultKind::kShortRead &&
        n > kDirectIoAlignment) {  // never 0 bytes: that reads as EOF
      fs_->Count(kind);
      n = ShorterAligned(n, fs_->Random());
    } else if (hit && kind == FaultKind::kFlipBit && n > 0) {
      fs_->Count(kind);
      const uint64_t r = fs_->Random();
      out[r % n] ^= std::byte(1u << ((r >> 40) % 8));
    }
    return n;
  }

  Status Sync() override {
    FaultKind kind;
    if (fs_->Draw(FaultOp::kSync, path(), &kind) && kind == FaultKind::kEio) {
      fs_->Count(kind);
      return ErrnoStatus(EIO, fmt::format("fdatasync {} (injected)", path()));
    }
    return base_->Sync();
  }

  Status Allocate(uint64_t offset, uint64_t length) override {
    FaultKind kind;
    if (fs_->Draw(FaultOp::kAllocate, path(), &kind) &&
        (kind == FaultKind::kEio || kind == FaultKind::kEnospc)) {
      fs_->Count(kind);
      return ErrnoStatus(kind == FaultKind::kEio ? EIO : ENOSPC,
                         fmt::format("fallocate {} [{}, +{}) (injected)", path(), offset, length));
    }
    return base_->Allocate(offset, length);
  }

  Result<uint64_t> Size() override { return base_->Size(); }
  Status Truncate(uint64_t size) override { return base_->Truncate(size); }
  const std::string& path() const override { return base_->path(); }
  int fd() const override { return base_->fd(); }

  // Writes are decided before submission (what reaches the disk), reads after completion
  // (what the caller sees).
  void BeforeSubmit(AsyncIo& io) override {
    base_->BeforeSubmit(io);
    FaultKind kind;
    if (io.kind != AsyncIo::Kind::kWrite || io.submit_bytes == 0 ||
        !fs_->Draw(FaultOp::kWrite, path(), &kind)) {
      return;
    }
    switch (kind) {
      case FaultKind::kEio:
        fs_->Count(kind);
        io.fail_errno = EIO;
        break;
      case FaultKind::kEnospc:
        fs_->Count(kind);
        io.fail_errno = ENOSPC;
        break;
      case FaultKind::kTornWrite:
        fs_->Count(kind);
        io.submit_bytes = ShorterAligned(io.submit_bytes, fs_->Random());
        io.error_after_submit = EIO;
        if (io.submit_bytes == 0) io.fail_errno = EIO;
        break;
      case FaultKind::kFlipBit: {
        // The buffer may be shared (a bundle's own memory): the bit is flipped on disk once the
        // write has landed, which is the same to any later reader.
        fs_->Count(kind);
        const uint64_t r = fs_->Random();
        io.hook_cookie = ((io.offset + r % io.submit_bytes) << 3 | ((r >> 40) % 8)) + 1;
        break;
      }
      case FaultKind::kShortRead:
        break;
    }
  }

  int AfterComplete(const AsyncIo& io, int result) override {
    result = base_->AfterComplete(io, result);
    if (io.kind == AsyncIo::Kind::kWrite && io.hook_cookie != 0 && result > 0) {
      const uint64_t at = (io.hook_cookie - 1) >> 3;
      const Status s = FlipOnDisk(at, static_cast<int>((io.hook_cookie - 1) & 7));
      return s.ok() ? result : -EIO;
    }
    FaultKind kind;
    if (io.kind != AsyncIo::Kind::kRead || result <= 0 || !fs_->Draw(FaultOp::kRead, path(), &kind))
      return result;
    switch (kind) {
      case FaultKind::kEio:
        fs_->Count(kind);
        return -EIO;
      case FaultKind::kShortRead:
        if (result <= static_cast<int>(kDirectIoAlignment))
          return result;  // never 0 bytes: that reads as EOF
        fs_->Count(kind);
        return static_cast<int>(ShorterAligned(static_cast<uint64_t>(result), fs_->Random()));
      case FaultKind::kFlipBit: {
        fs_->Count(kind);
        const uint64_t r = fs_->Random();
        io.buffer[r % static_cast<uint64_t>(result)] ^= std::byte(1u << ((r >> 40) % 8));
        return result;
      }
      default:
        return result;
    }
  }

 private:
  // Read-modify-write of the 4 KiB block holding `offset` (the file may be O_DIRECT).
  Status FlipOnDisk(uint64_t offset, int bit) {
    void* raw = nullptr;
    if (posix_memalign(&raw, kDirectIoAlignment, kDirectIoAlignment) != 0)
      return Status::ResourceExhausted("flip");
    std::unique_ptr<std::byte, void (*)(void*)> block(static_cast<std::byte*>(raw), &std::free);
    const uint64_t at = offset / kDirectIoAlignment * kDirectIoAlignment;
    const std::span<std::byte> b(block.get(), kDirectIoAlignment);
    SPARSEKV_ASSIGN_OR_RETURN(uint64_t n, base_->Read(at, b));
    if (n != kDirectIoAlignment) return Status::IOError("flip: short read");
    b[offset - at] ^= std::byte(1u << bit);
    return base_->Write(at, b);
  }

  FaultInjectionFileSystem* const fs_;
  std::unique_ptr<RandomRWFile> base_;
};

}  // namespace

FaultInjectionFileSystem::FaultInjectionFileSystem(FileSystem* base, uint64_t seed)
    : base_(base), rng_(seed) {}
FaultInjectionFileSystem::~FaultInjectionFileSystem() = default;

void FaultInjectionFileSystem::AddRule(FaultRule rule) {
  MutexLock lock(mu_);
  rules_.push_back(std::move(rule));
}

void FaultInjectionFileSystem::ClearRules() {
  MutexLock lock(mu_);
  rules_.clear();
}

FaultStats FaultInjectionFileSystem::Stats() const {
  MutexLock lock(mu_);
  return stats_;
}

bool FaultInjectionFileSystem::Draw(FaultOp op, const std::string& path, FaultKind* kind) {
  MutexLock lock(mu_);
  for (FaultRule& r : rules_) {
    if (r.op != op || r.count == 0) continue;
    if (!r.path_substring.empty() && path.find(r.path_substring) == std::string::npos) continue;
    if (r.probability < 1.0 && std::uniform_real_distribution<double>(0, 1)(rng_) >= r.probability)
      continue;
    if (r.count != UINT64_MAX) --r.count;
    *kind = r.kind;
    return true;
  }
  return false;
}

uint64_t FaultInjectionFileSystem::Random() {
  MutexLock lock(mu_);
  return rng_();
}

void FaultInjectionFileSystem::Count(FaultKind kind) {
  MutexLock lock(mu_);
  ++stats_.injected;
  switch (kind) {
    case FaultKind::kEio:
      ++stats_.eio;
      break;
    case FaultKind::kEnospc:
      ++stats_.enospc;
      break;
    case FaultKind::kShortRead:
      ++stats_.short_reads;
      break;
    case FaultKind::kTornWrite:
      ++stats_.torn_writes;
      break;
    case FaultKind::kFlipBit:
      ++stats_.flipped_bits;
      break;
  }
}

Status FaultInjectionFileSystem::FlipBitInFile(const std::string& path, uint64_t offset, int bit) {
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RandomRWFile> f,
                            base_->OpenRandomRW(path, FileOpenOptions{}));
  std::byte b[1];
  SPARSEKV_ASSIGN_OR_RETURN(uint64_t n, f->Read(offset, b));
  if (n != 1) return Status::OutOfRange(fmt::format("{}: offset {} is past the end", path, offset));
  b[0] ^= std::byte(1u << (bit & 7));
  return f->Write(offset, b);
}

Result<std::unique_ptr<RandomRWFile>> FaultInjectionFileSystem::OpenRandomRW(
    const std::string& path, const FileOpenOptions& options) {
  FaultKind kind;
  if (Draw(FaultOp::kOpen, path, &kind) &&
      (kind == FaultKind::kEio || kind == FaultKind::kEnospc)) {
    Count(kind);
    return ErrnoStatus(kind == FaultKind::kEio ? EIO : ENOSPC,
                       fmt::format("open {} (injected)", path));
  }
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<RandomRWFile> base, base_->OpenRandomRW(path, options));
  return std::unique_ptr<RandomRWFile>(new FaultRandomRWFile(this, std::move(base)));
}

}  // namespace sparsekv
