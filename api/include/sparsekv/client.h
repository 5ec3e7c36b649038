// Client: one connection to sparsekvd (api/PROTOCOL.md), over TCP or a Unix socket.
//
// Every call has a synchronous form and an asynchronous form returning a std::future;
// asynchronous requests pipeline on the one connection and are matched to their responses by
// request id. Over a Unix socket with `shared_memory`, the client maps a staging area of its
// own session, passed by the daemon with SCM_RIGHTS: PUT and GET then move only metadata over
// the socket and bundle bytes through shared memory (a bundle larger than half the area falls
// back to the socket).
//
// Thread safety: all methods are thread-safe. One reader thread per client delivers responses;
// event callbacks run on it and must not block.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv {

// A 128-bit block hash as bytes on the wire (see block_hash.h for how hashes are made).
using WireBlockHash = std::array<std::byte, 16>;

struct ClientOptions {
  // "HOST:PORT" for TCP or "unix:PATH" for the Unix socket. Default: "127.0.0.1:7420".
  std::string address = "127.0.0.1:7420";
  // Namespace to open and its access token. Default: "default", "".
  std::string namespace_name = "default";
  std::string token;
  // Name the daemon logs for this client. Default: "sparsekv-client".
  std::string client_name = "sparsekv-client";
  // Unix socket only: move bundles through a shared staging area. Default: true.
  bool shared_memory = true;
  // Limit for connecting and for each synchronous call. Default: 30 s.
  std::chrono::milliseconds timeout{30000};
};

enum class BlockTier : uint8_t { kAbsent = 0, kHost = 1, kSsd = 2, kRocksDb = 3 };

struct LookupResult {
  uint32_t prefix_blocks = 0;      // resumable prefix length, in blocks
  std::vector<BlockTier> tiers;    // one per hash asked about
};

struct BundleRef {
  WireBlockHash hash{};
  std::span<const std::byte> bytes;
};

struct GetResult {
  Status status;                   // NotFound, Corruption, ... per item
  std::vector<std::byte> bytes;    // the bundle when status is OK
};

struct EventNotice {
  uint8_t type = 0;                // 1 stored, 2 removed, 3 all cleared
  BlockTier tier = BlockTier::kAbsent;
  uint64_t sequence = 0;
  std::vector<WireBlockHash> hashes;
};
using EventCallback = std::function<void(const EventNotice&)>;

class Client {
 public:
  // Connects and says HELLO. Errors: bad address, refused, PermissionDenied (namespace/token).
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  Result<LookupResult> Lookup(std::span<const WireBlockHash> hashes);
  Result<std::vector<Status>> Put(std::span<const BundleRef> bundles);
  Result<std::vector<GetResult>> Get(std::span<const WireBlockHash> hashes);
  Result<std::vector<Status>> Pin(std::span<const WireBlockHash> hashes, uint8_t priority);
  Result<std::vector<Status>> Unpin(std::span<const WireBlockHash> hashes);
  Result<std::vector<Status>> Delete(std::span<const WireBlockHash> hashes);
  Result<std::string> Stats();  // JSON
  Status Ping();
  // Starts event delivery to `callback` (on the reader thread).
  Status Subscribe(EventCallback callback);

  std::future<Result<LookupResult>> LookupAsync(std::vector<WireBlockHash> hashes);
  std::future<Result<std::vector<Status>>> PutAsync(std::vector<BundleRef> bundles);
  std::future<Result<std::vector<GetResult>>> GetAsync(std::vector<WireBlockHash> hashes);

  bool shared_memory() const;
  uint64_t session_id() const;
  uint32_t block_tokens() const;
  uint32_t max_payload_bytes() const;

  class Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsekv
