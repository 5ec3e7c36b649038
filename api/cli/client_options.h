// Options of the subcommands that talk to sparsekvd: --addr, --namespace, --token, and block
// keys given as text (hashed) or as 32 hex digits.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "sparsekv/client.h"

namespace sparsekv::cli {

struct ClientArgs {
  std::string addr = "127.0.0.1:7420";
  std::string namespace_name = "default";
  std::string token;
  bool no_shared_memory = false;

  void AddTo(CLI::App* app);
  Result<std::unique_ptr<Client>> Connect() const;
};

// A block hash from --key TEXT (XXH3-128 of the text) or --hash HEX (32 hex digits).
Result<WireBlockHash> HashFromKey(const std::string& text);
Result<WireBlockHash> HashFromHex(const std::string& hex);
std::string HashToHex(const WireBlockHash& h);
std::string_view TierName(BlockTier t);

}  // namespace sparsekv::cli
