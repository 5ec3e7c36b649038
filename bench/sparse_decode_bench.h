// `sparsekv bench sparse-decode`: decode steps over one long sequence whose sparse cache (V3.2's
// MLA latent, V4's CSA entries) lives in a lower tier, with a per-layer working set in L1 that
// holds --l1-fraction of the entries; against the same steps reading the whole cache resident,
// in the same run, with every output compared bit for bit. The indexer query drifts so that
// consecutive selections overlap by about --overlap (the overlap reported is the one measured
// from the indexer's own selections). With --tier ssd each missing entry is one 4 KiB O_DIRECT
// read (SsdEntryFetcher), at the tier's queue depth of 16. With --tier daemon the entries come
// from sparsekvd in this process over a Unix socket (DaemonEntryFetcher: one GET_RANGES per
// layer and step); daemon-ssd puts most of the values on its SSD tier.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct SparseDecodeBenchOptions {
  // A model preset with a sparse cache: deepseek-v3.2-exp or deepseek-v4-flash.
  std::string model = "deepseek-v3.2-exp";
  // fp8, c8 (V3.2 only) or bf16. Default: fp8.
  std::string precision = "fp8";
  // Tokens of context. Default: 65,536.
  uint64_t context = 65536;
  // Share of the sparse cache's entries the working set holds (at least top-k). Default: 0.1.
  double l1_fraction = 0.1;
  // Decode steps measured (one query token each), after one step that fills the working set.
  uint32_t steps = 64;
  // Layers simulated; every layer costs the same, so a few stand for the model. Default: 2.
  uint32_t layers = 2;
  // Target overlap of consecutive selections. Default: 0.9.
  double overlap = 0.9;
  // Where the sparse cache lives: host, ssd, daemon or daemon-ssd. Default: host.
  std::string tier = "host";
  // --tier ssd, daemon-ssd: a directory for the SSD tier's files (removed afterwards).
  std::string dir;
  // Entries ranked past the top-k that each step prefetches, per layer, on a thread of their own
  // while the kernel runs (the sparse path's indexer then ranks top-k + this many; the
  // resident path keeps its own top-k run). Default: 0 (none).
  uint32_t prefetch = 0;
  // Threads of the kernels. Default: 1.
  uint32_t threads = 1;
  uint32_t seed = 1;
};

// {"measured_overlap", "bytes_fetched_per_step", "working_set_hit_ratio", "step_seconds",
//  "resident_step_seconds", "step_vs_resident", "full_restore_seconds", "l1_bytes_per_token",
//  "resident_l1_bytes_per_token", "l1_vs_resident", "outputs_identical", components and shape}.
Result<nlohmann::json> RunSparseDecodeBench(const SparseDecodeBenchOptions& options);

}  // namespace sparsekv::bench
