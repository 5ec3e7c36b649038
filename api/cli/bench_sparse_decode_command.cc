#include <cstdio>
#include <memory>
#include <string>

#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"
#include "sparse_decode_bench.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(sparse_decode) {
  struct Args {
    bench::SparseDecodeBenchOptions options;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "sparse-decode",
      "Decode steps with the sparse cache in a lower tier and a working set in L1, against the "
      "whole cache resident (same run, outputs compared bit for bit)");
  auto& o = args->options;
  cmd->add_option("--model", o.model, "deepseek-v3.2-exp or deepseek-v4-flash")->capture_default_str();
  cmd->add_option("--precision", o.precision, "fp8, c8 (V3.2) or bf16")->capture_default_str();
  cmd->add_option("--context", o.context, "Tokens of context (a multiple of 128)")->capture_default_str();
  cmd->add_option("--l1-fraction", o.l1_fraction, "Share of the sparse entries the working set holds (at least top-k)")
      ->capture_default_str();
  cmd->add_option("--steps", o.steps, "Decode steps measured (after one that fills the working set)")
      ->capture_default_str();
  cmd->add_option("--layers", o.layers, "Layers simulated (each costs the same)")->capture_default_str();
  cmd->add_option("--overlap", o.overlap, "Target overlap of consecutive selections")->capture_default_str();
  cmd->add_option("--tier", o.tier,
                  "Where the sparse cache lives: host, ssd, daemon (sparsekvd in this process, its host tier, "
                  "read with GET_RANGES over a Unix socket) or daemon-ssd (its host tier holding an eighth, over "
                  "an SSD tier)")
      ->capture_default_str();
  cmd->add_option("--prefetch", o.prefetch,
                  "Entries ranked past the top-k prefetched per layer and step on a thread of their own while "
                  "the kernel runs")
      ->capture_default_str();
  cmd->add_option("--dir", o.dir,
                  "--tier ssd, daemon-ssd: a directory for the SSD tier's files (removed afterwards)");
  cmd->add_option("--threads", o.threads, "Threads of the kernels")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed of the synthetic cache and queries")->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    const auto& o = args->options;
    const auto r = bench::RunSparseDecodeBench(o);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    std::printf("%s (%s), %llu tokens of context, %u layer(s), top-k %u; working set %u entries (%.0f%%), tier %s\n",
                o.model.c_str(), j["format"].get<std::string>().c_str(),
                static_cast<unsigned long long>(o.context), o.layers, j["top_k"].get<uint32_t>(),
                j["working_set_entries"].get<uint32_t>(), 100 * o.l1_fraction, o.tier.c_str());
    std::printf("overlap of consecutive selections %.3f (target %.2f); working-set hits %.3f; %.0f KiB fetched per step\n",
                j["measured_overlap"].get<double>(), o.overlap, j["working_set_hit_ratio"].get<double>(),
                j["bytes_fetched_per_step"].get<double>() / 1024);
    std::printf("step %.3f ms vs resident %.3f ms = %.3fx (indexer %.3f, fetch %.3f, MLA %.3f vs %.3f ms)\n",
                1e3 * j["step_seconds"].get<double>(), 1e3 * j["resident_step_seconds"].get<double>(),
                j["step_vs_resident"].get<double>(), 1e3 * j["indexer_seconds"].get<double>(),
                1e3 * j["fetch_seconds"].get<double>(), 1e3 * j["mla_working_set_seconds"].get<double>(),
                1e3 * j["mla_resident_seconds"].get<double>());
    std::printf("L1 bytes per token %.1f vs resident %.1f = %.3fx; full restore of the context %.3f ms\n",
                j["l1_bytes_per_token"].get<double>(), j["resident_l1_bytes_per_token"].get<double>(),
                j["l1_vs_resident"].get<double>(), 1e3 * j["full_restore_seconds"].get<double>());
    std::printf("outputs identical to the resident path's: %s\n", j["outputs_identical"].get<bool>() ? "yes" : "NO");
    if (!j["outputs_identical"].get<bool>()) exit_code = 1;
  });
}

}  // namespace sparsekv::cli
