// `sparsekv bench resp`: redis-benchmark against a redis-server and against sparsekvd's RESP
// listener, same client, same run, interleaved (bench/python/resp_bench.py does the work; this
// finds it and the sparsekvd built beside this binary, and passes every option on).
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "progress.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(resp) {
  auto extra = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = bench.add_subcommand(
      "resp",
      "redis-benchmark against redis-server and sparsekvd's RESP listener, interleaved, SET and GET by value "
      "size (options: bench/python/resp_bench.py --help)");
  cmd->allow_extras();
  cmd->prefix_command();
  cmd->callback([cmd, &exit_code] {
    bench::ProgressStop();  // the script it runs prints its own progress and results
    const char* env = std::getenv("SPARSEKV_RESP_BENCH");
    std::string script = env != nullptr ? env : SPARSEKV_SOURCE_DIR "/bench/python/resp_bench.py";
    if (!std::filesystem::exists(script)) {
      std::fprintf(stderr, "bench resp: %s not found (set SPARSEKV_RESP_BENCH)\n", script.c_str());
      exit_code = 2;
      return;
    }
    char self[PATH_MAX] = {};
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::vector<std::string> argv = {"/usr/bin/python3", script};
    bool has_daemon = false;
    for (const auto& a : cmd->remaining()) has_daemon = has_daemon || a.rfind("--sparsekvd", 0) == 0;
    if (n > 0 && !has_daemon && std::getenv("SPARSEKVD_PATH") == nullptr) {
      const auto daemon = std::filesystem::path(std::string(self, n)).parent_path() / "sparsekvd";
      if (std::filesystem::exists(daemon)) {
        argv.push_back("--sparsekvd");
        argv.push_back(daemon.string());
      }
    }
    for (const auto& a : cmd->remaining()) argv.push_back(a);
    std::vector<char*> c;
    for (auto& a : argv) c.push_back(a.data());
    c.push_back(nullptr);
    std::fflush(stdout);
    ::execv(c[0], c.data());
    std::fprintf(stderr, "bench resp: cannot run %s: %s\n", c[0], std::strerror(errno));
    exit_code = 2;
  });
}

}  // namespace sparsekv::cli
