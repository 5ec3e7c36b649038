#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "cli/registry.h"
#include "cli/model_options.h"
#include "sparsekv/memory_planner.h"

namespace sparsekv::cli {

SPARSEKV_CLI_COMMAND(plan) {
  struct Args {
    ModelOptions model;
    uint64_t batch = 1;
    uint64_t seq_len = 0;
    uint64_t budget_bytes = 0;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("plan", "How much memory a cache needs, or how many tokens fit a budget");
  args->model.AddTo(cmd);
  cmd->add_option("--batch", args->batch, "Number of sequences")->capture_default_str();
  auto* seq = cmd->add_option("--seq-len", args->seq_len, "Tokens per sequence");
  auto* budget = cmd->add_option("--budget-bytes", args->budget_bytes, "Answer how many tokens fit in this many bytes");
  seq->excludes(budget);
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &exit_code, seq, budget] {
    if (seq->count() == 0 && budget->count() == 0) {
      exit_code = Fail(Status::InvalidArgument("plan needs --seq-len (with --batch) or --budget-bytes"));
      return;
    }
    auto spec = args->model.Load();
    if (!spec.ok()) {
      exit_code = Fail(spec.status());
      return;
    }
    auto plan = budget->count() ? PlanForBudget(*spec, args->model.block_tokens, args->budget_bytes, args->batch)
                                : PlanForSequences(*spec, args->model.block_tokens, args->batch, args->seq_len);
    if (!plan.ok()) {
      exit_code = Fail(plan.status());
      return;
    }
    std::string out = args->json ? MemoryPlanToJson(*plan) + "\n" : MemoryPlanToTable(*plan);
    std::fputs(out.c_str(), stdout);
  });
}

}  // namespace sparsekv::cli
