// Helpers shared by the offload tests: temporary directories, deterministic bundles and a tier
// wrapper to build test tiers on.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sparsekv/bundle.h"
#include "sparsekv/tier.h"

namespace sparsekv::testing {

// A fresh directory under the temp dir, removed with everything in it when destroyed.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "offload") {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("sparsekv_" + tag + "_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path() const { return path_.string(); }
  std::string Sub(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Starts this test binary again in a child process that runs only `child_test` (a disabled
// test, "Suite.DISABLED_Name"), with `env` ("NAME=value") as its whole environment. `pipe_fds`
// (from pipe()) is split: the child keeps the write end, the caller the read end. Returns the
// child's pid, or -1 when fork failed.
inline pid_t SpawnChildTest(const std::string& child_test, std::vector<std::string> env, const int pipe_fds[2]) {
  std::string self = "/proc/self/exe", filter = "--gtest_filter=" + child_test,
              disabled = "--gtest_also_run_disabled_tests";
  std::vector<char*> argv = {self.data(), filter.data(), disabled.data(), nullptr};
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[0]);
    execve(self.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  close(pipe_fds[1]);
  return pid;
}

inline BundleKey KeyOf(uint64_t id, uint32_t ns = 7) {
  BundleKey k;
  k.namespace_id = ns;
  k.hash.hi = id * 0x9e3779b97f4a7c15ull + 1;
  k.hash.lo = id;
  return k;
}

// A bundle whose bytes are a function of (id, version): segments of the given sizes, stamped
// with `sequence` (bundle.h).
inline BundlePtr MakeBundle(uint64_t id, std::vector<uint64_t> segment_bytes, uint64_t version = 0,
                            uint32_t ns = 7, uint64_t sequence = 0) {
  auto b = Bundle::MakeWith(
      KeyOf(id, ns), segment_bytes,
      [&](uint32_t seg, std::span<std::byte> out) {
        std::mt19937_64 rng(id * 1000003 + version * 7919 + seg);
        size_t i = 0;
        for (; i + 8 <= out.size(); i += 8) {
          const uint64_t v = rng();
          std::memcpy(out.data() + i, &v, 8);
        }
        for (; i < out.size(); ++i) out[i] = std::byte(rng() & 0xff);
      },
      sequence);
  return b.ok() ? *b : nullptr;
}

// Three kinds, like a V3.2 block in miniature: latent, indexer keys, a small state.
inline BundlePtr MakeBundleOfBytes(uint64_t id, uint64_t payload_bytes, uint64_t version = 0,
                                   uint64_t sequence = 0) {
  const uint64_t a = payload_bytes * 3 / 4, b = payload_bytes / 5, c = payload_bytes - a - b;
  return MakeBundle(id, {a, b, c}, version, 7, sequence);
}

inline bool SameBytes(const Bundle& a, const Bundle& b) {
  return a.record_bytes() == b.record_bytes() &&
         std::memcmp(a.record().data(), b.record().data(), a.record_bytes()) == 0;
}

// A tier that passes every call to another; tests derive from it to hold back or change some.
class ForwardingTier : public Tier {
 public:
  explicit ForwardingTier(std::unique_ptr<Tier> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  uint64_t capacity_bytes() const override { return inner_->capacity_bytes(); }
  uint64_t max_record_bytes() const override { return inner_->max_record_bytes(); }
  uint64_t max_sequence() const override { return inner_->max_sequence(); }
  TierStats Stats() const override { return inner_->Stats(); }
  bool remote() const override { return inner_->remote(); }
  std::vector<TierMetric> Metrics() const override { return inner_->Metrics(); }
  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    inner_->PutAsync(std::move(bundles), std::move(done));
  }
  void GetAsync(std::vector<BundleKey> keys, BundlesCallback done) override {
    inner_->GetAsync(std::move(keys), std::move(done));
  }
  void ContainsAsync(std::vector<BundleKey> keys, ContainsCallback done) override {
    inner_->ContainsAsync(std::move(keys), std::move(done));
  }
  void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) override {
    inner_->EraseAsync(std::move(keys), std::move(done));
  }
  void EraseOlderAsync(std::vector<BundleKey> keys, std::vector<uint64_t> below,
                       StatusesCallback done) override {
    inner_->EraseOlderAsync(std::move(keys), std::move(below), std::move(done));
  }

 protected:
  std::unique_ptr<Tier> inner_;
};

}  // namespace sparsekv::testing
