#include "bench_util.h"

#include <algorithm>

namespace sparsekv::bench {

double RateSamples::Median() const {
  if (rates.empty()) return 0;
  std::vector<double> v = rates;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}
double RateSamples::Min() const { return rates.empty() ? 0 : *std::min_element(rates.begin(), rates.end()); }
double RateSamples::Max() const { return rates.empty() ? 0 : *std::max_element(rates.begin(), rates.end()); }
double RateSamples::Spread() const {
  const double m = Median();
  return m > 0 ? (Max() - Min()) / m : 0;
}

nlohmann::json RateSamples::ToJson() const {
  return {{"median", Median()}, {"min", Min()}, {"max", Max()}, {"rounds", rates.size()}};
}

uint64_t Calibrate(const std::function<void(uint64_t)>& body, double round_seconds) {
  uint64_t n = 16;
  for (;;) {
    const double t0 = NowSeconds();
    body(n);
    const double dt = NowSeconds() - t0;
    if (dt >= round_seconds / 4 || n >= (1ull << 40)) {
      return std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<double>(n) * round_seconds / std::max(dt, 1e-9)));
    }
    n *= 4;
  }
}

void RunInterleaved(std::vector<Method>& methods, double round_seconds, int rounds) {
  for (Method& m : methods) m.n = Calibrate(m.body, round_seconds);
  for (int r = 0; r < rounds; ++r) {
    for (Method& m : methods) {
      const double t0 = NowSeconds();
      m.body(m.n);
      m.samples.rates.push_back(static_cast<double>(m.n) / std::max(NowSeconds() - t0, 1e-12));
    }
  }
}

double MedianOf(const std::vector<Method>& methods, const std::string& name) {
  for (const Method& m : methods) {
    if (m.name == name) return m.samples.Median();
  }
  return 0;
}

nlohmann::json SamplesJson(const std::vector<Method>& methods) {
  nlohmann::json j = nlohmann::json::object();
  for (const Method& m : methods) j[m.name] = m.samples.ToJson();
  return j;
}

}  // namespace sparsekv::bench
