// Timing helpers shared by the benchmarks: calibrated, interleaved rounds with medians and
// spread, so every figure comes with the noise it was measured under and a baseline measured
// under the same noise.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sparsekv::bench {

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Keeps the compiler from eliding a computation whose result is otherwise unused.
template <typename T>
inline void DoNotOptimize(const T& value) {
  asm volatile("" : : "r,m"(value) : "memory");
}

// Rates (operations per second) of repeated rounds of one measurement.
struct RateSamples {
  std::vector<double> rates;
  double Median() const;
  double Min() const;
  double Max() const;
  // (max - min) / median: the spread the machine's noise left on this figure.
  double Spread() const;
  nlohmann::json ToJson() const;
};

// One measured method: body(n) performs n operations.
struct Method {
  Method(std::string n, std::function<void(uint64_t)> b) : name(std::move(n)), body(std::move(b)) {}
  std::string name;
  std::function<void(uint64_t)> body;
  uint64_t n = 0;  // operations per round, from calibration
  RateSamples samples;
};

// How many operations make one round of about `round_seconds`.
uint64_t Calibrate(const std::function<void(uint64_t)>& body, double round_seconds);

// Calibrates every method, then runs `rounds` rounds of each, interleaved.
void RunInterleaved(std::vector<Method>& methods, double round_seconds, int rounds);

// Median rate of the method called `name` (0 if absent).
double MedianOf(const std::vector<Method>& methods, const std::string& name);

// {"name": {"median", "min", "max", "rounds"}, ...}
nlohmann::json SamplesJson(const std::vector<Method>& methods);

}  // namespace sparsekv::bench
