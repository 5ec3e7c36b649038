#include "arena.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace sparsekv {
namespace {

Status Errno(const std::string& what) {
  const int e = errno;
  return Status::IOError(fmt::format("{}: {}", what, std::strerror(e)), e == EAGAIN || e == ENOMEM);
}

}  // namespace

Result<Arena> MapArena(uint64_t bytes, ArenaBacking backing, const std::string& file_path,
                       const std::string& name, bool huge_pages, bool populate) {
  Arena a;
  a.bytes = (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
  // Reserve aligned address space first, then place the real mapping inside it.
  const uint64_t reserve = a.bytes + kArenaAlign;
  void* r = mmap(nullptr, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return Errno(fmt::format("reserving {} bytes for pool {}", reserve, name));
  const uintptr_t start = reinterpret_cast<uintptr_t>(r);
  const uintptr_t aligned = (start + kArenaAlign - 1) & ~(kArenaAlign - 1);
  if (aligned > start) munmap(r, aligned - start);
  const uintptr_t end = start + reserve;
  if (end > aligned + a.bytes) munmap(reinterpret_cast<void*>(aligned + a.bytes), end - (aligned + a.bytes));

  int flags = MAP_FIXED;
  if (backing == ArenaBacking::kAnonymous) {
    flags |= MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  } else {
    if (backing == ArenaBacking::kMemfd) {
      // Sealable, so that a user who hands the fd to other processes can forbid them to write.
      a.fd = memfd_create(("sparsekv-" + name).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (a.fd < 0) {
        Status st = Errno("memfd_create for pool " + name);
        munmap(reinterpret_cast<void*>(aligned), a.bytes);
        return st;
      }
    } else {
      if (file_path.empty()) {
        munmap(reinterpret_cast<void*>(aligned), a.bytes);
        return Status::InvalidArgument(fmt::format("pool {}: file backing needs file_path", name));
      }
      a.fd = open(file_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      if (a.fd < 0) {
        Status st = Errno(fmt::format("opening arena file '{}'", file_path));
        munmap(reinterpret_cast<void*>(aligned), a.bytes);
        return st;
      }
    }
    if (ftruncate(a.fd, static_cast<off_t>(a.bytes)) != 0) {
      Status st = Errno(fmt::format("sizing arena of pool {} to {} bytes", name, a.bytes));
      close(a.fd);
      munmap(reinterpret_cast<void*>(aligned), a.bytes);
      return st;
    }
    flags |= MAP_SHARED;
  }
  if (populate) flags |= MAP_POPULATE;
  void* m = mmap(reinterpret_cast<void*>(aligned), a.bytes, PROT_READ | PROT_WRITE, flags, a.fd, 0);
  if (m == MAP_FAILED) {
    Status st = Errno(fmt::format("mapping {} bytes for pool {}", a.bytes, name));
    if (a.fd >= 0) close(a.fd);
    munmap(reinterpret_cast<void*>(aligned), a.bytes);
    return st;
  }
  if (huge_pages) madvise(m, a.bytes, MADV_HUGEPAGE);  // advisory: failure is harmless
  a.base = static_cast<std::byte*>(m);
  return a;
}

void UnmapArena(Arena& arena) {
  if (arena.base) munmap(arena.base, arena.bytes);
  if (arena.fd >= 0) close(arena.fd);
  arena = Arena{};
}

}  // namespace sparsekv
