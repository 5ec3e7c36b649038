// Kills and reaps the child processes a test started, however the test ends (an ASSERT that
// returns early included). Clear `pids` once the test has stopped them itself.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <vector>

namespace sparsekv::testing {

struct ProcessReaper {
  std::vector<pid_t> pids;
  ~ProcessReaper() {
    for (pid_t p : pids) {
      if (kill(p, 0) == 0) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
      }
    }
  }
};

}  // namespace sparsekv::testing
