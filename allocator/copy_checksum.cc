// CopyWithRecordChecksum: XXH3-64 (seed 0) of a 48-byte prefix and a copied value, computed
// stripe by stripe as each 64-byte stripe of the source is loaded and stored.
//
// XXH3's long-input path (inputs over 240 bytes), as its specification describes it
// (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md): eight 64-bit accumulators;
// every 64-byte stripe adds, per lane, the data word of the neighbouring lane and the product of
// the low and high halves of (data XOR secret word); after every 16 stripes (a 1,024-byte block
// with the 192-byte default secret) the accumulators are scrambled with the secret's last 64
// bytes; the input's last 64 bytes are one more stripe, with the secret at 192 - 64 - 7; then the
// lanes are folded in pairs against the secret from byte 11, started from length * PRIME64_1, and
// avalanched. The default secret is the library's (XXH3_generateSecret_fromSeed with seed 0
// gives it back), so the result is checked against XXH3_64bits in tests/allocator.
//
// The input here is the prefix (48 bytes) then the value: stripe 0 is the prefix and the
// value's first 16 bytes, stripe s >= 1 is value bytes [64 s - 48, 64 s + 16), each stored to
// the destination right after it is loaded.
#include "allocator/copy_checksum.h"

#include <cstring>

#include "allocator/copy_checksum_impl.h"

namespace sparsekv {
namespace copy_checksum {
// The wide kernels, in their own files (compiled for their instruction sets).
uint64_t DriveAvx2(unsigned char* d, const unsigned char* s, size_t n, const unsigned char* p);
uint64_t DriveAvx512(unsigned char* d, const unsigned char* s, size_t n, const unsigned char* p);
}  // namespace copy_checksum

namespace {

using namespace copy_checksum;

struct ScalarKernel {
  uint64_t a[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3, kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  void Acc(const unsigned char* in, const unsigned char* sec) {
    for (int i = 0; i < 8; ++i) {
      const uint64_t v = Load64(in + 8 * i);
      const uint64_t key = v ^ Load64(sec + 8 * i);
      a[i ^ 1] += v;
      a[i] += (key & 0xFFFFFFFFu) * (key >> 32);
    }
  }
  void AccCopy(const unsigned char* in, unsigned char* out, const unsigned char* sec) {
    unsigned char stripe[kStripe];  // one read of the source: stored and hashed from here
    std::memcpy(stripe, in, kStripe);
    std::memcpy(out, stripe, kStripe);
    Acc(stripe, sec);
  }
  void Scramble(const unsigned char* sec) {
    for (int i = 0; i < 8; ++i) {
      uint64_t x = a[i];
      x ^= x >> 47;
      x ^= Load64(sec + 8 * i);
      a[i] = x * kPrime32_1;
    }
  }
  void Store(uint64_t out[8]) const { std::memcpy(out, a, sizeof(a)); }
};

// Short values: copied, then hashed whole (XXH3's short paths differ from the stripes).
// An empty value may come with null pointers: nothing is copied then.
uint64_t Short(unsigned char* dst, const unsigned char* src, size_t n, const unsigned char* prefix) {
  unsigned char buf[kPrefix + 4 * kStripe];
  std::memcpy(buf, prefix, kPrefix);
  if (n > 0) {
    std::memcpy(dst, src, n);
    std::memcpy(buf + kPrefix, dst, n);
  }
  return XXH3_64bits(buf, kPrefix + n);
}

CopyChecksumKernel Choose() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return CopyChecksumKernel::kAvx512;
  if (__builtin_cpu_supports("avx2")) return CopyChecksumKernel::kAvx2;
#endif
  return CopyChecksumKernel::kScalar;
}

}  // namespace

bool CopyChecksumKernelAvailable(CopyChecksumKernel k) {
  switch (k) {
    case CopyChecksumKernel::kScalar: return true;
#if defined(__x86_64__)
    case CopyChecksumKernel::kAvx2: return __builtin_cpu_supports("avx2");
    case CopyChecksumKernel::kAvx512: return __builtin_cpu_supports("avx512f");
#else
    default: return false;
#endif
  }
  return false;
}

std::string_view CopyChecksumKernelName(CopyChecksumKernel k) {
  switch (k) {
    case CopyChecksumKernel::kScalar: return "scalar";
    case CopyChecksumKernel::kAvx2: return "avx2";
    case CopyChecksumKernel::kAvx512: return "avx512";
  }
  return "?";
}

CopyChecksumKernel ChosenCopyChecksumKernel() {
  static const CopyChecksumKernel k = Choose();
  return k;
}

uint64_t CopyWithRecordChecksumOn(CopyChecksumKernel k, void* dst, const void* src, size_t n, const void* prefix) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const auto* p = static_cast<const unsigned char*>(prefix);
  if (kPrefix + n <= 4 * kStripe - 16) return Short(d, s, n, p);  // 240 bytes or fewer in all
#if defined(__x86_64__)
  if (k == CopyChecksumKernel::kAvx512 && CopyChecksumKernelAvailable(k)) return DriveAvx512(d, s, n, p);
  if (k == CopyChecksumKernel::kAvx2 && CopyChecksumKernelAvailable(k)) return DriveAvx2(d, s, n, p);
#endif
  return Drive<ScalarKernel>(d, s, n, p);
}

uint64_t CopyWithRecordChecksum(void* dst, const void* src, size_t n, const void* prefix) {
  return CopyWithRecordChecksumOn(ChosenCopyChecksumKernel(), dst, src, n, prefix);
}

}  // namespace sparsekv
