// Which kernel table a SIMD path runs.
#include "attention/kernels.h"
#include "sparsekv/cpu_features.h"

namespace sparsekv::attention {

const PathKernels* KernelsFor(SimdPath path) {
  if (!SimdPathSupported(path)) return nullptr;
  switch (path) {
    case SimdPath::kScalar:
      return ScalarKernels();
    case SimdPath::kAvx2:
      return Avx2Kernels();
    case SimdPath::kAvx512:
    case SimdPath::kAvx512Bf16:
      return Avx512Kernels();
    case SimdPath::kNeon:
      return ScalarKernels();  // no NEON attention kernels: the codecs' path only
  }
  return nullptr;
}

}  // namespace sparsekv::attention
