// AVX-512F path: 16 heads per vector, fused multiply-adds. Built with AVX-512 flags; only
// called after CPUID says so (KernelsFor).
#include "attention/kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__)
// GCC 12 inlines its own intrinsic headers and then warns that their internal temporaries
// "are used uninitialized" (GCC bug 105593): a false positive in its headers, not in this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "attention/kernels_impl.h"

namespace sparsekv::attention {
namespace {

struct Avx512Vec {
  using R = __m512;
  static constexpr uint32_t kLanes = 16;
  static R Pin(R x) {
    asm("" : "+v"(x));
    return x;
  }
  static R Zero() { return _mm512_setzero_ps(); }
  static R Set1(float x) { return _mm512_set1_ps(x); }
  static R Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R Fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R Mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R Add(R a, R b) { return _mm512_add_ps(a, b); }
  static R Sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R Max(R a, R b) { return _mm512_max_ps(a, b); }
  static float ReduceAdd(R v) {
    // A fixed tree: halves, then quarters, ... so the order never changes.
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
  }
  static R Exp(R x) {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
    const R xc = _mm512_min_ps(x, _mm512_set1_ps(kExpMax));
    const R n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kExpLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    R r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
    R p = _mm512_set1_ps(kExpC[7]);
    for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[i]));
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    R y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    y = _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), y);
    return _mm512_mask_mov_ps(y, nan, x);
  }
};

const PathKernels kAvx512 = MakeKernels<Avx512Vec>();

}  // namespace

const PathKernels* Avx512Kernels() { return &kAvx512; }

}  // namespace sparsekv::attention
#else
namespace sparsekv::attention {
const PathKernels* Avx512Kernels() { return nullptr; }
}  // namespace sparsekv::attention
#endif
