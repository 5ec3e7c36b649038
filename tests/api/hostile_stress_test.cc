// `sparsekv stress hostile` against a real sparsekvd child (SPARSEKVD_PATH): every attack of
// bench/hostile_stress.h in turn, with a well-behaved client measuring all along. The daemon
// must survive each, keep serving the good client and admitting new ones, never let a client
// resize its shared memory or see a reply frame above the announced limit, and keep its memory
// within the daemon-wide budget (128 MiB here) plus 256 MiB over what it held at the baseline. The
// good client's p99 under attack is printed for each attack; only a stall (over 20 times the
// baseline's, or 0.5 s when that was below 25 ms) fails the test: in phases this short, an attack
// that fills the budget (non-reader, big-frames) costs the good client a burst of tens of
// milliseconds on a 2-core machine shared with the attackers. The latency target itself is
// measured by the long run in the README. (Before issue 14 the daemon stalled for seconds.)
#include "hostile_stress.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "sparsekv/client.h"
#include "tests/support/process_reaper.h"

namespace sparsekv::bench {
namespace {

using nlohmann::json;

// The daemons here run with a 128 MiB buffer budget (max_buffered_bytes), so that each attack
// that fills it does so within its short phase; the memory bound is that budget + 256 MiB.
constexpr uint64_t kBudget = 128ull << 20;
constexpr uint64_t kBudgetSlack = kBudget + (256ull << 20);
constexpr double kStallRatio = 20;
// Under ASan or TSan the memory and latency bounds say nothing about the daemon: ASan keeps
// freed memory in quarantine (RSS grows phase after phase whatever the attack) and both slow
// every path several times over. Survival, errors and findings are checked all the same.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
constexpr double kStallFloorUs = 25000;

std::filesystem::path ScratchDir(const std::string& tag) {
  // Short: a Unix socket path must fit sun_path (108 bytes).
  const auto dir = std::filesystem::temp_directory_path() /
                   ("skv_hostile_" + tag + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// The end of the daemon's log, without the line it writes for each garbage connection.
std::string LogTail(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::vector<std::string> lines;
  uint64_t bad_frames = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find("closing after a bad frame") != std::string::npos) {
      ++bad_frames;
      continue;
    }
    lines.push_back(std::move(line));
  }
  std::string out = "(" + std::to_string(bad_frames) + " lines about bad frames left out)\n";
  for (size_t i = lines.size() > 40 ? lines.size() - 40 : 0; i < lines.size(); ++i) {
    out += lines[i] + "\n";
  }
  return out;
}

using Reaper = sparsekv::testing::ProcessReaper;

pid_t Spawn(const std::filesystem::path& config, const std::filesystem::path& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    execl(SPARSEKVD_PATH, SPARSEKVD_PATH, "--config", config.c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

// A free loopback port (there is a window before the daemon binds it; fine on a test machine).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0) {
    port = ntohs(sa.sin_port);
  }
  close(fd);
  return port;
}

// Connects and PINGs until the daemon answers (or exits, or `seconds` pass).
bool AnswersWithin(const std::string& addr, pid_t pid, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  do {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return false;
    ClientOptions o;
    o.address = addr;
    o.shared_memory = false;
    o.timeout = std::chrono::milliseconds(2000);
    auto c = Client::Connect(o);
    if (c.ok() && (*c)->Ping().ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < until);
  return false;
}

// The daemon of these tests: 256 MiB of host memory, no SSD tier, at most 64 connections.
std::filesystem::path WriteConfig(const std::filesystem::path& dir, const std::string& listen,
                                  const std::string& unix_socket) {
  const json config = {
      {"listen", listen},
      {"metrics_listen", ""},
      {"unix_socket", unix_socket},
      {"data_dir", (dir / "data").string()},
      {"busy_poll_us", 0},
      {"log_level", "warn"},
      {"max_connections", 64},
      {"max_buffered_bytes", kBudget},
      {"offload", {{"host", {{"capacity_bytes", "256MiB"}}}, {"ssd", {{"enabled", false}}}}}};
  const auto path = dir / "sparsekvd.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

std::string Mib(const json& bytes) {
  if (!bytes.is_number()) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.0f", bytes.get<double>() / (1 << 20));
  return buf;
}

// One line per phase, to the test's output: what the run measured, asserted or not.
void Print(const json& j) {
  auto line = [](const json& p) {
    std::printf(
        "  %-14s %5.1fs ops %6llu p50 %8.0fus p99 %9.0fus ratio %7s errors %llu "
        "newconn_failures %llu peak %s MiB (start %s) alive %s\n",
        p["name"].get<std::string>().c_str(), p["seconds"].get<double>(),
        static_cast<unsigned long long>(p["good_ops"].get<uint64_t>()),
        p["good_p50_us"].is_number() ? p["good_p50_us"].get<double>() : -1.0,
        p["good_p99_us"].is_number() ? p["good_p99_us"].get<double>() : -1.0,
        p.value("p99_ratio", json()).is_number()
            ? std::to_string(p["p99_ratio"].get<double>()).substr(0, 7).c_str()
            : "-",
        static_cast<unsigned long long>(p["good_errors"].get<uint64_t>()),
        static_cast<unsigned long long>(p["new_connection_failures"].get<uint64_t>()),
        Mib(p["daemon_peak_rss_bytes"]).c_str(), Mib(p["daemon_rss_start_bytes"]).c_str(),
        p["daemon_alive"].get<bool>() ? "yes" : "NO");
  };
  std::printf("stress hostile against %s (seed %llu, %.1f s a phase):\n",
              j["addr"].get<std::string>().c_str(),
              static_cast<unsigned long long>(j["seed"].get<uint64_t>()),
              j["phase_seconds"].get<double>());
  line(j["baseline"]);
  for (const auto& p : j["attacks"]) line(p);
  for (const auto& p : j["attacks"]) {
    std::printf("  %s: %s\n", p["name"].get<std::string>().c_str(), p["details"].dump().c_str());
  }
  std::fflush(stdout);
}

// The assertions both tests share.
void ExpectSurvived(const json& j, size_t attacks_expected) {
  Print(j);
  ASSERT_TRUE(j["baseline"]["daemon_alive"].get<bool>()) << j["baseline"].dump(2);
  EXPECT_EQ(j["daemon_deaths"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["attacks"].size(), attacks_expected) << "skipped: " << j["skipped"].dump();
  EXPECT_EQ(j["good_client_errors"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["findings"].get<uint64_t>(), 0u) << j["finding_counters"].dump();
  const json& base = j["baseline"];
  ASSERT_TRUE(base["daemon_peak_rss_bytes"].is_number()) << "the daemon's RSS was not measured";
  const uint64_t limit = base["daemon_peak_rss_bytes"].get<uint64_t>() + kBudgetSlack;
  for (const auto& p : j["attacks"]) {
    const std::string name = p["name"].get<std::string>();
    SCOPED_TRACE(name);
    EXPECT_TRUE(p["daemon_alive"].get<bool>())
        << p.value("daemon_state", "") << "; answered again after "
        << p.value("daemon_answered_again_after_seconds", json()).dump() << " s";
    EXPECT_EQ(p["good_errors"].get<uint64_t>(), 0u) << p["error_examples"].dump();
    EXPECT_EQ(p["new_connection_failures"].get<uint64_t>(), 0u) << p["error_examples"].dump();
    EXPECT_GT(p["good_ops"].get<uint64_t>(), 0u) << "the good client made no progress";
    ASSERT_TRUE(p["daemon_peak_rss_bytes"].is_number());
    if (kSanitized) continue;  // see kSanitized
    EXPECT_LE(p["daemon_peak_rss_bytes"].get<uint64_t>(), limit)
        << "peak RSS " << Mib(p["daemon_peak_rss_bytes"]) << " MiB; baseline "
        << Mib(base["daemon_peak_rss_bytes"]) << " MiB + the budget + 256 MiB allowed; " << p["details"].dump();
    if (p["good_p99_us"].is_number() && base["good_p99_us"].is_number()) {
      // Against at least 25 ms: 20 times a baseline p99 of a few hundred microseconds would be a
      // burst of the shared cores rather than a stall.
      const double reference = std::max(base["good_p99_us"].get<double>(), kStallFloorUs);
      EXPECT_LE(p["good_p99_us"].get<double>() / reference, kStallRatio)
          << "good-client p99 " << p["good_p99_us"] << " us against " << base["good_p99_us"]
          << " us at the baseline (ratio " << p["p99_ratio"] << ")";
    }
  }
}

TEST(HostileStress, EveryAttackOverTheUnixSocket) {
  const auto dir = ScratchDir("unix");
  Reaper reaper;
  const std::string sock = (dir / "d.sock").string();
  const auto config = WriteConfig(dir, "127.0.0.1:0", sock);
  const pid_t pid = Spawn(config, dir / "sparsekvd.log");
  ASSERT_GT(pid, 0);
  reaper.pids.push_back(pid);
  ASSERT_TRUE(AnswersWithin("unix:" + sock, pid, 60)) << LogTail(dir / "sparsekvd.log");

  HostileStressOptions o;
  o.addr = "unix:" + sock;
  o.seed = 14;
  o.oversized_get_hashes = 300;
  const size_t attacks = HostileAttackNames().size();
  o.seconds = 1.5 * static_cast<double>(attacks + 1);
  auto r = RunHostileStress(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString() << "\n" << LogTail(dir / "sparsekvd.log");
  EXPECT_EQ((*r)["pid"], pid) << "found over the socket (SO_PEERCRED)";
  ExpectSurvived(*r, attacks);
  // dying-viewer did take leases (the arena is lent: one namespace), and after its sessions died
  // holding them a fresh one was lent everything again.
  for (const auto& p : (*r)["attacks"]) {
    if (p["name"] != "dying-viewer") continue;
    const json& d = p["details"];
    EXPECT_EQ(d["sessions_without_arena"].get<uint64_t>(), 0u) << d.dump();
    EXPECT_GT(d["leases"].get<uint64_t>(), 1u) << d.dump();
    EXPECT_GT(d["items_lent"].get<uint64_t>(), 16u) << d.dump();
    EXPECT_EQ(d["lent_again_after"].get<int>(), 16) << d.dump();
  }
  if (HasFailure())
    std::printf("the daemon's log ends:\n%s\n", LogTail(dir / "sparsekvd.log").c_str());
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  reaper.pids.clear();
  std::filesystem::remove_all(dir);
}

TEST(HostileStress, SmallerOverTcpWithThePidGiven) {
  const auto dir = ScratchDir("tcp");
  Reaper reaper;
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  const auto config = WriteConfig(dir, addr, "");
  const pid_t pid = Spawn(config, dir / "sparsekvd.log");
  ASSERT_GT(pid, 0);
  reaper.pids.push_back(pid);
  ASSERT_TRUE(AnswersWithin(addr, pid, 60)) << LogTail(dir / "sparsekvd.log");

  HostileStressOptions o;
  o.addr = addr;
  o.pid = pid;
  o.seed = 15;
  o.oversized_get_hashes = 200;
  o.garbage_connections = 16;
  o.big_claim_connections = 16;
  o.slowloris_connections = 8;
  o.non_reader_connections = 4;
  o.idle_connections = 100;
  o.big_frame_connections = 8;
  o.hello_flood_connections = 80;
  const size_t attacks = HostileAttackNames().size() - 2;  // not shrink-memfd, dying-viewer
  o.seconds = 0.8 * static_cast<double>(attacks + 1);
  auto r = RunHostileStress(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString() << "\n" << LogTail(dir / "sparsekvd.log");
  ASSERT_EQ((*r)["skipped"].size(), 2u) << (*r)["skipped"].dump();
  EXPECT_EQ((*r)["skipped"][0]["name"], "shrink-memfd");
  EXPECT_EQ((*r)["skipped"][1]["name"], "dying-viewer");
  ExpectSurvived(*r, attacks);
  if (HasFailure())
    std::printf("the daemon's log ends:\n%s\n", LogTail(dir / "sparsekvd.log").c_str());
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  reaper.pids.clear();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sparsekv::bench
