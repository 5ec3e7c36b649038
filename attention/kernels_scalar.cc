// The portable path: one float per "vector". Same loops as the SIMD paths; built with
// -ffp-contract=off, so a*b+c is two roundings here and one there.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention/kernels_impl.h"

namespace sparsekv::attention {
namespace {

struct ScalarVec {
  using R = float;
  static constexpr uint32_t kLanes = 1;
  static R Pin(R x) { return x; }
  static R Zero() { return 0.0f; }
  static R Set1(float x) { return x; }
  static R Load(const float* p) { return *p; }
  static void Store(float* p, R v) { *p = v; }
  static R Fma(R a, R b, R c) { return a * b + c; }
  static R Mul(R a, R b) { return a * b; }
  static R Add(R a, R b) { return a + b; }
  static R Sub(R a, R b) { return a - b; }
  // As the x86 max instructions: b when either is NaN.
  static R Max(R a, R b) { return a > b ? a : b; }
  static float ReduceAdd(R v) { return v; }
  static R Exp(R x) {
    if (std::isnan(x)) return x;
    if (x < kExpMin) return 0.0f;
    x = std::fmin(x, kExpMax);
    const float n = std::nearbyint(x * kExpLog2e);
    const float r = (x - n * kExpLn2Hi) - n * kExpLn2Lo;
    float p = kExpC[7];
    for (int i = 6; i >= 0; --i) p = p * r + kExpC[i];
    const int32_t e = static_cast<int32_t>(n);
    uint32_t bits;
    std::memcpy(&bits, &p, 4);
    bits += static_cast<uint32_t>(e) << 23;
    std::memcpy(&p, &bits, 4);
    return p;
  }
};

const PathKernels kScalar = MakeKernels<ScalarVec>();

}  // namespace

const PathKernels* ScalarKernels() { return &kScalar; }

}  // namespace sparsekv::attention
