// Runs a shell command for an end-to-end test and captures its exit code, stdout and stderr
// (through files in a per-process scratch folder, removed afterwards).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace sparsekv::testing {

struct CommandOutcome {
  int exit_code = -1;  // -1 when the command did not exit normally
  std::string out;
  std::string err;
};

inline std::string ReadWholeFile(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// `tag` names the scratch folder, so concurrent test programs do not share one.
inline CommandOutcome RunCommand(const std::string& command, const std::string& tag) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("sparsekv_" + tag + "_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string cmd =
      command + " >" + (dir / "out").string() + " 2>" + (dir / "err").string();
  const int rc = std::system(cmd.c_str());
  CommandOutcome r;
  r.exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = ReadWholeFile(dir / "out");
  r.err = ReadWholeFile(dir / "err");
  std::filesystem::remove_all(dir);
  return r;
}

}  // namespace sparsekv::testing
