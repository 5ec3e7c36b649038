// Exact top-k: against a full sort on random data with many ties, NaN, infinities and signed
// zeros.
#include "attention/top_k.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace sparsekv::attention {
namespace {

std::vector<uint32_t> SortTopK(const std::vector<float>& v, uint32_t k) {
  std::vector<uint32_t> order(v.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return OrderKey(v[a]) > OrderKey(v[b]); });
  order.resize(std::min<size_t>(k, v.size()));
  std::sort(order.begin(), order.end());
  return order;
}

TEST(TopK, OrderKeyIsMonotonic) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> ascending = {-inf, -3e38f, -1.0f, -1e-45f, -0.0f, 0.0f, 1e-45f,
                                        1.0f, 3e38f,  inf};
  for (size_t i = 1; i < ascending.size(); ++i) {
    EXPECT_LT(OrderKey(ascending[i - 1]), OrderKey(ascending[i])) << i;
  }
  EXPECT_EQ(OrderKey(std::nanf("")), 0u);
  EXPECT_EQ(OrderKey(-std::nanf("")), 0u);
  EXPECT_LT(OrderKey(std::nanf("")), OrderKey(-inf));
}

TEST(TopK, MatchesFullSort) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const uint32_t n = 1 + rng() % 5000;
    const uint32_t k = 1 + rng() % 600;
    std::vector<float> v(n);
    const int kind = trial % 4;
    for (auto& x : v) {
      if (kind == 0) x = std::normal_distribution<float>(0, 1)(rng);
      if (kind == 1) x = float(rng() % 7) - 3;  // heavy ties
      if (kind == 2) x = (rng() % 10 == 0) ? std::nanf("") : float(rng() % 50);
      if (kind == 3) {
        const float specials[] = {std::numeric_limits<float>::infinity(),
                                  -std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 1e-40f,
                                  -1e-40f, 1.0f};
        x = specials[rng() % 7];
      }
    }
    std::vector<uint32_t> out(k, 12345);
    const uint32_t count = SelectTopK(v.data(), n, k, out.data());
    ASSERT_EQ(count, std::min(n, k));
    out.resize(count);
    ASSERT_EQ(out, SortTopK(v, k)) << "trial " << trial << " n " << n << " k " << k;
  }
}

TEST(TopK, ZeroK) {
  float v[3] = {1, 2, 3};
  uint32_t out[1];
  EXPECT_EQ(SelectTopK(v, 3, 0, out), 0u);
}

}  // namespace
}  // namespace sparsekv::attention
