// The AVX-512 path (F/BW/VL/DQ + F16C), software bf16 rounding. Built with those flags only;
// chosen at run time when the CPU has them and lacks AVX512-BF16 (Skylake-SP, Ice Lake).
#if defined(__x86_64__)
#define SPARSEKV_AVX512_HW_BF16 0
#include "compress/kernels_avx512_impl.h"

namespace sparsekv::compress {
namespace {
constexpr PathKernels kAvx512Kernels = MakePathKernels<Avx512Prims>(SimdPath::kAvx512);
}  // namespace
const PathKernels* Avx512PathKernels() {
  return &kAvx512Kernels;
}
}  // namespace sparsekv::compress

#else
#include "compress/kernels.h"
namespace sparsekv::compress {
const PathKernels* Avx512PathKernels() {
  return nullptr;
}
}  // namespace sparsekv::compress
#endif
