#include "bench_util.h"

#include <fmt/format.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <cstdio>

#include "sparsekv/file_system.h"

namespace sparsekv::bench {

uint64_t ProcessPageFaults() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_minflt) + static_cast<uint64_t>(ru.ru_majflt);
}

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

std::string FioJobCommand(std::string_view file, uint64_t size_bytes, uint64_t block_bytes,
                          uint32_t iodepth, std::string_view rw) {
  return fmt::format(
      "fio --name=sparsekv-{} --filename={} --size={} --ioengine=io_uring --direct=1 --bs={} "
      "--iodepth={} "
      "--rw={} --output-format=json",
      rw, file, size_bytes, block_bytes, iodepth, rw);
}

Result<double> RunFioJob(const std::string& command, std::string_view rw) {
  const std::string cmd = command + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return Status::Unavailable("fio: popen failed");
  std::string out;
  char chunk[4096];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, p)) > 0) out.append(chunk, n);
  const int rc = pclose(p);
  if (rc != 0) {
    return Status::Unavailable(
        fmt::format("fio exited with status {} (is fio installed? scripts/setup.sh installs it)",
                    WIFEXITED(rc) ? WEXITSTATUS(rc) : rc));
  }
  const size_t brace = out.find('{');
  auto j =
      nlohmann::json::parse(brace == std::string::npos ? out : out.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty()) {
    return Status::Internal("fio: could not parse its JSON output");
  }
  const auto& job = j["jobs"][0];
  const char* side = rw == "write" ? "write" : "read";
  return job[side]["bw_bytes"].get<double>();
}

Result<std::unique_ptr<ScratchDir>> ScratchDir::Make(const std::string& parent,
                                                     std::string_view name) {
  if (parent.empty()) return std::unique_ptr<ScratchDir>(new ScratchDir(""));
  const std::string path =
      (std::filesystem::path(parent) / fmt::format("sparsekv-{}-{}", name, getpid())).string();
  SPARSEKV_RETURN_IF_ERROR(FileSystem::Default()->CreateDirs(path));
  return std::unique_ptr<ScratchDir>(new ScratchDir(path));
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

Result<uint16_t> FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::IOError(fmt::format("socket: {}", std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) return Status::IOError(fmt::format("cannot find a free loopback port: {}", std::strerror(err)));
  return ntohs(a.sin_port);
}

}  // namespace sparsekv::bench
