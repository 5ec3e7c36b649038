// The AVX-512 path with AVX512-BF16: fp32 -> bf16 rounding by VCVTNE2PS2BF16 (32 values an
// instruction) wherever no lane is a denormal. Built with -mavx512bf16 on top of the AVX-512
// flags; chosen at run time on Cooper Lake, Sapphire Rapids, Zen 4 and later.
#if defined(__x86_64__)
#define SPARSEKV_AVX512_HW_BF16 1
#include "compress/kernels_avx512_impl.h"

namespace sparsekv::compress {
namespace {
constexpr PathKernels kAvx512Bf16Kernels = MakePathKernels<Avx512Prims>(SimdPath::kAvx512Bf16);
}  // namespace
const PathKernels* Avx512Bf16PathKernels() {
  return &kAvx512Bf16Kernels;
}
}  // namespace sparsekv::compress

#else
#include "compress/kernels.h"
namespace sparsekv::compress {
const PathKernels* Avx512Bf16PathKernels() {
  return nullptr;
}
}  // namespace sparsekv::compress
#endif
