// The portable scalar path: the reference every SIMD path is held to, and the fallback on any
// CPU. It is scalar_math.h's tile codecs placed by format_drivers.h's layouts.
#include "compress/format_drivers.h"
#include "compress/kernels.h"
#include "compress/scalar_math.h"

namespace sparsekv::compress {
namespace {

struct ScalarPrims {
  template <bool kBf16In>
  static void PlanInt8(const uint8_t* src, size_t stride, uint32_t n, uint32_t count, TilePlan* plans) {
    for (uint32_t i = 0; i < count; ++i) plans[i] = PlanInt8Ref<kBf16In>(src + i * stride, n);
  }
  template <bool kBf16In>
  static void PlanE4m3(const uint8_t* src, size_t stride, uint32_t n, uint32_t count,
                       ScaleRule rule, TilePlan* plans) {
    for (uint32_t i = 0; i < count; ++i) plans[i] = PlanE4m3Ref<kBf16In>(src + i * stride, n, rule);
  }
  template <bool kBf16In>
  static void ApplyInt8(const uint8_t* src, uint32_t n, const TilePlan& plan, uint8_t* dst) {
    ApplyInt8Ref<kBf16In>(src, n, plan, dst);
  }
  template <bool kBf16In>
  static void ApplyE4m3(const uint8_t* src, uint32_t n, const TilePlan& plan, uint8_t* dst) {
    ApplyE4m3Ref<kBf16In>(src, n, plan, dst);
  }
  template <bool kBf16In>
  static void ToBf16(const uint8_t* src, uint32_t n, uint8_t* dst) {
    if constexpr (kBf16In) {
      __builtin_memcpy(dst, src, 2 * size_t{n});
    } else {
      NarrowToBf16Ref(src, n, dst);
    }
  }
  template <bool kBf16In>
  static void ToFp32(const uint8_t* src, uint32_t n, uint8_t* dst) {
    if constexpr (kBf16In) {
      WidenBf16Ref(src, n, dst);
    } else {
      __builtin_memcpy(dst, src, 4 * size_t{n});
    }
  }
  template <bool kBf16Out>
  static void DecodeInt8(const uint8_t* q, float scale, uint32_t n, uint8_t* dst) {
    DecodeInt8Ref<kBf16Out>(q, scale, n, dst);
  }
  template <bool kBf16Out>
  static void DecodeE4m3(const uint8_t* codes, float scale, uint32_t n, uint8_t* dst) {
    DecodeE4m3Ref<kBf16Out>(codes, scale, n, dst);
  }
};

constexpr PathKernels kScalarKernels = MakePathKernels<ScalarPrims>(SimdPath::kScalar);

}  // namespace

const PathKernels* ScalarPathKernels() {
  return &kScalarKernels;
}

}  // namespace sparsekv::compress
