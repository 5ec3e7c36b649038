#include "allocator/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace sparsekv {
namespace {

// StreamingCopy against its plain twin (memcpy): every size around the 4 KiB switch and the
// 64-byte lines, at every alignment of source and destination within a line, leaves exactly
// the bytes memcpy leaves, and touches nothing outside [dst, dst + n).
TEST(StreamingCopy, LeavesWhatMemcpyLeavesAtEverySizeAndAlignment) {
  std::mt19937_64 rng(5);
  constexpr size_t kMax = (256u << 10) + 200;
  std::vector<std::byte> src(kMax + 128);
  for (auto& b : src) b = static_cast<std::byte>(rng());
  std::vector<size_t> sizes = {0, 1, 63, 64, 65, 4095, 4096, 4097, 4096 + 63, 4096 + 64, 8191, 65536, 65536 + 17, kMax};
  for (int i = 0; i < 20; ++i) sizes.push_back(4096 + rng() % (kMax - 4096));
  std::vector<std::byte> got(kMax + 256), want(kMax + 256);
  for (size_t n : sizes) {
    for (size_t src_off : {size_t{0}, size_t{1}, size_t{15}, size_t{33}, size_t{64}}) {
      for (size_t dst_off : {size_t{0}, size_t{3}, size_t{16}, size_t{63}}) {
        std::memset(got.data(), 0xA5, got.size());
        std::memset(want.data(), 0xA5, want.size());
        // Base addresses rounded to a line, so that the offsets are the alignments tried.
        auto line = [](std::byte* p) {
          return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
        };
        StreamingCopy(line(got.data()) + dst_off, src.data() + src_off, n);
        std::memcpy(line(want.data()) + dst_off, src.data() + src_off, n);
        ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0)
            << n << " bytes, source offset " << src_off << ", destination offset " << dst_off;
      }
    }
  }
}

TEST(StreamingCopy, StreamsOnX86) {
#if defined(__x86_64__)
  EXPECT_TRUE(StreamingCopyStreams());
#else
  EXPECT_FALSE(StreamingCopyStreams());
#endif
}

}  // namespace
}  // namespace sparsekv
