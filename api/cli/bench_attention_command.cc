#include <cstdio>
#include <memory>
#include <string>

#include "attention_bench.h"
#include "cli/model_options.h"
#include "cli/bench_report.h"
#include "cli/registry.h"

namespace sparsekv::cli {

SPARSEKV_BENCH_COMMAND(attention) {
  struct Args {
    bench::AttentionBenchOptions options;
    std::string format = "c8_mla";
    std::string indexer_format = "idx_fp8";
    std::string path;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "attention",
      "Sparse MLA reading pages in place vs a gather baseline and a dot-product peak; the indexer");
  auto& o = args->options;
  cmd->add_option("--tokens", o.tokens, "Query tokens per call")->capture_default_str();
  cmd->add_option("--heads", o.heads, "MLA heads")->capture_default_str();
  cmd->add_option("--top-k", o.top_k, "Entries selected per token")->capture_default_str();
  cmd->add_option("--cache-tokens", o.cache_tokens, "Tokens in the cache")->capture_default_str();
  cmd->add_option("--block-tokens", o.block_tokens, "Entries per page")->capture_default_str();
  cmd->add_option("--format", args->format, "c8_mla, fp8_ds_mla, bf16 or fp8_v4")
      ->capture_default_str();
  cmd->add_option("--indexer-heads", o.indexer_heads, "Indexer heads")->capture_default_str();
  cmd->add_option("--indexer-format", args->indexer_format, "idx_fp8, idx_c8 or bf16")
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "Threads of every kernel and of the peak loop")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  AddRoundOptions(cmd, o.rounds, o.round_seconds);
  cmd->add_option(
      "--path", args->path,
      "SIMD path: scalar, avx2, avx512, avx512_bf16 or neon (default: SPARSEKV_SIMD or the best)");
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    auto& o = args->options;
    auto f = ParseStorageFormat(args->format);
    if (!f.ok()) {
      exit_code = Fail(f.status());
      return;
    }
    o.format = *f;
    auto fi = ParseStorageFormat(args->indexer_format);
    if (!fi.ok()) {
      exit_code = Fail(fi.status());
      return;
    }
    o.indexer_format = *fi;
    if (!ParseSimdPathOption(args->path, o.path, exit_code)) return;
    const auto r = bench::RunAttentionBench(o);
    const auto* report = ReportBenchAfterProgress(r, args->json, exit_code);
    if (report == nullptr) return;
    const auto& j = *report;
    std::printf("path %s, %u thread(s); %u token(s) x %u heads, top-k %u of %u cached (%s)\n",
                j["path"].get<std::string>().c_str(), o.threads, o.tokens, o.heads, o.top_k,
                o.cache_tokens, args->format.c_str());
    std::printf("sparse MLA in place  %8.1f GFLOP/s  (%.0f%% of peak, %.2fx the gather baseline)\n",
                j["sparse_mla_gflops"].get<double>(), 100 * j["sparse_mla_vs_peak"].get<double>(),
                j["sparse_mla_vs_gather"].get<double>());
    std::printf("gather baseline      %8.1f GFLOP/s\n", j["gather_baseline_gflops"].get<double>());
    std::printf("indexer (%u heads)   %8.1f GFLOP/s  (%.0f%% of peak)\n", o.indexer_heads,
                j["indexer_gflops"].get<double>(), 100 * j["indexer_vs_peak"].get<double>());
    std::printf("dot-product peak     %8.1f GFLOP/s\n", j["peak_gflops"].get<double>());
    std::printf("outputs identical to the baseline's: %s; largest spread across rounds: %.0f%%\n",
                j["outputs_identical"].get<bool>() ? "yes" : "NO",
                100 * j["max_spread"].get<double>());
  });
}

}  // namespace sparsekv::cli
