// Arena: one 2 MiB-aligned mapping that backs a page pool (private to allocator/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsekv/page_pool.h"
#include "sparsekv/status.h"

namespace sparsekv {

inline constexpr uint64_t kArenaAlign = 2ull << 20;

struct Arena {
  std::byte* base = nullptr;
  uint64_t bytes = 0;  // mapped length, a multiple of kArenaAlign
  int fd = -1;         // memfd or file, -1 for anonymous memory
};

// Maps at least `bytes` bytes. Errors carry the errno text.
Result<Arena> MapArena(uint64_t bytes, ArenaBacking backing, const std::string& file_path,
                       const std::string& name, bool huge_pages, bool populate);
void UnmapArena(Arena& arena);

}  // namespace sparsekv
