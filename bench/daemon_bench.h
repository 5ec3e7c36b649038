// `sparsekv bench daemon`: PUT and GET throughput and GET latency of sparsekvd from N clients
// (one connection each, one request in flight each, as redis-benchmark's clients), driven by
// event loops on T threads, over TCP or the Unix socket's shared-memory path, with Redis
// measured in the same run as the baseline when asked.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct DaemonBenchOptions {
  // HOST:PORT or unix:PATH of a running daemon; with `spawn`, "tcp" or "unix" picks the
  // transport of an in-process daemon. Default: "127.0.0.1:7420".
  std::string addr = "127.0.0.1:7420";
  std::string namespace_name = "default";
  std::string token;
  // Clients, one connection each, each with one request in flight. Default: 8.
  int clients = 8;
  // Threads driving them, each an event loop over its share of the clients (1 is how
  // redis-benchmark drives its clients; `clients` gives each client a thread of its own,
  // making blocking calls). Default: 1.
  int threads = 1;
  // Bytes of each value. Default: 65536.
  uint64_t value_bytes = 65536;
  // Seconds of the GET phase (the PUT phase takes a third of it). Default: 5.
  double seconds = 5;
  // Keys each client writes and then reads at random. Default: 64.
  uint32_t keys_per_client = 64;
  // Start a daemon in this process (host tier only) in a temporary directory. Default: false.
  bool spawn = false;
  // Also run redis-benchmark against a redis-server started here, same value size and clients.
  // Default: false.
  bool redis = false;
};

Result<nlohmann::json> RunDaemonBench(const DaemonBenchOptions& options);

}  // namespace sparsekv::bench
