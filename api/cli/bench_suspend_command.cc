// `sparsekv bench suspend`: suspend and resume of a long V3.2 and V4 sequence against memcpy and
// fio, a conversation's disk bytes against whole snapshots, and request log appends against
// fio's fdatasync rate (bench/suspend_bench.h).
#include <cstdio>
#include <memory>

#include "cli/bench_report.h"
#include "cli/registry.h"
#include "cli/model_options.h"
#include "suspend_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(suspend) {
  struct Args {
    bench::SuspendBenchOptions options;
    bool json = false;
    bool no_fio = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "suspend", "Suspend and resume long sequences (host, SSD) against memcpy and fio; a conversation's disk "
                 "bytes against whole snapshots; request log appends against fio --fdatasync=1");
  bench::SuspendBenchOptions& o = args->options;
  cmd->add_option("--dir", o.dir, "Directory on the file system to measure")->required();
  cmd->add_option("--v32-tokens", o.v32_tokens, "Tokens of the V3.2 sequence")->capture_default_str();
  cmd->add_option("--v4-tokens", o.v4_tokens, "Tokens of the V4 sequence")->capture_default_str();
  cmd->add_option("--max-bytes", o.max_bytes,
                  "Memory the sequences may take, L1 and the host tier together (0: 60% of MemAvailable); "
                  "a longer sequence is cut to fit, and the output says so")
      ->capture_default_str();
  cmd->add_flag("!--no-host", o.host, "Skip the host tier runs");
  cmd->add_flag("!--no-ssd", o.ssd, "Skip the SSD tier runs");
  cmd->add_flag("--no-fio", args->no_fio, "Do not run fio");
  cmd->add_option("--fio-bs", o.fio_block_bytes,
                  "SSD: fio's read block size in bytes, also the tier's I/O size (0: the best of a sweep)")
      ->capture_default_str();
  cmd->add_option("--fio-depth", o.fio_depth, "SSD: fio's read depth (0: the best of a sweep)")->capture_default_str();
  cmd->add_option("--rounds", o.rounds, "SSD: resumes, alternating with fio reads (fio, resume, ..., fio)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  cmd->add_flag("--cold-host-tier", o.cold_host_tier,
                "Do not populate the host tier's arena first: suspends pay the zeroing of fresh pages");
  cmd->add_option("--turns", o.turns, "Turns of the conversation")->capture_default_str();
  cmd->add_option("--turn-tokens", o.turn_tokens, "Tokens per turn")->capture_default_str();
  cmd->add_option("--concurrency", o.concurrency, "Requests appending at once, per log run")->capture_default_str();
  cmd->add_option("--log-seconds", o.log_seconds, "Seconds per log run")->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    args->options.with_fio = !args->no_fio;
    const auto r = bench::RunSuspendBench(args->options);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    const double gb = 1e9;
    for (const auto& s : j["sequences"]) {
      std::printf("%-18s %-4s %8llu tokens  suspend %6.2f GB/s  resume %6.2f GB/s", s["model"].get<std::string>().c_str(),
                  s["tier"].get<std::string>().c_str(), static_cast<unsigned long long>(s["tokens"].get<uint64_t>()),
                  s["suspend_bytes_per_s"].get<double>() / gb, s["resume_bytes_per_s"].get<double>() / gb);
      if (s.contains("suspend_vs_memcpy")) {
        std::printf("  vs memcpy %.2f / %.2f", s["suspend_vs_memcpy"].get<double>(), s["resume_vs_memcpy"].get<double>());
      }
      if (s.contains("suspend_vs_fio_write")) {
        std::printf("  vs fio %.2f / %.2f", s["suspend_vs_fio_write"].get<double>(), s["resume_vs_fio_read"].get<double>());
      }
      if (s.contains("resume_vs_fio")) {
        std::printf("\n    fio read at bs %llu depth %u, interleaved; resume/fio per round:",
                    static_cast<unsigned long long>(s["fio_best_bs"].get<uint64_t>()), s["fio_best_iodepth"].get<unsigned>());
        for (const auto& r : s["resume_vs_fio"]["runs"]) {
          std::printf(" %.2f", (r.contains("vs_fio_around") ? r["vs_fio_around"] : r["vs_fio_before"]).get<double>());
        }
      }
      if (s.contains("fio_error")) std::printf("  fio: %s", s["fio_error"].get<std::string>().c_str());
      if (s.contains("cut_to_fit_memory")) std::printf("  (cut to fit memory)");
      std::printf("\n");
    }
    for (const char* key : {"conversation", "conversation_write_through"}) {
      const auto& c = j[key];
      std::printf("conversation (%s): %u turns of %u tokens: %.1f MB on the tier, whole snapshots %.1f MB (ratio %.2f)\n",
                  c["write_policy"].get<std::string>().c_str(), c["turns"].get<unsigned>(), c["turn_tokens"].get<unsigned>(),
                  c["tier_bytes"].get<double>() / 1e6, c["whole_snapshots_bytes"].get<double>() / 1e6,
                  c["ratio_vs_whole_snapshots"].get<double>());
    }
    for (const auto& l : j["log"]) {
      std::printf("log: %5u requests  %9.0f appends/s  p50 %.2f ms  p99 %.2f ms  %.1f appends/sync",
                  l["concurrency"].get<unsigned>(), l["appends_per_s"].get<double>(), l["p50_ms"].get<double>(),
                  l["p99_ms"].get<double>(), l["appends_per_sync"].get<double>());
      if (l.contains("vs_fio_fdatasync_writes")) std::printf("  (%.1fx fio's fdatasync writes)", l["vs_fio_fdatasync_writes"].get<double>());
      std::printf("\n");
    }
  });
}

}  // namespace sparsekv::cli
