#include "offload/uring_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "sparsekv/bundle.h"
#include "sparsekv/fault_injection_file_system.h"
#include "tests/offload/test_util.h"

namespace sparsekv::offload {
namespace {

constexpr uint64_t kIo = 64 << 10;

std::byte PatternByte(uint64_t op, uint64_t i) {
  return std::byte((op * 131 + i * 7) & 0xff);
}

class UringQueueTest : public ::testing::TestWithParam<bool> {
 protected:
  void Open(FileSystem* fs) {
    FileOpenOptions o;
    o.create = true;
    o.direct = true;
    auto f = fs->OpenRandomRW(dir_.Sub("data"), o);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    file_ = std::move(*f);
    ASSERT_TRUE(file_->Allocate(0, kOps * kIo).ok());
    auto q = UringQueue::Create(4);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    queue_ = std::move(*q);
    memory_ = RecordBuffer::Allocate(kOps * kIo);
    if (GetParam()) {
      ASSERT_TRUE(queue_->RegisterRegion(memory_.data(), memory_.capacity()).ok());
    }
  }
  std::byte* MemoryOf(uint64_t i) { return memory_.data() + i * kIo; }
  // Writes op i's pattern at i * kIo; returns each op's result.
  std::vector<int> WriteAll() {
    std::vector<int> results(kOps, 1);
    Status s = queue_->Run(
        kOps,
        [&](uint64_t i, UringOp& op) {
          for (uint64_t k = 0; k < kIo; ++k) MemoryOf(i)[k] = PatternByte(i, k);
          op = {file_.get(), AsyncIo::Kind::kWrite, i * kIo, MemoryOf(i), kIo, 0, 0};
        },
        [&](uint64_t i, const UringOp& op) { results[i] = op.result; });
    EXPECT_TRUE(s.ok()) << s.ToString();
    return results;
  }
  // Reads every op back; returns how many bytes differ from the pattern per op (-1: failed).
  std::vector<int64_t> ReadAll() {
    std::vector<int64_t> diffs(kOps, -2);
    Status s = queue_->Run(
        kOps,
        [&](uint64_t i, UringOp& op) {
          std::memset(MemoryOf(i), 0, kIo);
          op = {file_.get(), AsyncIo::Kind::kRead, i * kIo, MemoryOf(i), kIo, 0, 0};
        },
        [&](uint64_t i, const UringOp& op) {
          const std::byte* buf = MemoryOf(i);
          if (op.result < 0) {
            diffs[i] = -1;
            return;
          }
          EXPECT_EQ(op.result, static_cast<int>(kIo));
          int64_t d = 0;
          for (uint64_t k = 0; k < kIo; ++k) d += buf[k] != PatternByte(i, k);
          diffs[i] = d;
        });
    EXPECT_TRUE(s.ok()) << s.ToString();
    return diffs;
  }

  static constexpr uint64_t kOps = 24;
  testing::TempDir dir_{"uring"};
  std::unique_ptr<RandomRWFile> file_;
  std::unique_ptr<UringQueue> queue_;
  RecordBuffer memory_;
};

TEST_P(UringQueueTest, WritesAndReadsBackEveryOp) {
  Open(FileSystem::Default());
  EXPECT_EQ(queue_->registered(), GetParam());
  for (int r : WriteAll()) EXPECT_EQ(r, static_cast<int>(kIo));
  for (int64_t d : ReadAll()) EXPECT_EQ(d, 0);
  EXPECT_EQ(queue_->fixed_ios(), GetParam() ? 2 * kOps : 0);
  EXPECT_EQ(queue_->plain_ios(), GetParam() ? 0 : 2 * kOps);
}

TEST_P(UringQueueTest, HooksInjectFaultsIntoTheRing) {
  FaultInjectionFileSystem fault(FileSystem::Default(), 7);
  Open(&fault);
  for (int r : WriteAll()) ASSERT_EQ(r, static_cast<int>(kIo));
  // Short reads are continued until the op is whole.
  fault.AddRule({FaultOp::kRead, FaultKind::kShortRead, "", 5, 1.0});
  for (int64_t d : ReadAll()) EXPECT_EQ(d, 0);
  EXPECT_EQ(fault.Stats().short_reads, 5u);
  // EIO on reads reaches the op, the others are unaffected.
  fault.AddRule({FaultOp::kRead, FaultKind::kEio, "", 2, 1.0});
  auto d = ReadAll();
  EXPECT_EQ(std::count(d.begin(), d.end(), -1), 2);
  EXPECT_EQ(std::count(d.begin(), d.end(), 0), static_cast<long>(kOps - 2));
  // A flipped bit on read damages exactly one byte of one op.
  fault.AddRule({FaultOp::kRead, FaultKind::kFlipBit, "", 1, 1.0});
  d = ReadAll();
  EXPECT_EQ(std::count(d.begin(), d.end(), 1), 1);
  // A flipped bit on write reaches the disk, not the caller's memory.
  fault.AddRule({FaultOp::kWrite, FaultKind::kFlipBit, "", 1, 1.0});
  for (int r : WriteAll()) ASSERT_EQ(r, static_cast<int>(kIo));
  d = ReadAll();
  EXPECT_EQ(std::count(d.begin(), d.end(), 1), 1);
  // Write faults: EIO, ENOSPC and torn writes fail their ops.
  fault.AddRule({FaultOp::kWrite, FaultKind::kEio, "", 1, 1.0});
  fault.AddRule({FaultOp::kWrite, FaultKind::kEnospc, "", 1, 1.0});
  fault.AddRule({FaultOp::kWrite, FaultKind::kTornWrite, "", 1, 1.0});
  auto w = WriteAll();
  EXPECT_EQ(std::count_if(w.begin(), w.end(), [](int r) { return r < 0; }), 3);
  EXPECT_EQ(std::count(w.begin(), w.end(), -ENOSPC), 1);
}

// A stream: ops arrive in installments from `more` (one of them empty-handed while ops are in
// flight), and a completion queues a retry of its own; every op completes exactly once.
TEST_P(UringQueueTest, StreamTakesOpsFromMoreUntilItHasNone) {
  Open(FileSystem::Default());
  for (int r : WriteAll()) ASSERT_EQ(r, static_cast<int>(kIo));
  std::vector<uint64_t> op_of;  // op index -> which kIo slot it reads
  std::vector<int> completions;
  uint64_t handed = 0, installments = 0, next_slot = 0;
  bool retried = false;
  std::vector<int64_t> diffs(kOps, -2);
  auto more = [&]() -> uint64_t {
    if (op_of.size() == handed && installments < 6) {
      ++installments;
      if (installments % 2 == 1) {  // 8, 0, 8, 0, 8, 0 new ops
        for (uint64_t k = 0; k < 8; ++k) op_of.push_back(next_slot++);
      }
    }
    const uint64_t n = op_of.size() - handed;
    handed = op_of.size();
    completions.resize(op_of.size(), 0);
    return n;
  };
  Status s = queue_->Run(
      0,
      [&](uint64_t k, UringOp& op) {
        std::memset(MemoryOf(op_of[k]), 0, kIo);
        op = {file_.get(), AsyncIo::Kind::kRead, op_of[k] * kIo, MemoryOf(op_of[k]), kIo, 0, 0};
      },
      [&](uint64_t k, const UringOp& op) {
        ++completions[k];
        ASSERT_EQ(op.result, static_cast<int>(kIo));
        const uint64_t i = op_of[k];
        int64_t d = 0;
        for (uint64_t b = 0; b < kIo; ++b) d += MemoryOf(i)[b] != PatternByte(i, b);
        diffs[i] = d;
        if (i == 5 && !retried) {
          retried = true;
          op_of.push_back(5);  // read slot 5 again: `more` hands it out
        }
      },
      more);
  EXPECT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(op_of.size(), kOps + 1);
  for (int c : completions) EXPECT_EQ(c, 1);
  for (int64_t d : diffs) EXPECT_EQ(d, 0);
}

INSTANTIATE_TEST_SUITE_P(Buffers, UringQueueTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Registered" : "Plain"; });

TEST(UringQueue, RejectsBadDepthAndMisalignedOps) {
  EXPECT_TRUE(UringQueue::Create(0).status().Is(StatusCode::kInvalidArgument));
  testing::TempDir dir("uring");
  FileOpenOptions o;
  o.create = true;
  o.direct = true;
  auto f = FileSystem::Default()->OpenRandomRW(dir.Sub("f"), o);
  ASSERT_TRUE(f.ok());
  auto q = UringQueue::Create(2);
  ASSERT_TRUE(q.ok());
  RecordBuffer mem = RecordBuffer::Allocate(8192);
  int result = 0;
  ASSERT_TRUE((*q)->Run(
                      1,
                      [&](uint64_t, UringOp& op) {
                        op = {f->get(), AsyncIo::Kind::kWrite, 0, mem.data() + 1, 4096, 0, 0};
                      },
                      [&](uint64_t, const UringOp& op) { result = op.result; })
                  .ok());
  EXPECT_EQ(result, -EINVAL);
}

}  // namespace
}  // namespace sparsekv::offload
