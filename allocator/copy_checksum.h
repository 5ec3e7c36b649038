#pragma once

// A copy that also computes a record's checksum (bundle.h: XXH3-64, seed 0, of the record's
// header from byte 16 on, then its value) over the bytes as they are copied: one pass over the
// source instead of a copy and then a hash. For a client reading a value straight from the
// daemon's host arena while other clients can write that arena (local reads under write
// leases, api/PROTOCOL.md): what it checks must be what it copied.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace sparsekv {

// The header bytes a one-segment record's checksum covers before its value.
inline constexpr size_t kRecordChecksumPrefixBytes = 48;

// Copies `n` bytes from `src` to `dst` (not overlapping) and returns XXH3_64bits of
// `prefix` (kRecordChecksumPrefixBytes bytes) followed by the `n` bytes as they were read for
// the copy: equal to XXH3_64bits over that concatenation. The widest kernel the CPU has
// (AVX-512, AVX2, or scalar) is chosen at the first call; values of 192 bytes or fewer are
// copied, then hashed.
uint64_t CopyWithRecordChecksum(void* dst, const void* src, size_t n, const void* prefix);

// The kernels, for tests and benchmarks: each must give what the scalar one gives.
enum class CopyChecksumKernel { kScalar, kAvx2, kAvx512 };
bool CopyChecksumKernelAvailable(CopyChecksumKernel k);
uint64_t CopyWithRecordChecksumOn(CopyChecksumKernel k, void* dst, const void* src, size_t n, const void* prefix);
std::string_view CopyChecksumKernelName(CopyChecksumKernel k);
// The kernel CopyWithRecordChecksum uses here.
CopyChecksumKernel ChosenCopyChecksumKernel();

}  // namespace sparsekv
