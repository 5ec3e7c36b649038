#include "sparsekv/status.h"

#include <gtest/gtest.h>

namespace sparsekv {
namespace {

Result<int> Half(int v) {
  if (v % 2) return Status::InvalidArgument("odd value " + std::to_string(v));
  return v / 2;
}

Status QuarterInto(int v, int& out) {
  SPARSEKV_ASSIGN_OR_RETURN(int h, Half(v));
  SPARSEKV_ASSIGN_OR_RETURN(out, Half(h));
  return Status::OK();
}

TEST(Status, OkOwnsNothingAndPrintsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_FALSE(s.retryable());
  EXPECT_FALSE(s.data_loss());
}

TEST(Status, CarriesCodeMessageAndFlags) {
  Status s = Status::Corruption("bundle 7 checksum mismatch");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.data_loss());
  EXPECT_FALSE(s.retryable());
  EXPECT_EQ(s.ToString(), "Corruption: bundle 7 checksum mismatch");
  Status r = Status::ResourceExhausted("tier full");
  EXPECT_TRUE(r.retryable());
  Status copy = s;
  EXPECT_EQ(copy.ToString(), s.ToString());
  Status ctx = s.WithContext("ssd tier");
  EXPECT_EQ(ctx.message(), "ssd tier: bundle 7 checksum mismatch");
  EXPECT_TRUE(ctx.data_loss());
}

TEST(Result, PropagatesThroughMacros) {
  int out = -1;
  EXPECT_TRUE(QuarterInto(12, out).ok());
  EXPECT_EQ(out, 3);
  Status st = QuarterInto(6, out);  // 6 -> 3 -> odd
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "odd value 3");
}

TEST(Result, OkStatusIsNotAValue) {
  Result<int> r{Status::OK()};
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace sparsekv
