#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "bench_util.h"
#include "cli/model_options.h"
#include "cli/registry.h"
#include "progress.h"
#include "prefix_sim.h"
#include "replay.h"

namespace sparsekv::cli {
namespace {

// "[=========>          ]  45%  5,400/12,031 requests" on stderr, redrawn in place.
void DrawProgress(size_t done, size_t total) {
  static double last_draw = 0;  // ten redraws a second are plenty
  const double now = bench::NowSeconds();
  if (done != 0 && done != total && now - last_draw < 0.1) return;
  last_draw = now;
  constexpr int kWidth = 40;
  const double f = total ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const int filled = static_cast<int>(f * kWidth);
  std::string bar(kWidth, ' ');
  for (int i = 0; i < filled; ++i) bar[i] = '=';
  if (filled < kWidth) bar[filled] = '>';
  std::fprintf(stderr, "\r[%s] %3d%%  %zu/%zu requests", bar.c_str(), static_cast<int>(f * 100),
               done, total);
  if (done == total) std::fputc('\n', stderr);
  std::fflush(stderr);
}

}  // namespace

SPARSEKV_CLI_COMMAND(replay) {
  struct Args {
    std::string trace;
    std::string model = "single-kind";
    std::string spec_file;
    std::string kv_format = "bf16";
    std::string hash = "xxh3";
    bench::ReplayOptions options;
    std::string sim_policy = "lru";
    uint32_t sim_lookahead = 0;
    std::string policy{EvictionPolicyName(kDefaultEvictionPolicy)};
    bool vs_lru = false;
    bool json = false;
    bool progress = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "replay",
      "Replay a Mooncake-format request trace through the prefix cache and report its hit ratio");
  cmd->add_option("--trace", args->trace, "Trace file: JSON lines with input_length and hash_ids")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--capacity-blocks", args->options.capacity_blocks,
                  "Pages per pool (blocks the cache holds); 0 for unlimited")
      ->capture_default_str();
  cmd->add_option("--block-tokens", args->options.block_tokens, "Tokens per cache block")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--trace-block-tokens", args->options.trace_block_tokens,
                  "Tokens per hash id in the trace")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto* model =
      cmd->add_option("--model", args->model,
                      "single-kind (one page per block), deepseek-v3.2-exp or deepseek-v4-flash")
          ->capture_default_str();
  cmd->add_option("--spec", args->spec_file, "JSON model spec file (instead of --model)")
      ->check(CLI::ExistingFile)
      ->excludes(model);
  cmd->add_option("--kv-format", args->kv_format, "Storage of a preset's KV: bf16, c8 or fp8")
      ->capture_default_str();
  cmd->add_option("--hash", args->hash, "Prefix hash: xxh3 or sha256")->capture_default_str();
  cmd->add_option("--salt", args->options.namespace_salt, "Namespace salt of every request");
  cmd->add_option("--policy", args->policy, "Eviction policy of the cache: lru or arc")->capture_default_str();
  cmd->add_option("--lookahead", args->options.lookahead,
                  "Hint the next N requests by arrival, as a scheduler knows its waiting queue")
      ->capture_default_str();
  cmd->add_option("--hint-bound", args->options.hint_bound, "Share of the capacity hints may protect at once")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_flag("--vs-lru", args->vs_lru, "Also replay under LRU without hints, in the same run, and print the ratio");
  cmd->add_option("--sim-policy", args->sim_policy,
                  "Also replay the offline model (bench/prefix_sim.h) under this policy: lru, arc or belady")
      ->capture_default_str();
  cmd->add_option("--sim-lookahead", args->sim_lookahead,
                  "The model's hints: blocks the next N requests read are protected (at most half the capacity)")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->add_flag("--progress", args->progress,
                "Draw a progress bar on stderr even when it is not a terminal (on one, progress is always shown)");
  cmd->callback([args, &exit_code] {
    auto hash = ParseHashMode(args->hash);
    if (!hash.ok()) {
      exit_code = Fail(hash.status());
      return;
    }
    args->options.hash_mode = *hash;
    auto eviction = ParseEvictionPolicy(args->policy);
    if (!eviction.ok()) {
      exit_code = Fail(eviction.status());
      return;
    }
    args->options.eviction = *eviction;
    if (!args->spec_file.empty()) {
      auto spec = LoadModelSpecFile(args->spec_file);
      if (!spec.ok()) {
        exit_code = Fail(spec.status());
        return;
      }
      args->options.spec = *spec;
    } else if (args->model != "single-kind") {
      auto precision = ParseKvPrecision(args->kv_format);
      auto spec = precision.ok() ? ModelPreset(args->model, *precision)
                                 : Result<ModelSpec>(precision.status());
      if (!spec.ok()) {
        exit_code = Fail(spec.status());
        return;
      }
      args->options.spec = *spec;
    }
    const double t0 = bench::NowSeconds();
    auto trace = bench::LoadMooncakeTrace(args->trace, args->options.trace_block_tokens);
    if (!trace.ok()) {
      exit_code = Fail(trace.status());
      return;
    }
    const double load_seconds = bench::NowSeconds() - t0;
    if (bench::ProgressActive()) {  // a terminal: the command's progress line shows the count
      args->options.progress = [](size_t done, size_t total) {
        if (done % 256 == 0 || done == total) bench::ProgressNote(fmt::format("{}/{} requests", done, total));
      };
    } else if (args->progress) {
      args->options.progress = DrawProgress;
    }
    auto r = bench::RunReplay(*trace, args->options);
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    nlohmann::json j = bench::ReplayResultToJson(*r, args->options);
    j["trace"] = args->trace;
    j["load_seconds"] = load_seconds;
    if (args->vs_lru) {
      bench::ReplayOptions base = args->options;
      base.eviction = EvictionPolicyKind::kLru;
      base.lookahead = 0;
      base.progress = nullptr;
      auto b = bench::RunReplay(*trace, base);
      if (!b.ok()) {
        exit_code = Fail(b.status());
        return;
      }
      j["lru_hit_blocks"] = b->hit_blocks;
      j["lru_seconds"] = b->seconds;
      j["vs_lru"] = b->hit_blocks ? static_cast<double>(r->hit_blocks) / static_cast<double>(b->hit_blocks) : 1.0;
    }
    // The offline optimum for the same trace and capacity (bench/prefix_sim.h), when the cache's
    // blocks are the trace's.
    if (args->options.block_tokens == args->options.trace_block_tokens) {
      auto opt = bench::SimulatePrefixCache(*trace, args->options.capacity_blocks, bench::SimPolicy::kBelady,
                                            args->options.block_tokens);
      if (!opt.ok()) {
        exit_code = Fail(opt.status());
        return;
      }
      j["belady_hit_blocks"] = opt->hit_blocks;
      j["hits_vs_belady"] = opt->hit_blocks ? static_cast<double>(r->hit_blocks) / static_cast<double>(opt->hit_blocks) : 1.0;
      j["belady_seconds"] = opt->seconds;
      auto policy = bench::ParseSimPolicy(args->sim_policy);
      if (!policy.ok()) {
        exit_code = Fail(policy.status());
        return;
      }
      bench::PrefixSimOptions so;
      so.capacity_blocks = args->options.capacity_blocks;
      so.block_tokens = args->options.block_tokens;
      so.policy = *policy;
      so.lookahead = args->sim_lookahead;
      auto sim = bench::SimulatePrefixCache(*trace, so);
      if (!sim.ok()) {
        exit_code = Fail(sim.status());
        return;
      }
      j["sim_policy"] = args->sim_policy;
      j["sim_lookahead"] = args->sim_lookahead;
      j["sim_hit_blocks"] = sim->hit_blocks;
      j["sim_vs_this_run"] = r->hit_blocks ? static_cast<double>(sim->hit_blocks) / static_cast<double>(r->hit_blocks) : 1.0;
    } else if (args->sim_policy != "lru" || args->sim_lookahead != 0) {
      exit_code = Fail(Status::InvalidArgument("--sim-policy and --sim-lookahead need --block-tokens equal to --trace-block-tokens"));
      return;
    }
    bench::ProgressStop();  // the results follow on the same terminal
    if (args->json) {
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    std::printf("%s: %llu requests, %llu blocks of %u tokens, model %s, capacity %s\n",
                args->trace.c_str(), static_cast<unsigned long long>(r->requests),
                static_cast<unsigned long long>(r->blocks), args->options.block_tokens,
                args->options.spec.name.c_str(),
                args->options.capacity_blocks
                    ? fmt::format("{} blocks", args->options.capacity_blocks).c_str()
                    : "unlimited");
    std::printf("hit blocks %llu   block hit ratio %.4f   token hit ratio %.4f\n",
                static_cast<unsigned long long>(r->hit_blocks), r->BlockHitRatio(),
                r->TokenHitRatio(args->options.block_tokens));
    std::printf("policy %s, lookahead %u (%llu hints, %llu hinted blocks past the bound)\n", args->policy.c_str(),
                args->options.lookahead, static_cast<unsigned long long>(r->hints),
                static_cast<unsigned long long>(r->hint_blocks_cut));
    std::printf("evicted %llu blocks   %.3f s   %.2f M blocks/s (hashing included)\n",
                static_cast<unsigned long long>(r->evicted_blocks), r->seconds,
                r->BlocksPerSecond() / 1e6);
    if (j.contains("lru_hit_blocks")) {
      std::printf("LRU without hints (same run): %llu hit blocks; this run %.3fx LRU\n",
                  static_cast<unsigned long long>(j["lru_hit_blocks"].get<uint64_t>()), j["vs_lru"].get<double>());
    }
    if (j.contains("belady_hit_blocks")) {
      std::printf("Belady's MIN (offline optimum, same trace and capacity): %llu hit blocks; this run %.3f of it\n",
                  static_cast<unsigned long long>(j["belady_hit_blocks"].get<uint64_t>()),
                  j["hits_vs_belady"].get<double>());
    }
    if (j.contains("sim_hit_blocks")) {
      std::printf("offline model, %s, lookahead %u: %llu hit blocks, %.3fx this run\n", args->sim_policy.c_str(),
                  args->sim_lookahead, static_cast<unsigned long long>(j["sim_hit_blocks"].get<uint64_t>()),
                  j["sim_vs_this_run"].get<double>());
    }
  });
}

}  // namespace sparsekv::cli
