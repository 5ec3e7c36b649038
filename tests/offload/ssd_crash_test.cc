// Restart after SIGKILL at the tier level: a child process (this binary, re-executed) puts
// bundles through the SSD tier and reports each acknowledged id through a pipe; the parent
// kills it at a random moment, three times, then reopens the tier and finds every
// acknowledged bundle byte-identical.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "sparsekv/ssd_tier.h"
#include "tests/offload/test_util.h"

namespace sparsekv {
namespace {

using testing::KeyOf;
using testing::MakeBundleOfBytes;
using testing::SameBytes;

uint64_t PayloadOf(uint64_t id) {
  return 3000 + (id * 7919) % 120000;
}

SsdTierOptions CrashOptions(const std::string& dir) {
  SsdTierOptions o;
  o.path = dir;
  o.capacity_bytes = 512ull << 20;
  o.io_bytes = 64 << 10;
  o.slab_grow_bytes = 4 << 20;
  o.read_arena_bytes = 16 << 20;
  o.durability = Durability::kFdatasync;
  return o;
}

// Runs only when re-executed by the parent below (disabled, so ctest never runs it alone).
TEST(SsdCrashChild, DISABLED_PutUntilKilled) {
  const char* dir = std::getenv("SPARSEKV_CRASH_DIR");
  if (dir == nullptr) GTEST_SKIP() << "run by SsdCrash.AcknowledgedBundlesSurviveSigkill";
  const int fd = std::atoi(std::getenv("SPARSEKV_CRASH_FD"));
  uint64_t id = std::strtoull(std::getenv("SPARSEKV_CRASH_BASE"), nullptr, 10);
  auto tier = SsdTier::Open(CrashOptions(dir));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  // At most kMaxPerCycle bundles a cycle (then it waits to be killed): three cycles then write
  // at most ~380 MB, below the tier's 512 MiB, so nothing acknowledged is evicted. On a fast
  // machine three unbounded cycles wrote 8,830 bundles (~556 MB), the tier evicted the oldest,
  // and the whole first cycle read as lost.
  constexpr uint64_t kMaxPerCycle = 2000;
  for (uint64_t written = 0;; written += 4) {
    if (written >= kMaxPerCycle) {
      pause();
      continue;
    }
    std::vector<BundlePtr> batch;
    for (int i = 0; i < 4; ++i, ++id) batch.push_back(MakeBundleOfBytes(id, PayloadOf(id)));
    auto st = (*tier)->Put(batch).get();
    for (size_t i = 0; i < st.size(); ++i) {
      if (!st[i].ok()) continue;
      const uint64_t acked = batch[i]->key().hash.lo;
      ASSERT_EQ(write(fd, &acked, sizeof acked), static_cast<ssize_t>(sizeof acked));
    }
  }
}

TEST(SsdCrash, AcknowledgedBundlesSurviveSigkill) {
  testing::TempDir dir("crash");
  std::set<uint64_t> acked;
  std::mt19937_64 rng(std::random_device{}());
  for (int cycle = 0; cycle < 3; ++cycle) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = testing::SpawnChildTest(
        "SsdCrashChild.DISABLED_PutUntilKilled",
        {"SPARSEKV_CRASH_DIR=" + dir.path(), "SPARSEKV_CRASH_FD=" + std::to_string(fds[1]),
         "SPARSEKV_CRASH_BASE=" + std::to_string(uint64_t(cycle) << 32)},
        fds);
    ASSERT_GE(pid, 0);
    // Let it run for a random while (reading acks so it never blocks on the pipe), then kill.
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(300 + rng() % 700);
    auto drain = [&](int timeout_ms) {
      pollfd p{fds[0], POLLIN, 0};
      if (poll(&p, 1, timeout_ms) <= 0) return false;
      uint64_t buf[512];
      const ssize_t n = read(fds[0], buf, sizeof buf);
      if (n <= 0) return false;
      for (ssize_t i = 0; i < n / 8; ++i) acked.insert(buf[i]);
      return true;
    };
    while (std::chrono::steady_clock::now() < deadline) drain(10);
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status)) << "the child ended on its own: status " << status;
    while (drain(0)) {
    }
    close(fds[0]);
  }
  ASSERT_GT(acked.size(), 10u) << "the child acknowledged too little to test anything";
  auto tier = SsdTier::Open(CrashOptions(dir.path()));
  ASSERT_TRUE(tier.ok()) << tier.status().ToString();
  std::vector<BundleKey> keys;
  std::vector<uint64_t> ids(acked.begin(), acked.end());
  for (uint64_t id : ids) keys.push_back(KeyOf(id));
  auto got = (*tier)->Get(keys).get();
  size_t lost = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!got[i].ok() || !SameBytes(**got[i], *MakeBundleOfBytes(ids[i], PayloadOf(ids[i])))) {
      ++lost;
      ADD_FAILURE() << "bundle " << ids[i] << ": " << got[i].status().ToString();
    }
  }
  EXPECT_EQ(lost, 0u) << "of " << ids.size() << " acknowledged";
  EXPECT_EQ((*tier)->Stats().corrupt, 0u);
  // Unacknowledged bundles may be there too (killed between the index write and the ack).
  EXPECT_GE((*tier)->Stats().items, ids.size());
}

}  // namespace
}  // namespace sparsekv
