#include "allocator/copy_checksum.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "allocator/xxhash_dispatch.h"

namespace sparsekv {
namespace {

// Every kernel the CPU has, against XXH3_64bits of the prefix and the value laid end to end
// (the library's own answer) and against the scalar kernel: sizes around XXH3's short-input
// limit (240 bytes in all), its 64-byte stripes and 1,024-byte blocks, at unaligned sources and
// destinations; the destination holds exactly the source's bytes and nothing past them.
TEST(CopyWithRecordChecksum, EveryKernelGivesXxh3OfPrefixAndValue) {
  std::mt19937_64 rng(11);
  std::vector<size_t> sizes = {0,    1,    15,   16,   17,   63,   64,   65,    100,   191,   192,   193,
                               200,  207,  208,  209,  239,  240,  241,  255,   256,   257,   511,   512,
                               975,  976,  977,  1023, 1024, 1025, 1040, 2047,  2048,  2049,  4096,  65536,
                               65537, 100003, (1u << 20) + 5};
  for (int i = 0; i < 30; ++i) sizes.push_back(193 + rng() % 20000);
  const size_t most = (1u << 20) + 5;
  std::vector<unsigned char> src(most + 64), dst(most + 128), prefix(48), joined(48 + most);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  int kernels = 0;
  for (CopyChecksumKernel k : {CopyChecksumKernel::kScalar, CopyChecksumKernel::kAvx2, CopyChecksumKernel::kAvx512}) {
    if (!CopyChecksumKernelAvailable(k)) continue;
    ++kernels;
    for (size_t n : sizes) {
      for (size_t off : {size_t{0}, size_t{3}, size_t{8}, size_t{33}}) {
        for (auto& b : prefix) b = static_cast<unsigned char>(rng());
        std::memset(dst.data(), 0x5A, dst.size());
        const unsigned char* s = src.data() + off;
        unsigned char* d = dst.data() + (off * 7) % 64;
        const uint64_t got = CopyWithRecordChecksumOn(k, d, s, n, prefix.data());
        std::memcpy(joined.data(), prefix.data(), 48);
        std::memcpy(joined.data() + 48, s, n);
        ASSERT_EQ(got, XXH3_64bits(joined.data(), 48 + n)) << CopyChecksumKernelName(k) << " n=" << n << " off=" << off;
        ASSERT_EQ(std::memcmp(d, s, n), 0) << CopyChecksumKernelName(k) << " n=" << n;
        for (unsigned char* q = dst.data(); q < d; ++q) ASSERT_EQ(*q, 0x5A) << "written before the destination";
        for (unsigned char* q = d + n; q < dst.data() + dst.size() && q < d + n + 64; ++q) {
          ASSERT_EQ(*q, 0x5A) << "written past the destination, n=" << n;
        }
        ASSERT_EQ(got, CopyWithRecordChecksumOn(CopyChecksumKernel::kScalar, d, s, n, prefix.data()));
      }
    }
  }
  EXPECT_GE(kernels, 1);
  // An empty value with null pointers (an empty span's data()): the prefix's checksum alone.
  EXPECT_EQ(CopyWithRecordChecksum(nullptr, nullptr, 0, prefix.data()), XXH3_64bits(prefix.data(), 48));
  std::printf("kernels tried: %d, chosen here: %s\n", kernels,
              std::string(CopyChecksumKernelName(ChosenCopyChecksumKernel())).c_str());
}

// A change of any one byte of the prefix or the value changes the checksum (the check a reader
// relies on), on the chosen kernel.
TEST(CopyWithRecordChecksum, OneByteChangedChangesTheChecksum) {
  std::mt19937_64 rng(12);
  std::vector<unsigned char> src(70000), dst(70000), prefix(48);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  for (auto& b : prefix) b = static_cast<unsigned char>(rng());
  const uint64_t base = CopyWithRecordChecksum(dst.data(), src.data(), src.size(), prefix.data());
  for (int i = 0; i < 200; ++i) {
    const size_t at = rng() % (src.size() + 48);
    unsigned char* p = at < 48 ? &prefix[at] : &src[at - 48];
    *p ^= 0x01;
    EXPECT_NE(CopyWithRecordChecksum(dst.data(), src.data(), src.size(), prefix.data()), base) << at;
    *p ^= 0x01;
  }
}

#if !defined(__SANITIZE_THREAD__)  // the race below is the point; TSan would report it
// With another thread changing the source while it is copied (what a local read under write
// leases may meet), the checksum returned is always that of the prefix and the bytes the
// destination ended up with: a byte is never stored from one read and hashed from another.
TEST(CopyWithRecordChecksum, ChecksumIsOfWhatWasCopiedWhileTheSourceChanges) {
  const size_t n = 64 << 10;
  std::vector<unsigned char> src(n, 0x11), dst(n), prefix(48, 0x22), joined(48 + n);
  std::memcpy(joined.data(), prefix.data(), 48);
  for (CopyChecksumKernel k : {CopyChecksumKernel::kScalar, CopyChecksumKernel::kAvx2, CopyChecksumKernel::kAvx512}) {
    if (!CopyChecksumKernelAvailable(k)) continue;
    std::atomic<bool> stop{false};
    // Bytes in the first stripe, the middle, and the last stripe's overlap with the one before.
    std::thread writer([&] {
      unsigned char v = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        ++v;
        for (size_t at : {size_t{3}, size_t{15}, size_t{16}, n / 2, n - 40, n - 1}) {
          std::atomic_ref<unsigned char>(src[at]).store(v, std::memory_order_relaxed);
        }
      }
    });
    int mismatches = 0;
    for (int i = 0; i < 3000; ++i) {
      const uint64_t got = CopyWithRecordChecksumOn(k, dst.data(), src.data(), n, prefix.data());
      std::memcpy(joined.data() + 48, dst.data(), n);
      if (got != XXH3_64bits(joined.data(), joined.size())) ++mismatches;
    }
    stop.store(true);
    writer.join();
    EXPECT_EQ(mismatches, 0) << CopyChecksumKernelName(k);
  }
}
#endif

}  // namespace
}  // namespace sparsekv
