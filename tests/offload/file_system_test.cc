#include "sparsekv/file_system.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <vector>

#include "sparsekv/fault_injection_file_system.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

std::vector<std::byte> Pattern(size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::byte((i * 31 + seed) & 0xff);
  return v;
}

TEST(PosixFileSystem, WriteReadSyncAllocateList) {
  testing::TempDir dir("fs");
  FileSystem* fs = FileSystem::Default();
  ASSERT_TRUE(fs->CreateDirs(dir.Sub("a/b")).ok());
  FileOpenOptions o;
  o.create = true;
  auto f = fs->OpenRandomRW(dir.Sub("a/b/f"), o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto data = Pattern(10000, 1);
  ASSERT_TRUE((*f)->Write(100, data).ok());
  ASSERT_TRUE((*f)->Sync().ok());
  std::vector<std::byte> back(10000);
  auto n = (*f)->Read(100, back);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 10000u);
  EXPECT_EQ(back, data);
  ASSERT_TRUE((*f)->Allocate(0, 1 << 20).ok());
  EXPECT_EQ(*(*f)->Size(), 1u << 20);
  auto past = (*f)->Read((1 << 20) - 10, back);
  EXPECT_EQ(*past, 10u);  // short only at the end of the file
  auto names = fs->ListDir(dir.Sub("a/b"));
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"f"});
  EXPECT_TRUE(*fs->FileExists(dir.Sub("a/b/f")));
  EXPECT_TRUE(fs->SyncDir(dir.Sub("a/b")).ok());
  ASSERT_TRUE(fs->DeleteFile(dir.Sub("a/b/f")).ok());
  EXPECT_FALSE(*fs->FileExists(dir.Sub("a/b/f")));
  auto missing = fs->OpenRandomRW(dir.Sub("nope"), FileOpenOptions{});
  EXPECT_TRUE(missing.status().Is(StatusCode::kNotFound)) << missing.status().ToString();
  EXPECT_NE(missing.status().ToString().find("nope"), std::string::npos);
}

class FaultFsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FileOpenOptions o;
    o.create = true;
    auto f = fault_.OpenRandomRW(dir_.Sub("f"), o);
    ASSERT_TRUE(f.ok());
    file_ = std::move(*f);
    ASSERT_TRUE(file_->Write(0, Pattern(64 << 10, 0)).ok());
  }
  testing::TempDir dir_{"faultfs"};
  FaultInjectionFileSystem fault_{FileSystem::Default()};
  std::unique_ptr<RandomRWFile> file_;
};

TEST_F(FaultFsTest, EioAndEnospcFailWithoutWriting) {
  fault_.AddRule({FaultOp::kWrite, FaultKind::kEio, "", 1, 1.0});
  Status s = file_->Write(0, Pattern(4096, 9));
  EXPECT_TRUE(s.Is(StatusCode::kIOError)) << s.ToString();
  EXPECT_NE(s.ToString().find("injected"), std::string::npos);
  fault_.AddRule({FaultOp::kWrite, FaultKind::kEnospc, "", 1, 1.0});
  s = file_->Write(0, Pattern(4096, 9));
  EXPECT_TRUE(s.Is(StatusCode::kResourceExhausted)) << s.ToString();
  std::vector<std::byte> back(4096);
  ASSERT_TRUE(file_->Read(0, back).ok());
  auto orig = Pattern(64 << 10, 0);
  EXPECT_TRUE(std::equal(back.begin(), back.end(), orig.begin()));
  fault_.AddRule({FaultOp::kRead, FaultKind::kEio, "", 1, 1.0});
  EXPECT_TRUE(file_->Read(0, back).status().Is(StatusCode::kIOError));
  fault_.AddRule({FaultOp::kSync, FaultKind::kEio, "", 1, 1.0});
  EXPECT_TRUE(file_->Sync().Is(StatusCode::kIOError));
  fault_.AddRule({FaultOp::kAllocate, FaultKind::kEnospc, "", 1, 1.0});
  EXPECT_TRUE(file_->Allocate(0, 1 << 20).Is(StatusCode::kResourceExhausted));
  EXPECT_TRUE(file_->Write(0, Pattern(4096, 9)).ok());  // rules are used up
  EXPECT_EQ(fault_.Stats().injected, 5u);
}

TEST_F(FaultFsTest, TornWriteLeavesAPrefixAndFails) {
  fault_.AddRule({FaultOp::kWrite, FaultKind::kTornWrite, "", 1, 1.0});
  auto fresh = Pattern(32 << 10, 5);
  Status s = file_->Write(0, fresh);
  EXPECT_TRUE(s.Is(StatusCode::kIOError)) << s.ToString();
  EXPECT_NE(s.ToString().find("torn"), std::string::npos);
  std::vector<std::byte> back(32 << 10);
  ASSERT_TRUE(file_->Read(0, back).ok());
  auto orig = Pattern(64 << 10, 0);
  size_t prefix = 0;
  while (prefix < back.size() && back[prefix] == fresh[prefix]) ++prefix;
  EXPECT_EQ(prefix % 4096, 0u);
  EXPECT_LT(prefix, back.size());
  EXPECT_TRUE(std::equal(back.begin() + prefix, back.end(), orig.begin() + prefix));
}

TEST_F(FaultFsTest, ShortReadAndFlippedBits) {
  std::vector<std::byte> back(16 << 10);
  fault_.AddRule({FaultOp::kRead, FaultKind::kShortRead, "", 1, 1.0});
  auto n = file_->Read(0, back);
  ASSERT_TRUE(n.ok());
  EXPECT_LT(*n, back.size());
  EXPECT_EQ(*n % 4096, 0u);
  fault_.AddRule({FaultOp::kRead, FaultKind::kFlipBit, "", 1, 1.0});
  ASSERT_TRUE(file_->Read(0, back).ok());
  auto orig = Pattern(64 << 10, 0);
  int diff_bits = 0;
  for (size_t i = 0; i < back.size(); ++i)
    diff_bits += __builtin_popcount(static_cast<unsigned>(back[i] ^ orig[i]));
  EXPECT_EQ(diff_bits, 1);
  // A flipped write lands on disk damaged but succeeds: only a checksum can tell.
  fault_.AddRule({FaultOp::kWrite, FaultKind::kFlipBit, "", 1, 1.0});
  auto fresh = Pattern(4096, 3);
  ASSERT_TRUE(file_->Write(0, fresh).ok());
  std::vector<std::byte> one(4096);
  ASSERT_TRUE(file_->Read(0, one).ok());
  EXPECT_NE(one, fresh);
  EXPECT_TRUE(fault_.FlipBitInFile(dir_.Sub("f"), 5, 2).ok());
  EXPECT_TRUE(fault_.FlipBitInFile(dir_.Sub("f"), 1 << 30, 2).Is(StatusCode::kOutOfRange));
}

TEST_F(FaultFsTest, PathFilterProbabilityAndCounts) {
  fault_.AddRule({FaultOp::kWrite, FaultKind::kEio, "other-file", UINT64_MAX, 1.0});
  EXPECT_TRUE(file_->Write(0, Pattern(4096, 1)).ok());
  fault_.ClearRules();
  fault_.AddRule({FaultOp::kWrite, FaultKind::kEio, "", UINT64_MAX, 0.5});
  int failed = 0;
  for (int i = 0; i < 200; ++i) failed += !file_->Write(0, Pattern(4096, 1)).ok();
  EXPECT_GT(failed, 50);
  EXPECT_LT(failed, 150);
  fault_.ClearRules();
  fault_.AddRule({FaultOp::kOpen, FaultKind::kEio, "", 1, 1.0});
  EXPECT_TRUE(
      fault_.OpenRandomRW(dir_.Sub("f"), FileOpenOptions{}).status().Is(StatusCode::kIOError));
}

}  // namespace
}  // namespace sparsekv
