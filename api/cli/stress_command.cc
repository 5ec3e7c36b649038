// `sparsekv stress offload`: SIGKILL the SSD tier's writer at random moments and check that
// nothing acknowledged is lost or returned corrupt (bench/offload_stress.h). The hidden
// `stress offload-child` is the process being killed.
#include <cstdio>
#include <memory>

#include "cli/model_options.h"
#include "cli/registry.h"
#include "offload_stress.h"

namespace sparsekv::cli {

SPARSEKV_CLI_COMMAND(stress) {
  CLI::App* stress = app.add_subcommand("stress", "Crash and fault stress tests");
  stress->require_subcommand(1);

  struct Args {
    bench::OffloadStressOptions options;
    std::string durability = "fdatasync";
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = stress->add_subcommand("offload",
                                         "Kill a writer of the SSD tier K times, then verify every "
                                         "acknowledged bundle and bit-flip detection");
  cmd->add_option("--dir", args->options.dir,
                  "Working directory (a subdirectory is created and removed)")
      ->required();
  cmd->add_option("--seconds", args->options.seconds, "Total run time of the writer")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  cmd->add_option("--kill-cycles", args->options.kill_cycles, "SIGKILLs and restarts")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  AddDurabilityOption(cmd, args->durability);
  cmd->add_option("--flip-bundles", args->options.flip_bundles,
                  "Bundles damaged in the bit-flip phase")
      ->capture_default_str();
  cmd->add_option("--seed", args->options.seed, "Seed (0: random)")->capture_default_str();
  cmd->add_flag("--keep", args->options.keep, "Keep the working directory");
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code] {
    if (!ParseDurabilityOption(args->durability, args->options.durability, exit_code)) return;
    auto r = bench::RunOffloadStress(args->options);
    if (!r.ok()) {
      exit_code = Fail(r.status());
      return;
    }
    const auto& j = *r;
    if (args->json) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf(
          "acknowledged %llu  lost %llu  corrupt_returned %llu  stale_returned %llu  "
          "detected_corrupt %llu  "
          "(%d kills, %.1f s)\nbit flips: %llu injected, %llu detected, %llu returned\n%s\n",
          static_cast<unsigned long long>(j["acknowledged"].get<uint64_t>()),
          static_cast<unsigned long long>(j["lost"].get<uint64_t>()),
          static_cast<unsigned long long>(j["corrupt_returned"].get<uint64_t>()),
          static_cast<unsigned long long>(j["stale_returned"].get<uint64_t>()),
          static_cast<unsigned long long>(j["detected_corrupt"].get<uint64_t>()),
          args->options.kill_cycles, j["seconds"].get<double>(),
          static_cast<unsigned long long>(j["flip"]["injected"].get<uint64_t>()),
          static_cast<unsigned long long>(j["flip"]["detected"].get<uint64_t>()),
          static_cast<unsigned long long>(j["flip"]["returned"].get<uint64_t>()),
          j["ok"].get<bool>() ? "OK" : "FAILED");
    }
    if (!j["ok"].get<bool>()) exit_code = 1;
  });

  struct ChildArgs {
    bench::OffloadStressChildOptions options;
    std::string durability = "fdatasync";
  };
  auto child = std::make_shared<ChildArgs>();
  CLI::App* c = stress->add_subcommand("offload-child", "The process `stress offload` kills");
  c->group("");  // hidden: started by `stress offload` only
  c->add_option("--dir", child->options.dir)->required();
  c->add_option("--ack-fd", child->options.ack_fd)->required();
  c->add_option("--incarnation", child->options.incarnation)->required();
  c->add_option("--seed", child->options.seed);
  AddDurabilityOption(c, child->durability);
  c->callback([child, &exit_code] {
    if (!ParseDurabilityOption(child->durability, child->options.durability, exit_code)) return;
    const Status s = bench::RunOffloadStressChild(child->options);
    if (!s.ok()) exit_code = Fail(s.WithContext("stress offload-child"));
  });
}

}  // namespace sparsekv::cli
