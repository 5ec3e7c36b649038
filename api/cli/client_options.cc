#include "cli/client_options.h"

#include <fmt/format.h>

#include <cstring>

#include "allocator/xxhash_dispatch.h"

namespace sparsekv::cli {

void ClientArgs::AddTo(CLI::App* app) {
  app->add_option("--addr", addr, "Daemon address: HOST:PORT, or unix:PATH for the Unix socket")->capture_default_str();
  app->add_option("--namespace", namespace_name, "Namespace to open")->capture_default_str();
  app->add_option("--token", token, "Access token of the namespace");
  app->add_flag("--no-shared-memory", no_shared_memory, "Over unix:, move bytes through the socket");
}

Result<std::unique_ptr<Client>> ClientArgs::Connect() const {
  ClientOptions o;
  o.address = addr;
  o.namespace_name = namespace_name;
  o.token = token;
  o.client_name = "sparsekv-cli";
  o.shared_memory = !no_shared_memory;
  return Client::Connect(o);
}

Result<WireBlockHash> HashFromKey(const std::string& text) {
  const XXH128_hash_t h = XXH3_128bits(text.data(), text.size());
  WireBlockHash out;
  std::memcpy(out.data(), &h.low64, 8);
  std::memcpy(out.data() + 8, &h.high64, 8);
  return out;
}

Result<WireBlockHash> HashFromHex(const std::string& hex) {
  if (hex.size() != 32) return Status::InvalidArgument(fmt::format("hash '{}' is not 32 hex digits", hex));
  // Canonical form: hi 64 bits then lo 64 bits (as BlockHash::ToHex).
  uint64_t hi = 0, lo = 0;
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    uint64_t v;
    if (c >= '0' && c <= '9') v = c - '0';
    else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
    else return Status::InvalidArgument(fmt::format("hash '{}' has a non-hex digit '{}'", hex, c));
    uint64_t& part = i < 16 ? hi : lo;
    part = (part << 4) | v;
  }
  WireBlockHash out;
  std::memcpy(out.data(), &lo, 8);
  std::memcpy(out.data() + 8, &hi, 8);
  return out;
}

std::string HashToHex(const WireBlockHash& h) {
  uint64_t lo, hi;
  std::memcpy(&lo, h.data(), 8);
  std::memcpy(&hi, h.data() + 8, 8);
  return fmt::format("{:016x}{:016x}", hi, lo);
}

std::string_view TierName(BlockTier t) {
  switch (t) {
    case BlockTier::kAbsent: return "absent";
    case BlockTier::kHost: return "host";
    case BlockTier::kSsd: return "ssd";
    case BlockTier::kRocksDb: return "rocksdb";
    case BlockTier::kRemote: return "remote";
  }
  return "?";
}

}  // namespace sparsekv::cli
