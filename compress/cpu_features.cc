#include "sparsekv/cpu_features.h"

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace sparsekv {
namespace {

constexpr std::array<std::string_view, kNumSimdPaths> kPathNames = {"scalar", "avx2", "avx512",
                                                                    "avx512_bf16", "neon"};

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's detection also checks (XGETBV) that the OS saves the YMM and ZMM registers.
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.f16c = __builtin_cpu_supports("f16c");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
  f.avx512fp16 = __builtin_cpu_supports("avx512fp16");
#endif
  return f;
}

std::string SupportedNames() {
  std::string out;
  for (SimdPath p : SupportedSimdPaths()) {
    if (!out.empty()) out += ", ";
    out += SimdPathName(p);
  }
  return out;
}

std::atomic<SimdPath> g_active{SimdPath::kScalar};
std::once_flag g_active_once;

void InitActive() {
  SimdPath path = BestSimdPath();
  if (const char* env = std::getenv("SPARSEKV_SIMD"); env != nullptr && *env != '\0') {
    Result<SimdPath> r = SimdPathFromEnvironment();
    if (r.ok()) {
      path = *r;
    } else {
      std::fprintf(stderr, "sparsekv: %s; using %s\n", std::string(r.status().message()).c_str(),
                   std::string(SimdPathName(path)).c_str());
    }
  }
  g_active.store(path, std::memory_order_relaxed);
}

}  // namespace

std::string_view SimdPathName(SimdPath path) {
  return kPathNames[static_cast<size_t>(path)];
}

Result<SimdPath> ParseSimdPath(std::string_view name) {
  for (size_t i = 0; i < kPathNames.size(); ++i) {
    if (kPathNames[i] == name) return static_cast<SimdPath>(i);
  }
  return Status::InvalidArgument(
      fmt::format("unknown SIMD path '{}'; expected scalar, avx2, avx512, avx512_bf16 or neon", name));
}

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

bool SimdPathSupported(SimdPath path) {
  const CpuFeatures& f = DetectCpuFeatures();
#if defined(__x86_64__)
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.f16c;
  switch (path) {
    case SimdPath::kScalar:
      return true;
    case SimdPath::kAvx2:
      return f.avx2 && f.f16c && f.fma;
    case SimdPath::kAvx512:
      return avx512;
    case SimdPath::kAvx512Bf16:
      return avx512 && f.avx512bf16;
    case SimdPath::kNeon:
      return false;
  }
  return false;
#elif defined(__aarch64__)
  (void)f;
  return path == SimdPath::kScalar || path == SimdPath::kNeon;  // NEON is part of AArch64
#else
  (void)f;
  return path == SimdPath::kScalar;  // the SIMD paths are x86-64 and AArch64 code
#endif
}

std::vector<SimdPath> SupportedSimdPaths() {
  std::vector<SimdPath> out;
  for (int i = 0; i < kNumSimdPaths; ++i) {
    if (SimdPathSupported(static_cast<SimdPath>(i))) out.push_back(static_cast<SimdPath>(i));
  }
  return out;
}

SimdPath BestSimdPath() {
  return SupportedSimdPaths().back();
}

SimdPath ActiveSimdPath() {
  std::call_once(g_active_once, InitActive);
  return g_active.load(std::memory_order_relaxed);
}

Status SetActiveSimdPath(SimdPath path) {
  std::call_once(g_active_once, InitActive);
  if (!SimdPathSupported(path)) {
    return Status::NotSupported(
        fmt::format("SIMD path {} is not supported by this CPU (supported: {})", SimdPathName(path),
                    SupportedNames()));
  }
  g_active.store(path, std::memory_order_relaxed);
  return Status::OK();
}

Result<SimdPath> SimdPathFromEnvironment() {
  const char* env = std::getenv("SPARSEKV_SIMD");
  if (env == nullptr || *env == '\0') return Status::NotFound("SPARSEKV_SIMD is not set");
  Result<SimdPath> path = ParseSimdPath(env);
  if (!path.ok()) return path.status().WithContext("SPARSEKV_SIMD");
  if (!SimdPathSupported(*path)) {
    return Status::NotSupported(fmt::format(
        "SPARSEKV_SIMD={} is not supported by this CPU (supported: {})", env, SupportedNames()));
  }
  return path;
}

}  // namespace sparsekv
