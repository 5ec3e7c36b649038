#include "bench_util.h"

#include <fmt/format.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
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

Result<FioBest> FindFioBestRead(const std::string& file, uint64_t size_bytes, uint64_t fixed_block_bytes,
                                uint32_t fixed_depth, double seconds, std::vector<uint64_t> block_bytes,
                                std::vector<uint32_t> depths) {
  FioBest best;
  if (fixed_block_bytes != 0 && fixed_depth != 0) {
    block_bytes = {fixed_block_bytes};
    depths = {fixed_depth};
  } else {
    if (fixed_block_bytes != 0) block_bytes = {fixed_block_bytes};
    if (fixed_depth != 0) depths = {fixed_depth};
    best.swept = true;
  }
  for (uint64_t bs : block_bytes) {
    for (uint32_t d : depths) {
      std::string cmd = FioJobCommand(file, size_bytes, bs, d, "read");
      if (best.swept) cmd += fmt::format(" --runtime={} --time_based", std::max(1.0, seconds));
      SPARSEKV_ASSIGN_OR_RETURN(double rate, RunFioJob(cmd, "read"));
      best.sweep.push_back({{"bs", bs}, {"iodepth", d}, {"read_bytes_per_s", rate}});
      if (rate > best.rate) best = FioBest{bs, d, rate, best.swept, best.sweep};
    }
  }
  return best;
}

nlohmann::json InterleavedFioRatios(const std::vector<double>& ours, const std::vector<double>& fio) {
  nlohmann::json runs = nlohmann::json::array();
  std::vector<double> before, around;
  for (size_t i = 0; i < ours.size() && i < fio.size(); ++i) {
    nlohmann::json r = {{"fio_bytes_per_s", fio[i]}, {"ours_bytes_per_s", ours[i]}, {"vs_fio_before", ours[i] / fio[i]}};
    before.push_back(ours[i] / fio[i]);
    if (i + 1 < fio.size()) {
      const double mean = (fio[i] + fio[i + 1]) / 2;
      r["fio_after_bytes_per_s"] = fio[i + 1];
      r["vs_fio_around"] = ours[i] / mean;
      around.push_back(ours[i] / mean);
    }
    runs.push_back(r);
  }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  nlohmann::json j;
  j["runs"] = runs;
  j["fio_read_bytes_per_s"] = fio;
  j["ours_bytes_per_s"] = ours;
  j["median_vs_fio_before"] = median(before);
  if (!around.empty()) j["median_vs_fio_around"] = median(around);
  j["min_vs_fio_before"] = before.empty() ? 0.0 : *std::min_element(before.begin(), before.end());
  return j;
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

Result<bool> RunChildUntilKilled(std::vector<std::string> command, size_t record_bytes, double seconds,
                                 const std::function<void(const std::byte*)>& on_record,
                                 const std::function<bool()>& kill_now) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Status::IOError(fmt::format("stress: pipe: {}", std::strerror(errno)));
  command.push_back("--ack-fd");
  command.push_back(std::to_string(fds[1]));
  std::vector<char*> argv;
  for (auto& a : command) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return Status::IOError(fmt::format("stress: fork: {}", std::strerror(errno)));
  }
  if (pid == 0) {
    // Only async-signal-safe calls until exec: the write end must survive it.
    close(fds[0]);
    const int flags = fcntl(fds[1], F_GETFD);
    fcntl(fds[1], F_SETFD, flags & ~FD_CLOEXEC);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  std::vector<std::byte> pending;
  auto drain = [&](int timeout_ms) {
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return false;
    std::byte buf[24 * 512];
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n <= 0) return false;
    pending.insert(pending.end(), buf, buf + n);
    size_t at = 0;
    for (; at + record_bytes <= pending.size(); at += record_bytes) on_record(pending.data() + at);
    pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(at));
    return true;
  };
  const double until = NowSeconds() + seconds;
  bool exited = false;
  while (NowSeconds() < until) {
    drain(5);
    if (kill_now && kill_now()) break;
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
  }
  if (!exited) {
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
  }
  while (drain(0)) {
  }
  close(fds[0]);
  return !exited;
}

}  // namespace sparsekv::bench
