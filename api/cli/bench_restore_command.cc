#include <cstdio>
#include <memory>

#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"
#include "restore_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(restore) {
  struct Args {
    bench::RestoreBenchOptions options;
    ModelOptions model;
    std::string durability = "none";
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "restore",
      "Store a prompt's blocks into one offload tier and restore them into L1, against memcpy "
      "(and O_DIRECT pread / fio for ssd)");
  args->model.AddTo(cmd);
  cmd->add_option("--blocks", args->options.blocks, "Full blocks of the prompt")
      ->capture_default_str();
  cmd->add_option("--tier", args->options.tier, "host or ssd")->capture_default_str();
  cmd->add_option("--dir", args->options.dir,
                  "Directory on the file system to measure (required for ssd)");
  cmd->add_option("--rounds", args->options.rounds, "Interleaved rounds per method")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  cmd->add_flag("!--no-warmup", args->options.warmup_round,
                "Count the first round too (by default one uncounted round runs first)");
  AddDurabilityOption(cmd, args->durability);
  cmd->add_option("--read-arena-bytes", args->options.ssd_read_arena_bytes,
                  "SSD tier's registered read arena (0: the tier's default)")
      ->capture_default_str();
  cmd->add_flag("--with-fio", args->options.with_fio,
                "ssd: also run fio (io_uring, O_DIRECT reads at its best block size and depth, which the "
                "tier then uses), before each restore and after the last");
  cmd->add_option("--fio-bs", args->options.fio_block_bytes, "fio's block size in bytes (0: the best of a sweep)")
      ->capture_default_str();
  cmd->add_option("--fio-depth", args->options.fio_depth, "fio's depth (0: the best of a sweep)")
      ->capture_default_str();
  cmd->add_flag("--fio-tier-file", args->options.fio_on_tier_file,
                "ssd: the interleaved fio runs read the tier's own data file (read-only), as freshly stored as "
                "the restore's bytes, instead of fio's own file");
  cmd->add_option("--eviction-blocks", args->options.eviction_blocks,
                  "L1 blocks of the write-back eviction phase (time under the manager's lock per evicted "
                  "block, with and without evicting ahead); 0 skips it")
      ->capture_default_str();
  cmd->add_option("--eviction-compute-us", args->options.eviction_compute_us,
                  "Microseconds the engine computes each block in the eviction phase (this thread idle)")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    if (!ParseDurabilityOption(args->durability, args->options.durability, exit_code)) return;
    auto spec = args->model.Load();
    if (!spec.ok()) {
      exit_code = Fail(spec.status());
      return;
    }
    bench::RestoreBenchOptions& o = args->options;
    o.model = spec->name;
    o.kv_format = args->model.spec_file.empty() ? args->model.kv_format : "";
    o.block_tokens = args->model.block_tokens;
    o.spec = *std::move(spec);
    const auto r = bench::RunRestoreBench(o);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    const double gb = 1e9;
    std::printf("%s (%s), %u blocks of %llu bytes, %s tier, median of %d rounds\n",
                j["model"].get<std::string>().c_str(), j["kv_format"].get<std::string>().c_str(),
                j["blocks"].get<unsigned>(),
                static_cast<unsigned long long>(j["block_bytes"].get<uint64_t>()),
                j["tier"].get<std::string>().c_str(), o.rounds);
    std::printf("store    %7.2f GB/s   time vs memcpy %5.2fx   %6.3f CPU s/GB   %6.1f faults/block\n",
                j["store_bytes_per_s"].get<double>() / gb, j["store_time_vs_memcpy"].get<double>(),
                j["store_cpu_s_per_gb"].get<double>(), j["store_faults_per_block"].get<double>());
    std::printf(
        "restore  %7.2f GB/s   vs memcpy %5.2f (time %.2fx)   %6.3f CPU s/GB   %6.1f "
        "faults/block\n",
        j["restore_bytes_per_s"].get<double>() / gb, j["restore_vs_memcpy"].get<double>(),
        j["restore_time_vs_memcpy"].get<double>(), j["restore_cpu_s_per_gb"].get<double>(),
        j["faults_per_block"].get<double>());
    std::printf("memcpy   %7.2f GB/s   (one thread, prefaulted buffers)\n",
                j["memcpy_bytes_per_s"].get<double>() / gb);
    if (j.contains("write_back_eviction")) {
      const auto& e = j["write_back_eviction"];
      for (const char* mode : {"hook", "evict_ahead"}) {
        std::printf("evict    %-11s %8.1f us under the manager's lock per evicted block (%.3fx a memcpy of it; "
                    "%llu of %llu evicted ahead)\n",
                    mode, e[mode]["lock_seconds_per_evicted_block"].get<double>() * 1e6,
                    e[mode]["lock_time_vs_memcpy"].get<double>(),
                    static_cast<unsigned long long>(e[mode]["evicted_ahead"].get<uint64_t>()),
                    static_cast<unsigned long long>(e[mode]["evicted_blocks"].get<uint64_t>()));
      }
    }
    if (!j["pread_bytes_per_s"].is_null()) {
      std::printf("pread    %7.2f GB/s   (O_DIRECT, 1 MiB, depth 1; restore/pread %.2f)\n",
                  j["pread_bytes_per_s"].get<double>() / gb, j["restore_vs_pread"].get<double>());
    }
    if (j.contains("restore_vs_fio")) {
      std::printf("fio      %7.2f GB/s at bs %llu depth %u (median), interleaved; restore/fio per round:",
                  j["fio_read_bytes_per_s"].get<double>() / gb,
                  static_cast<unsigned long long>(j["fio_best_bs"].get<uint64_t>()), j["fio_best_iodepth"].get<unsigned>());
      for (const auto& r : j["restore_vs_fio"]["runs"]) {
        std::printf(" %.2f", (r.contains("vs_fio_around") ? r["vs_fio_around"] : r["vs_fio_before"]).get<double>());
      }
      std::printf("   (median %.2f)\n", j["restore_vs_fio_best"].get<double>());
    } else if (j.contains("fio_error")) {
      std::printf("fio: %s\n", j["fio_error"].get<std::string>().c_str());
    }
  });
}

}  // namespace sparsekv::cli
