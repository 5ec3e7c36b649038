// `sparsekv stress offload`: crash-consistency stress of the SSD tier.
//
// A child process (the same binary, re-executed with a hidden subcommand) puts, overwrites,
// erases and reads bundles through the SSD tier and reports every intent and acknowledgement
// to the parent through a pipe. The parent SIGKILLs it at random moments `kill_cycles` times,
// restarting it each time (each incarnation learns what its predecessors acknowledged from a
// state file), then opens the tier itself and checks every key against what was acknowledged.
// A last phase flips one bit inside the records of some bundles in the slab files and checks
// that every damaged bundle is detected and none is returned.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sparsekv/status.h"
#include "sparsekv/tier.h"

namespace sparsekv::bench {

struct OffloadStressOptions {
  // Working directory; the bench creates and removes a subdirectory. Default: "" (must be set).
  std::string dir;
  // Total seconds of child run time, split across the kill cycles. Default: 10.
  double seconds = 10;
  // SIGKILLs (and restarts) of the child. Default: 5.
  int kill_cycles = 5;
  // The SSD tier's durability in the child. Default: kFdatasync.
  Durability durability = Durability::kFdatasync;
  // Bundles damaged in the bit-flip phase (0 skips it). Default: 32.
  uint32_t flip_bundles = 32;
  // Seed for sizes, operations and kill times; 0 draws one. Default: 0.
  uint64_t seed = 0;
  // Keep the directory afterwards (for a post-mortem). Default: false.
  bool keep = false;
  // How to start the child: argv[0] and the arguments before the child's own options.
  // Default: {"/proc/self/exe", "stress", "offload-child"}.
  std::vector<std::string> child_command = {"/proc/self/exe", "stress", "offload-child"};
};

// Keys: acknowledged, lost, corrupt_returned, stale_returned, detected_corrupt, verified,
// unacknowledged_found, kill_cycles, kills_during_io, child_reads, flip {injected, detected,
// returned}, seconds, durability, seed, ok (lost == corrupt_returned == stale_returned == 0
// and every flip detected).
Result<nlohmann::json> RunOffloadStress(const OffloadStressOptions& options);

struct OffloadStressChildOptions {
  std::string dir;
  int ack_fd = -1;
  uint32_t incarnation = 0;
  uint64_t seed = 1;
  Durability durability = Durability::kFdatasync;
};

// Runs until killed (or until the pipe closes); returns only on an error.
Status RunOffloadStressChild(const OffloadStressChildOptions& options);

}  // namespace sparsekv::bench
