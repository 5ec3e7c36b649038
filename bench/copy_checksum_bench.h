// `sparsekv bench copy-checksum`: CopyWithRecordChecksum (a copy that computes the record's
// XXH3-64 as it goes) against the two passes it replaced (a copy, then XXH3 over each 64 KiB
// chunk just copied, as Bundle::WriteRecord did) and against plain memcpy.
#pragma once

#include <nlohmann/json.hpp>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct CopyChecksumBenchOptions {
  double round_seconds = 0.2;
  int rounds = 5;
};

// Per value size (64 KiB, 1 MiB, 6 MiB) and destination span (4 MiB: the cache; 256 MiB:
// memory), bytes per second of: fused (the kernel chosen here), each kernel this CPU has,
// two_pass and memcpy, interleaved; and fused_vs_two_pass. Each kernel's result is checked
// against XXH3_64bits first.
Result<nlohmann::json> RunCopyChecksumBench(const CopyChecksumBenchOptions& options);

}  // namespace sparsekv::bench
