// SIMD path names, support and selection.
#include "sparsekv/cpu_features.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace sparsekv {
namespace {

TEST(SimdPath, NamesRoundTrip) {
  for (int i = 0; i < kNumSimdPaths; ++i) {
    const auto p = static_cast<SimdPath>(i);
    auto parsed = ParseSimdPath(SimdPathName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  auto bad = ParseSimdPath("avx9");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("avx9"), std::string_view::npos);
  EXPECT_NE(bad.status().message().find("avx512_bf16"), std::string_view::npos);
}

TEST(SimdPath, SupportIsConsistentWithFeatures) {
  const CpuFeatures& f = DetectCpuFeatures();
  EXPECT_TRUE(SimdPathSupported(SimdPath::kScalar));
  auto paths = SupportedSimdPaths();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.front(), SimdPath::kScalar);
  EXPECT_EQ(paths.back(), BestSimdPath());
  for (size_t i = 1; i < paths.size(); ++i) EXPECT_LT(paths[i - 1], paths[i]);
  if (SimdPathSupported(SimdPath::kAvx512Bf16)) {
    EXPECT_TRUE(f.avx512bf16);
    EXPECT_TRUE(SimdPathSupported(SimdPath::kAvx512));
  }
  if (SimdPathSupported(SimdPath::kAvx512)) {
    EXPECT_TRUE(f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq);
    EXPECT_TRUE(SimdPathSupported(SimdPath::kAvx2));
  }
  if (SimdPathSupported(SimdPath::kAvx2)) {
    EXPECT_TRUE(f.avx2 && f.f16c);
  }
  std::string names;
  for (SimdPath p : paths) names += std::string(SimdPathName(p)) + " ";
  RecordProperty("supported_paths", names);
}

// NEON is part of every AArch64 CPU, so there it is supported and the best path (the codec tests
// then hold it to scalar: tests/neon/run.sh runs them under qemu-aarch64); elsewhere it is not.
TEST(SimdPath, NeonIsTheBestPathExactlyOnAarch64) {
#if defined(__aarch64__)
  EXPECT_TRUE(SimdPathSupported(SimdPath::kNeon));
  EXPECT_EQ(BestSimdPath(), SimdPath::kNeon);
#else
  EXPECT_FALSE(SimdPathSupported(SimdPath::kNeon));
  EXPECT_NE(BestSimdPath(), SimdPath::kNeon);
#endif
}

TEST(SimdPath, SetActiveAcceptsSupportedAndRefusesOthers) {
  const SimdPath before = ActiveSimdPath();
  for (int i = 0; i < kNumSimdPaths; ++i) {
    const auto p = static_cast<SimdPath>(i);
    Status s = SetActiveSimdPath(p);
    if (SimdPathSupported(p)) {
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(ActiveSimdPath(), p);
    } else {
      EXPECT_EQ(s.code(), StatusCode::kNotSupported);
      EXPECT_NE(s.message().find(SimdPathName(p)), std::string_view::npos);
    }
  }
  ASSERT_TRUE(SetActiveSimdPath(before).ok());
}

TEST(SimdPath, EnvironmentVariable) {
  const char* saved = std::getenv("SPARSEKV_SIMD");
  const std::string saved_value = saved ? saved : "";
  unsetenv("SPARSEKV_SIMD");
  EXPECT_EQ(SimdPathFromEnvironment().status().code(), StatusCode::kNotFound);
  setenv("SPARSEKV_SIMD", "scalar", 1);
  auto p = SimdPathFromEnvironment();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, SimdPath::kScalar);
  setenv("SPARSEKV_SIMD", "sse9", 1);
  auto bad = SimdPathFromEnvironment();
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("SPARSEKV_SIMD"), std::string_view::npos);
  for (int i = 0; i < kNumSimdPaths; ++i) {
    const auto path = static_cast<SimdPath>(i);
    setenv("SPARSEKV_SIMD", std::string(SimdPathName(path)).c_str(), 1);
    EXPECT_EQ(SimdPathFromEnvironment().ok(), SimdPathSupported(path));
  }
  if (saved) {
    setenv("SPARSEKV_SIMD", saved_value.c_str(), 1);
  } else {
    unsetenv("SPARSEKV_SIMD");
  }
}

}  // namespace
}  // namespace sparsekv
