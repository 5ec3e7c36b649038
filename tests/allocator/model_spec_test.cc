#include "sparsekv/model_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace sparsekv {
namespace {

using ::testing::HasSubstr;

TEST(ModelSpec, V32PresetMatchesDesign) {
  auto spec = ModelPreset("deepseek-v3.2-exp", KvPrecision::kC8);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->layers.size(), 61u);
  for (const LayerSpec& l : spec->layers) {
    ASSERT_EQ(l.kinds.size(), 2u);
    EXPECT_EQ(l.kinds[0].kind, CacheKind::kMlaLatent);
    EXPECT_EQ(l.kinds[0].dims, 576u);
    EXPECT_EQ(l.kinds[0].format, StorageFormat::kC8Mla);
    EXPECT_EQ(l.kinds[1].kind, CacheKind::kIndexerKey);
    EXPECT_EQ(l.kinds[1].dims, 128u);
    EXPECT_EQ(l.kinds[1].ratio, 1u);
    EXPECT_EQ(l.kinds[1].format, StorageFormat::kIdxC8);
  }
  EXPECT_EQ(spec->indexer_topk, 2048u);
}

TEST(ModelSpec, V4FlashPresetHasTheRatioPattern) {
  auto spec = ModelPreset("deepseek-v4-flash", KvPrecision::kFp8);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  ASSERT_EQ(spec->layers.size(), 43u);
  EXPECT_EQ(spec->window_tokens, 128u);
  int csa = 0, hca = 0, swa_only = 0;
  for (size_t i = 0; i < spec->layers.size(); ++i) {
    const auto& kinds = spec->layers[i].kinds;
    EXPECT_EQ(kinds[0].kind, CacheKind::kSwaWindow) << "layer " << i;
    EXPECT_EQ(kinds[0].format, StorageFormat::kFp8V4);
    if (kinds.size() == 1) {
      ++swa_only;
      EXPECT_LT(i, 2u);
      continue;
    }
    if (kinds[1].kind == CacheKind::kCsaCompressed) {
      ++csa;
      EXPECT_EQ(kinds[1].ratio, 4u);
      EXPECT_EQ(kinds[2].kind, CacheKind::kIndexerKey);
      EXPECT_EQ(kinds[2].ratio, 4u);
      EXPECT_EQ(kinds[3].kind, CacheKind::kCompressorState);
      EXPECT_EQ(kinds[3].state_rows, 8u);   // coff 2 x ratio 4
      EXPECT_EQ(kinds[3].dims, 1024u);      // coff 2 x 512
    } else {
      ++hca;
      EXPECT_EQ(kinds[1].kind, CacheKind::kHcaCompressed);
      EXPECT_EQ(kinds[1].ratio, 128u);
      EXPECT_EQ(kinds[2].state_rows, 128u);
      EXPECT_EQ(kinds[2].dims, 512u);
    }
  }
  EXPECT_EQ(swa_only, 2);
  EXPECT_EQ(csa, 21);
  EXPECT_EQ(hca, 20);
}

TEST(ModelSpec, PresetErrorsAreClear) {
  auto unknown = ModelPreset("llama");
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("deepseek-v3.2-exp"));
  auto c8 = ModelPreset("deepseek-v4-flash", KvPrecision::kC8);
  ASSERT_FALSE(c8.ok());
  EXPECT_EQ(c8.status().code(), StatusCode::kNotSupported);
}

TEST(ModelSpec, JsonRoundTripOfPresets) {
  for (const std::string& name : ModelPresetNames()) {
    for (KvPrecision p : {KvPrecision::kBf16, KvPrecision::kFp8}) {
      auto spec = ModelPreset(name, p);
      ASSERT_TRUE(spec.ok());
      const std::string text = ModelSpecToJson(*spec);
      auto back = ParseModelSpecJson(text);
      ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << text;
      EXPECT_EQ(*back, *spec) << name;
    }
  }
}

struct BadSpec {
  const char* json;
  const char* expect;  // substring of the error
};

class ModelSpecJsonErrors : public ::testing::TestWithParam<BadSpec> {};

TEST_P(ModelSpecJsonErrors, NamesTheFault) {
  auto r = ParseModelSpecJson(GetParam().json);
  ASSERT_FALSE(r.ok()) << GetParam().json;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(GetParam().expect));
}

INSTANTIATE_TEST_SUITE_P(
    All, ModelSpecJsonErrors,
    ::testing::Values(
        BadSpec{"{", "not valid JSON"},
        BadSpec{"[]", "top level must be a JSON object"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"kv","format":"bf16","dims":8}]}]})",
                "unknown cache kind 'kv'"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"mla_latent","format":"bf16","dims":0}]}]})",
                "dims is 0"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"indexer_key","format":"bf16","dims":128,"ratio":3}]}]})",
                "ratio 3 is not a power of two"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"mla_latent","format":"c8_mla","dims":512}]}]})",
                "c8_mla stores mla_latent entries of 576 dims"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"mla_latent","format":"zip","dims":576}]}]})",
                "unknown storage format 'zip'"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"swa_window","format":"bf16","dims":512}]}]})",
                "window_tokens is 0"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"mla_latent","format":"bf16","dims":576},{"kind":"mla_latent","format":"bf16","dims":576}]}]})",
                "twice"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"mla_latent","format":"bf16","dims":-4}]}]})",
                "spec.layers[0].kinds[0].dims"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"compressor_state","format":"fp32","dims":512,"ratio":4}]}]})",
                "state_rows is 0"},
        BadSpec{R"({"name":"m","layers":[], "colour": 1})", "unknown field 'colour'"},
        BadSpec{R"({"name":"m","layers":[]})", "no layers"},
        BadSpec{R"({"name":"m","layers":[{"kinds":[{"kind":"hca_compressed","format":"bf16","dims":512,"ratio":1}]}]})",
                "compressed kind needs ratio 2 or more"}));

TEST(ModelSpec, JsonRepeatExpandsLayers) {
  auto r = ParseModelSpecJson(
      R"({"name":"tiny","layers":[{"repeat":3,"kinds":[{"kind":"mla_latent","format":"fp8_ds_mla","dims":576}]}]})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layers.size(), 3u);
}

}  // namespace
}  // namespace sparsekv
