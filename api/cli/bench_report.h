// ReportBench for the bench commands: the progress line (bench/progress.h) is cleared first,
// since the report follows on the same terminal.
#pragma once

#include "cli/model_options.h"
#include "progress.h"

namespace sparsekv::cli {

inline const nlohmann::json* ReportBenchAfterProgress(const Result<nlohmann::json>& r, bool json, int& exit_code) {
  bench::ProgressStop();
  return ReportBench(r, json, exit_code);
}

}  // namespace sparsekv::cli
