#include "attention/top_k.h"

#include <cstring>

namespace sparsekv::attention {

uint32_t OrderKey(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0;  // NaN
  // Negative floats order backwards: flip all bits. Positive: set the sign bit. -0 and +0 are
  // then adjacent but distinct (-0 below), which only matters for ties between them.
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

uint32_t SelectTopK(const float* values, uint32_t n, uint32_t k, uint32_t* out) {
  if (k == 0) return 0;
  if (n <= k) {
    for (uint32_t i = 0; i < n; ++i) out[i] = i;
    return n;
  }
  // Narrow the threshold key down 11 + 11 + 10 bits at a time. `prefix`/`mask` are the bits
  // fixed so far; `above` counts keys strictly greater than every key with that prefix.
  static constexpr int kShifts[3] = {21, 10, 0};
  static constexpr uint32_t kBins[3] = {2048, 2048, 1024};
  uint32_t hist[2048];
  uint32_t prefix = 0, mask = 0, above = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = kShifts[pass];
    const uint32_t bins = kBins[pass];
    std::memset(hist, 0, sizeof(uint32_t) * bins);
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t key = OrderKey(values[i]);
      if ((key & mask) == prefix) ++hist[(key >> shift) & (bins - 1)];
    }
    // Walk bins from the top until the k-th largest falls in one.
    uint32_t bin = bins;
    while (bin > 0) {
      --bin;
      if (above + hist[bin] >= k) break;
      above += hist[bin];
    }
    prefix |= bin << shift;
    mask |= (bins - 1) << shift;
  }
  const uint32_t threshold = prefix;  // the k-th largest key, exactly
  uint32_t equal_wanted = k - above;
  uint32_t count = 0;
  for (uint32_t i = 0; i < n && count < k; ++i) {
    const uint32_t key = OrderKey(values[i]);
    if (key > threshold) {
      out[count++] = i;
    } else if (key == threshold && equal_wanted > 0) {
      out[count++] = i;
      --equal_wanted;
    }
  }
  return count;
}

}  // namespace sparsekv::attention
