// SIMD paths: which ones this CPU can run, and which one the codecs use.
//
// Every codec has a portable scalar path and SIMD paths built into the same binary; the path is
// chosen at run time from the CPU's features, so the library runs on any x86-64 CPU, and on
// AArch64 with the NEON path (every AArch64 CPU has NEON; others get the scalar path only). All
// paths produce bit-identical bytes and values.
//
// The active path is the best one the CPU supports, unless the environment variable
// SPARSEKV_SIMD (scalar, avx2, avx512, avx512_bf16 or neon) named another supported path when it
// was first read, or SetActiveSimdPath chose one since. Thread safety: every function here is
// thread-safe; a PageCodec keeps the path it was created with.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv {

enum class SimdPath : uint8_t {
  kScalar = 0,  // portable C++, the reference
  kAvx2,        // AVX2 + F16C (Haswell, Zen 1 and later)
  kAvx512,      // AVX-512 F/BW/VL/DQ + F16C (Skylake-SP, Ice Lake)
  kAvx512Bf16,  // kAvx512 + AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4)
  kNeon,        // AArch64 Advanced SIMD (every AArch64 CPU): the codecs; attention runs scalar
};
inline constexpr int kNumSimdPaths = 5;

std::string_view SimdPathName(SimdPath path);
// "scalar", "avx2", "avx512", "avx512_bf16" or "neon".
Result<SimdPath> ParseSimdPath(std::string_view name);

// The instruction-set extensions that matter to sparsekv, as CPUID and the OS report them.
struct CpuFeatures {
  bool avx2 = false;
  bool f16c = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512bf16 = false;
  bool avx512vnni = false;  // not used by the codecs (no dot products); reported for kernels
  bool avx512fp16 = false;  // likewise
};
// Detected once, then cached.
const CpuFeatures& DetectCpuFeatures();

bool SimdPathSupported(SimdPath path);
// Supported paths, scalar first.
std::vector<SimdPath> SupportedSimdPaths();
SimdPath BestSimdPath();

// The path new codecs use. On first call reads SPARSEKV_SIMD; a value that is unknown or not
// supported here is ignored with one line on stderr saying so.
SimdPath ActiveSimdPath();
// Makes `path` the active one. NotSupported if this CPU cannot run it.
Status SetActiveSimdPath(SimdPath path);
// SPARSEKV_SIMD parsed and checked: the named path, NotFound when unset, InvalidArgument for an
// unknown name, NotSupported for a path this CPU lacks. For tools that want to fail loudly.
Result<SimdPath> SimdPathFromEnvironment();

}  // namespace sparsekv
