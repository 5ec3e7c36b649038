#include "sparsekv/attention_state.h"

#include <cmath>
#include <limits>

namespace sparsekv {

void MergeAttentionStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                          uint64_t rows, uint32_t dims) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (uint64_t r = 0; r < rows; ++r) {
    const float a = lse_a[r], b = lse_b[r];
    float* oa = out_a + r * dims;
    const float* ob = out_b + r * dims;
    if (b == kNegInf && !std::isnan(a)) continue;  // b is empty: a stands
    if (a == kNegInf && !std::isnan(b)) {          // a is empty: take b
      for (uint32_t d = 0; d < dims; ++d) oa[d] = ob[d];
      lse_a[r] = b;
      continue;
    }
    const float m = std::fmax(a, b);
    const float wa = std::exp(a - m), wb = std::exp(b - m);
    const float sum = wa + wb;
    const float lse = std::isnan(a) || std::isnan(b) ? std::nanf("") : m + std::log(sum);
    const float fa = wa / sum, fb = wb / sum;
    for (uint32_t d = 0; d < dims; ++d) oa[d] = std::isnan(lse) ? lse : oa[d] * fa + ob[d] * fb;
    lse_a[r] = lse;
  }
}

void ApplyAttentionSink(float* out, float* lse, const float* sink, uint32_t sink_count,
                        uint64_t rows, uint32_t dims) {
  for (uint64_t r = 0; r < rows; ++r) {
    const float s = sink[r % sink_count];
    const float l = lse[r];
    float* o = out + r * dims;
    if (l == -std::numeric_limits<float>::infinity()) {
      lse[r] = s;  // nothing attended: the output stays zero
      continue;
    }
    const float m = std::fmax(l, s);
    const float total = std::exp(l - m) + std::exp(s - m);
    const float factor = std::exp(l - m) / total;
    for (uint32_t d = 0; d < dims; ++d) o[d] *= factor;
    lse[r] = m + std::log(total);
  }
}

}  // namespace sparsekv
