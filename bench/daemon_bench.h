// `sparsekv bench daemon`: PUT and GET throughput and GET latency of sparsekvd from N clients
// (one connection each, one request in flight each, as redis-benchmark's clients), driven by
// event loops on T threads, over TCP or the Unix socket's shared-memory path, with Redis
// measured in the same run as the baseline when asked.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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
  // With `spawn`: the daemon publishes KV events on vLLM's wire (server::TierEventTracker over
  // an ipc:// socket, as sparsekvd's "kv_events" does) and a subscriber thread here reads them
  // all. The result gains kv_events: {batches, events, received_batches}. Default: false.
  bool kv_events = false;

  // --batch (RunDaemonBatchBench): one client's batch GET into its own memory.
  bool batch = false;
  // (value bytes, values) of each batch. Default: 64 KiB x 64, 1 MiB x 16, 6 MiB x 16.
  std::vector<std::pair<uint64_t, uint64_t>> batch_sizes = {{64u << 10, 64}, {1u << 20, 16}, {6u << 20, 16}};
  // Interleaved rounds of every method, and seconds each. Defaults: 5, 0.3.
  int rounds = 5;
  double round_seconds = 0.3;
  // Blocks of a DeepSeek V3.2 fp8 prefix to restore through the daemon, against the in-process
  // `bench restore` of the same blocks (0: none; 1024 blocks are 6.3 GB). Default: 0.
  uint32_t restore_blocks = 0;
  // ClientOptions::spin of the batch clients, in microseconds. Default: 100.
  uint32_t spin_us = 100;
};

Result<nlohmann::json> RunDaemonBench(const DaemonBenchOptions& options);

// `sparsekv bench daemon --batch`: a daemon started here (host tier in a memfd, one namespace),
// one client over TCP and one over the Unix socket with shared memory, each batch of
// batch_sizes read with Client::GetInto into warm buffers, interleaved with memcpy of the same
// bytes into the same destination and a loopback TCP socket pair carrying them. Keys: cpu,
// rounds, batch: [{value_bytes, values, shm_bytes_per_s, tcp_bytes_per_s, memcpy_bytes_per_s,
// socket_bytes_per_s, faults_per_gb (the larger of tcp_ and shm_faults_per_gb), shm_vs_memcpy,
// tcp_vs_socket, put_shm_bytes_per_s, put_tcp_bytes_per_s, samples}], and with restore_blocks
// restore: {blocks, block_bytes, in_process_seconds, daemon_shm_first_seconds,
// daemon_shm_seconds, daemon_tcp_seconds, daemon_shm_vs_in_process, ...}. Every byte received is
// checked outside the timing.
Result<nlohmann::json> RunDaemonBatchBench(const DaemonBenchOptions& options);

}  // namespace sparsekv::bench
