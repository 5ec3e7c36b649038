#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

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
    // KV events on vLLM's wire (off while endpoint is "").
    std::string kv_endpoint, kv_replay, kv_topic, kv_hash = "uint64", requests_out;
    uint32_t kv_hold_ms = 0, kv_rounds = 11;
    bool kv_vs_off = false;
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
  cmd->add_option("--kv-events-endpoint", args->kv_endpoint,
                  "Publish the cache's KV events on vLLM's wire: ZMQ PUB address to bind (\"\" disables)");
  cmd->add_option("--kv-events-replay-endpoint", args->kv_replay, "KV events: ZMQ ROUTER address for replay");
  cmd->add_option("--kv-events-topic", args->kv_topic, "KV events: topic (default kv@<pod>@<model>)");
  cmd->add_option("--kv-events-hash", args->kv_hash, "KV events: block hashes as uint64 or bytes")
      ->check(CLI::IsMember({"uint64", "bytes"}))
      ->capture_default_str();
  cmd->add_option("--kv-events-hold-ms", args->kv_hold_ms,
                  "KV events: after the results, keep publishing and serving replay this long")
      ->capture_default_str();
  cmd->add_flag("--kv-events-token-ids", args->options.kv_event_token_ids,
                "KV events: BlockStored carries the blocks' token ids (the manager keeps every prompt's tokens)");
  cmd->add_flag("--kv-events-vs-off", args->kv_vs_off,
                "KV events: first replay with events off and on in pairs (the order alternating) and print the "
                "blocks/s ratios");
  cmd->add_option("--kv-events-rounds", args->kv_rounds, "KV events: pairs of replays --kv-events-vs-off runs")
      ->check(CLI::Range(1u, 100u))
      ->capture_default_str();
  cmd->add_option("--requests-out", args->requests_out,
                  "Write one JSON line per request: its usable blocks' hashes (as events publish them), "
                  "events published before its lookup, blocks hit");
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
    std::unique_ptr<VllmKvEventPublisher> publisher;
    if (!args->kv_endpoint.empty()) {
      VllmKvEventOptions eo;
      eo.endpoint = args->kv_endpoint;
      eo.replay_endpoint = args->kv_replay;
      eo.topic = args->kv_topic.empty() ? DefaultKvEventTopic(args->options.spec.name) : args->kv_topic;
      auto hash = ParseKvEventHashEncoding(args->kv_hash);
      if (!hash.ok()) {
        exit_code = Fail(hash.status());
        return;
      }
      eo.hash = *hash;
      auto p = VllmKvEventPublisher::Start(eo);
      if (!p.ok()) {
        exit_code = Fail(p.status());
        return;
      }
      publisher = std::move(p).value();
    } else if (args->kv_vs_off || args->kv_hold_ms != 0) {
      exit_code = Fail(Status::InvalidArgument("--kv-events-vs-off and --kv-events-hold-ms need --kv-events-endpoint"));
      return;
    }
    // --kv-events-vs-off: pairs of replays with events off and on, the order alternating, before
    // the run that reports; each pair gives a blocks/s ratio.
    std::vector<double> ratios, on_rates, off_rates, cpu_ratios;
    for (uint32_t i = 0; args->kv_vs_off && i < args->kv_rounds; ++i) {
      bench::ReplayOptions off = args->options, on = args->options;
      off.progress = on.progress = nullptr;
      on.kv_events = publisher.get();
      const bool on_first = i % 2 == 1;
      auto a = bench::RunReplay(*trace, on_first ? on : off);
      auto b = a.ok() ? bench::RunReplay(*trace, on_first ? off : on) : a;
      if (!b.ok()) {
        exit_code = Fail(b.status());
        return;
      }
      const double r_on = (on_first ? *a : *b).BlocksPerSecond(), r_off = (on_first ? *b : *a).BlocksPerSecond();
      on_rates.push_back(r_on);
      off_rates.push_back(r_off);
      ratios.push_back(r_off > 0 ? r_on / r_off : 0.0);
      const double c_on = (on_first ? *a : *b).BlocksPerCpuSecond(), c_off = (on_first ? *b : *a).BlocksPerCpuSecond();
      cpu_ratios.push_back(c_off > 0 ? c_on / c_off : 0.0);
    }
    std::ofstream requests_out;
    if (!args->requests_out.empty()) {
      requests_out.open(args->requests_out, std::ios::trunc);
      if (!requests_out) {
        exit_code = Fail(Status::IOError(fmt::format("cannot write {}", args->requests_out)));
        return;
      }
      const bool bytes = args->kv_hash == "bytes";
      args->options.on_request = [&requests_out, bytes](const bench::ReplayRequestRecord& rec) {
        nlohmann::json line;
        line["i"] = rec.index;
        nlohmann::json hashes = nlohmann::json::array();
        for (const BlockDigest& d : rec.digests) {
          if (bytes) {
            hashes.push_back(d.hash.ToHex());
          } else {
            hashes.push_back(d.hash.lo);
          }
        }
        line["hashes"] = std::move(hashes);
        line["events_before"] = rec.events_before;
        line["hit_blocks"] = rec.hit_blocks;
        requests_out << line.dump() << '\n';
      };
    }
    args->options.kv_events = publisher.get();
    auto r = bench::RunReplay(*trace, args->options);
    args->options.on_request = nullptr;
    args->options.kv_events = nullptr;
    if (requests_out.is_open()) requests_out.close();
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    nlohmann::json j = bench::ReplayResultToJson(*r, args->options);
    j["trace"] = args->trace;
    j["load_seconds"] = load_seconds;
    if (publisher) {
      publisher->Flush();
      const VllmKvEventStats st = publisher->Stats();
      j["kv_events"] = {{"events", r->kv_events},
                        {"token_ids", args->options.kv_event_token_ids},
                        {"batches", st.published_batches},
                        {"dropped", st.dropped_events},
                        {"next_sequence", st.next_sequence},
                        {"topic", publisher->options().topic}};
      if (!ratios.empty()) {
        std::vector<double> sorted = ratios;
        std::sort(sorted.begin(), sorted.end());
        const size_t n = sorted.size();
        j["kv_events"]["blocks_per_s_off"] = off_rates;
        j["kv_events"]["blocks_per_s_on"] = on_rates;
        j["kv_events"]["on_vs_off_pairs"] = ratios;
        j["kv_events"]["on_vs_off"] = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
        j["kv_events"]["on_vs_off_min"] = sorted.front();
        j["kv_events"]["on_vs_off_max"] = sorted.back();
        // Blocks per CPU-second of the whole process (the publisher's thread included).
        std::sort(cpu_ratios.begin(), cpu_ratios.end());
        j["kv_events"]["cpu_on_vs_off"] = n % 2 ? cpu_ratios[n / 2] : (cpu_ratios[n / 2 - 1] + cpu_ratios[n / 2]) / 2;
      }
    }
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
    // After the results (a subscriber reading them knows what to wait for), replay stays served.
    auto hold = [&] {
      std::fflush(stdout);
      if (publisher && args->kv_hold_ms) std::this_thread::sleep_for(std::chrono::milliseconds(args->kv_hold_ms));
    };
    if (args->json) {
      std::printf("%s\n", j.dump(2).c_str());
      hold();
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
    if (j.contains("kv_events")) {
      const auto& e = j["kv_events"];
      std::printf("KV events (vLLM wire, topic %s): %llu events in %llu batches, %llu dropped\n",
                  e["topic"].get<std::string>().c_str(), static_cast<unsigned long long>(e["events"].get<uint64_t>()),
                  static_cast<unsigned long long>(e["batches"].get<uint64_t>()),
                  static_cast<unsigned long long>(e["dropped"].get<uint64_t>()));
      if (e.contains("on_vs_off")) {
        for (size_t i = 0; i < e["on_vs_off_pairs"].size(); ++i) {
          std::printf("events on %.2f M blocks/s, off %.2f M blocks/s: %.3fx\n",
                      e["blocks_per_s_on"][i].get<double>() / 1e6, e["blocks_per_s_off"][i].get<double>() / 1e6,
                      e["on_vs_off_pairs"][i].get<double>());
        }
        std::printf("events on/off, median of %zu pairs (min-max): %.3fx (%.3f-%.3f)\n", e["on_vs_off_pairs"].size(),
                    e["on_vs_off"].get<double>(), e["on_vs_off_min"].get<double>(), e["on_vs_off_max"].get<double>());
        std::printf("blocks per CPU-second (every thread), on/off, median: %.3fx\n", e["cpu_on_vs_off"].get<double>());
      }
    }
    hold();
  });
}

}  // namespace sparsekv::cli
