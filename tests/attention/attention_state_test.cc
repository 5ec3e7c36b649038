// Merging partial attention results and adding a sink, against computing over the union.
#include "sparsekv/attention_state.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace sparsekv {
namespace {

// Softmax attention over scalar scores with vector values, in double.
void Attend(const std::vector<double>& s, const std::vector<std::vector<double>>& v, float* out,
            float* lse, uint32_t dims) {
  if (s.empty()) {
    for (uint32_t d = 0; d < dims; ++d) out[d] = 0;
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  double m = *std::max_element(s.begin(), s.end()), sum = 0;
  std::vector<double> acc(dims, 0);
  for (size_t j = 0; j < s.size(); ++j) {
    const double p = std::exp(s[j] - m);
    sum += p;
    for (uint32_t d = 0; d < dims; ++d) acc[d] += p * v[j][d];
  }
  for (uint32_t d = 0; d < dims; ++d) out[d] = float(acc[d] / sum);
  *lse = float(m + std::log(sum));
}

TEST(AttentionState, MergeEqualsUnion) {
  std::mt19937 rng(3);
  std::normal_distribution<double> n(0, 3);
  constexpr uint32_t kDims = 8;
  for (int trial = 0; trial < 100; ++trial) {
    const size_t na = rng() % 5, nb = rng() % 5;
    std::vector<double> sa(na), sb(nb);
    std::vector<std::vector<double>> va(na, std::vector<double>(kDims)), vb(nb, va.empty() ? std::vector<double>(kDims) : va[0]);
    for (auto& x : sa) x = n(rng);
    for (auto& x : sb) x = n(rng);
    for (auto& r : va) for (auto& x : r) x = n(rng);
    vb.assign(nb, std::vector<double>(kDims));
    for (auto& r : vb) for (auto& x : r) x = n(rng);
    float oa[kDims], ob[kDims], ou[kDims], la, lb, lu;
    Attend(sa, va, oa, &la, kDims);
    Attend(sb, vb, ob, &lb, kDims);
    std::vector<double> su = sa;
    su.insert(su.end(), sb.begin(), sb.end());
    auto vu = va;
    vu.insert(vu.end(), vb.begin(), vb.end());
    Attend(su, vu, ou, &lu, kDims);
    MergeAttentionStates(oa, &la, ob, &lb, 1, kDims);
    if (std::isinf(lu)) {
      EXPECT_EQ(la, lu);
    } else {
      EXPECT_NEAR(la, lu, 1e-5 * std::fabs(lu) + 1e-6);
    }
    for (uint32_t d = 0; d < kDims; ++d) EXPECT_NEAR(oa[d], ou[d], 1e-5) << trial;
  }
}

TEST(AttentionState, SinkJoinsTheDenominator) {
  float out[2] = {2.0f, -4.0f};
  float lse = 0.0f;  // one unit of mass
  const float sink = 0.0f;  // another unit, with no value
  ApplyAttentionSink(out, &lse, &sink, 1, 1, 2);
  EXPECT_FLOAT_EQ(out[0], 1.0f);
  EXPECT_FLOAT_EQ(out[1], -2.0f);
  EXPECT_FLOAT_EQ(lse, std::log(2.0f));
  float empty[2] = {0, 0};
  float empty_lse = -std::numeric_limits<float>::infinity();
  ApplyAttentionSink(empty, &empty_lse, &sink, 1, 1, 2);
  EXPECT_EQ(empty_lse, 0.0f);
  EXPECT_EQ(empty[0], 0.0f);
}

TEST(AttentionState, NaNStaysInItsRow) {
  float oa[4] = {1, 1, 2, 2}, la[2] = {0, std::nanf("")};
  float ob[4] = {3, 3, 4, 4}, lb[2] = {0, 0};
  MergeAttentionStates(oa, la, ob, lb, 2, 2);
  EXPECT_FLOAT_EQ(oa[0], 2.0f);
  EXPECT_TRUE(std::isnan(la[1]));
  EXPECT_TRUE(std::isnan(oa[2]));
  EXPECT_FALSE(std::isnan(la[0]));
}

}  // namespace
}  // namespace sparsekv
