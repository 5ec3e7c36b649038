// The stripe driver shared by the kernels of CopyWithRecordChecksum (copy_checksum.cc says
// how XXH3's long-input path runs here). Included by copy_checksum{,_avx2,_avx512}.cc only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "allocator/copy_checksum.h"
#include "allocator/xxhash_dispatch.h"

namespace sparsekv::copy_checksum {
// Everything here is internal to each file that includes it: those files are compiled for
// different instruction sets, and one shared (inline, external) copy of a helper built with
// AVX-512 could otherwise be what the scalar path calls.
namespace {

constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
constexpr size_t kSecretBytes = 192;
constexpr size_t kStripe = 64;
constexpr size_t kStripesPerBlock = (kSecretBytes - kStripe) / 8;  // 16
constexpr size_t kBlock = kStripe * kStripesPerBlock;                // 1,024
constexpr size_t kLastStripeSecret = kSecretBytes - kStripe - 7;
constexpr size_t kPrefix = kRecordChecksumPrefixBytes;

uint64_t Load64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

struct Secret {
  alignas(64) unsigned char bytes[kSecretBytes];
  Secret() { XXH3_generateSecret_fromSeed(bytes, 0); }
};
const unsigned char* DefaultSecret() {
  static const Secret s;
  return s.bytes;
}

uint64_t Fold64(uint64_t a, uint64_t b) {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

uint64_t Finish(const uint64_t acc[8], const unsigned char* secret, uint64_t len) {
  uint64_t h = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    h += Fold64(acc[2 * i] ^ Load64(secret + 11 + 16 * i), acc[2 * i + 1] ^ Load64(secret + 11 + 16 * i + 8));
  }
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  h ^= h >> 32;
  return h;
}

// The stripes of the prefix-and-value input, driven for a kernel K with Acc(in, secret),
// AccCopy(in, out, secret) (which stores and hashes the same load of each byte), Scramble(secret)
// and Store(acc). Every byte stored is the byte hashed from the same read, so a source changed
// while it is copied cannot leave bytes in the destination that the checksum did not see (the
// last stripe overlaps the one before it: its read is stored last and hashed too).
template <class K>
uint64_t Drive(unsigned char* dst, const unsigned char* src, size_t n, const unsigned char* prefix) {
  const unsigned char* secret = DefaultSecret();
  const size_t len = kPrefix + n;
  K k;
  auto stripe = [&](size_t s, const unsigned char* sec) {
    if (s == 0) {
      alignas(64) unsigned char first[kStripe];
      std::memcpy(first, prefix, kPrefix);
      std::memcpy(first + kPrefix, src, kStripe - kPrefix);
      std::memcpy(dst, first + kPrefix, kStripe - kPrefix);  // the bytes hashed, read once
      k.Acc(first, sec);
    } else {
      k.AccCopy(src + kStripe * s - kPrefix, dst + kStripe * s - kPrefix, sec);
    }
  };
  const size_t blocks = (len - 1) / kBlock;
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t j = 0; j < kStripesPerBlock; ++j) stripe(b * kStripesPerBlock + j, secret + 8 * j);
    k.Scramble(secret + kSecretBytes - kStripe);
  }
  const size_t stripes = ((len - 1) - kBlock * blocks) / kStripe;
  for (size_t j = 0; j < stripes; ++j) stripe(blocks * kStripesPerBlock + j, secret + 8 * j);
  // The input's last 64 bytes: all value bytes (n > 192), which also completes the copy.
  k.AccCopy(src + n - kStripe, dst + n - kStripe, secret + kLastStripeSecret);
  uint64_t acc[8];
  k.Store(acc);
  return Finish(acc, secret, len);
}

}  // namespace
}  // namespace sparsekv::copy_checksum
