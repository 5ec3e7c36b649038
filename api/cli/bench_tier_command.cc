#include <cstdio>
#include <memory>

#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"
#include "tier_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(tier) {
  struct Args {
    bench::TierBenchOptions options;
    std::string durability = "fdatasync";
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "tier",
      "Offload tier write/read throughput against a synchronous pwrite/pread loop (and fio)");
  cmd->add_option("--tier", args->options.tier, "ssd, rocksdb or host")->capture_default_str();
  cmd->add_option("--dir", args->options.dir,
                  "Directory on the file system to measure (required for ssd, rocksdb)");
  cmd->add_option("--bundle-bytes", args->options.bundle_bytes,
                  "Record bytes per bundle (one I/O each)")
      ->check(CLI::Range(uint64_t{4096}, uint64_t{64} << 20))
      ->capture_default_str();
  cmd->add_option("--queue-depth", args->options.queue_depth, "I/Os in flight (SSD tier and fio)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--data-bytes", args->options.data_bytes, "Bytes written and read back per round")
      ->check(CLI::Range(uint64_t{4096}, uint64_t{16} << 30))
      ->capture_default_str();
  cmd->add_option("--batch", args->options.batch, "Bundles per tier call (0: 4 x queue depth)")
      ->capture_default_str();
  cmd->add_option("--rounds", args->options.rounds, "Interleaved rounds per method")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  AddDurabilityOption(cmd, args->durability);
  cmd->add_flag("--with-fio", args->options.with_fio,
                "Also run fio (io_uring, O_DIRECT) each round");
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    if (!ParseDurabilityOption(args->durability, args->options.durability, exit_code)) return;
    const auto r = bench::RunTierBench(args->options);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    const double mib = 1024.0 * 1024.0;
    std::printf(
        "%s tier, %llu-byte bundles, queue depth %u, %llu bytes, durability %s\n",
        args->options.tier.c_str(), static_cast<unsigned long long>(args->options.bundle_bytes),
        args->options.queue_depth, static_cast<unsigned long long>(j["data_bytes"].get<uint64_t>()),
        args->durability.c_str());
    std::printf("tier      write %8.1f MiB/s   read %8.1f MiB/s\n",
                j["write_bytes_per_s"].get<double>() / mib,
                j["read_bytes_per_s"].get<double>() / mib);
    if (j.contains("baseline_write_bytes_per_s")) {
      std::printf(
          "baseline  write %8.1f MiB/s   read %8.1f MiB/s   (tier/baseline: write %.2fx, read "
          "%.2fx)\n",
          j["baseline_write_bytes_per_s"].get<double>() / mib,
          j["baseline_read_bytes_per_s"].get<double>() / mib, j["write_vs_baseline"].get<double>(),
          j["read_vs_baseline"].get<double>());
    }
    if (j.contains("fio_write_bytes_per_s")) {
      std::printf(
          "fio       write %8.1f MiB/s   read %8.1f MiB/s   (tier/fio: write %.2f, read %.2f)\n",
          j["fio_write_bytes_per_s"].get<double>() / mib,
          j["fio_read_bytes_per_s"].get<double>() / mib, j["write_vs_fio"].get<double>(),
          j["read_vs_fio"].get<double>());
    } else if (j.contains("fio_error")) {
      std::printf("fio: %s\n", j["fio_error"].get<std::string>().c_str());
    }
  });
}

}  // namespace sparsekv::cli
