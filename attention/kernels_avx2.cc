// AVX2 + FMA path: 8 heads per vector. Built with AVX2/FMA flags; only called after CPUID says
// so (KernelsFor).
#include "attention/kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
// GCC 12 inlines its own intrinsic headers and then warns that their internal temporaries
// "are used uninitialized" (GCC bug 105593): a false positive in its headers, not in this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "attention/kernels_impl.h"

namespace sparsekv::attention {
namespace {

struct Avx2Vec {
  using R = __m256;
  static constexpr uint32_t kLanes = 8;
  static R Pin(R x) {
    asm("" : "+x"(x));
    return x;
  }
  static R Zero() { return _mm256_setzero_ps(); }
  static R Set1(float x) { return _mm256_set1_ps(x); }
  static R Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R Fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R Mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R Add(R a, R b) { return _mm256_add_ps(a, b); }
  static R Sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R Max(R a, R b) { return _mm256_max_ps(a, b); }
  static float ReduceAdd(R v) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
  }
  static R Exp(R x) {
    const R nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const R tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);
    const R xc = _mm256_min_ps(x, _mm256_set1_ps(kExpMax));
    const R n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kExpLog2e)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    R r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), r);
    R p = _mm256_set1_ps(kExpC[7]);
    for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    R y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    y = _mm256_andnot_ps(tiny, y);
    return _mm256_blendv_ps(y, x, nan);
  }
};

const PathKernels kAvx2 = MakeKernels<Avx2Vec>();

}  // namespace

const PathKernels* Avx2Kernels() { return &kAvx2; }

}  // namespace sparsekv::attention
#else
namespace sparsekv::attention {
const PathKernels* Avx2Kernels() { return nullptr; }
}  // namespace sparsekv::attention
#endif
