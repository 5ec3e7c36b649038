// Metrics: the daemon's counters and latency histograms, rendered in the Prometheus text
// format for the /metrics endpoint. Lock-free to update (relaxed atomics); Render() takes a
// snapshot that is consistent per series, not across series. Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "protocol/wire.h"

namespace sparsekv::server {

// Latency histogram with fixed exponential buckets from 10 us to ~10 s.
class LatencyHistogram {
 public:
  static constexpr int kBuckets = 20;  // upper bounds 10us * 2^i
  void Observe(double seconds);
  // Appends `name_bucket{...,le="..."}` lines, `_sum` and `_count` for label set `labels`.
  void Render(const std::string& name, const std::string& labels, std::string& out) const;
  static double UpperBound(int i) { return 10e-6 * static_cast<double>(1u << i); }

 private:
  std::array<std::atomic<uint64_t>, kBuckets + 1> counts_{};  // last: +Inf
  std::atomic<uint64_t> sum_ns_{0};
};

class Metrics {
 public:
  static constexpr int kOps = wire::kMaxOpcode + 1;

  void Request(wire::Opcode op, double seconds, bool error);
  void Hits(uint64_t n) { hits_.fetch_add(n, std::memory_order_relaxed); }
  void Misses(uint64_t n) { misses_.fetch_add(n, std::memory_order_relaxed); }
  void BytesIn(uint64_t n) { bytes_in_.fetch_add(n, std::memory_order_relaxed); }
  void BytesOut(uint64_t n) { bytes_out_.fetch_add(n, std::memory_order_relaxed); }
  void ConnectionOpened() { connections_.fetch_add(1, std::memory_order_relaxed); connections_total_.fetch_add(1, std::memory_order_relaxed); }
  void ConnectionClosed() { connections_.fetch_sub(1, std::memory_order_relaxed); }
  void ConnectionRejected() { rejected_.fetch_add(1, std::memory_order_relaxed); }
  void BadFrame() { bad_frames_.fetch_add(1, std::memory_order_relaxed); }
  void AuthFailure() { auth_failures_.fetch_add(1, std::memory_order_relaxed); }
  void SlowClientDropped() { slow_clients_.fetch_add(1, std::memory_order_relaxed); }
  void HandshakeTimedOut() { handshake_timeouts_.fetch_add(1, std::memory_order_relaxed); }
  void FrameTimedOut() { frame_timeouts_.fetch_add(1, std::memory_order_relaxed); }
  void IdleConnectionReplaced() { replaced_.fetch_add(1, std::memory_order_relaxed); }
  void BackpressurePause() { backpressure_.fetch_add(1, std::memory_order_relaxed); }
  void SharedMemoryDenied() { shm_denied_.fetch_add(1, std::memory_order_relaxed); }
  // Write leases (PUT_LEASE): items leased, leases refused at the namespace's quota, leases
  // taken back uncommitted, commits whose bytes failed their check (never stored).
  void WriteLeaseGiven(uint64_t items) { leased_items_.fetch_add(items, std::memory_order_relaxed); }
  void WriteLeaseRefused() { lease_refused_.fetch_add(1, std::memory_order_relaxed); }
  void WriteLeaseExpired() { lease_expired_.fetch_add(1, std::memory_order_relaxed); }
  void WriteLeaseTorn() { lease_torn_.fetch_add(1, std::memory_order_relaxed); }
  // Values received straight into room in the host tier (put_in_place_bytes: PUT frames and
  // RESP SETs), whether or not they were then stored.
  void PutInPlace() { put_in_place_.fetch_add(1, std::memory_order_relaxed); }
  // Values clients read from the arena themselves (local reads), as their TOUCH frames report
  // them: `held` of them still held by the host tier.
  void LocalReads(uint64_t held) { local_reads_.fetch_add(held, std::memory_order_relaxed); }

  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  uint64_t bad_frames() const { return bad_frames_.load(std::memory_order_relaxed); }
  int64_t connections() const { return connections_.load(std::memory_order_relaxed); }

  // Prometheus text; `extra` appends further series (per-tier gauges, evictions, ...).
  std::string Render(const std::function<void(std::string&)>& extra) const;

 private:
  std::array<std::atomic<uint64_t>, kOps> requests_{};
  std::array<std::atomic<uint64_t>, kOps> errors_{};
  std::array<LatencyHistogram, kOps> latency_{};
  std::atomic<uint64_t> hits_{0}, misses_{0}, bytes_in_{0}, bytes_out_{0};
  std::atomic<int64_t> connections_{0};
  std::atomic<uint64_t> connections_total_{0}, rejected_{0}, bad_frames_{0}, auth_failures_{0}, slow_clients_{0};
  std::atomic<uint64_t> leased_items_{0}, lease_refused_{0}, lease_expired_{0}, lease_torn_{0};
  std::atomic<uint64_t> put_in_place_{0};
  std::atomic<uint64_t> local_reads_{0};
  std::atomic<uint64_t> handshake_timeouts_{0}, frame_timeouts_{0}, replaced_{0}, backpressure_{0}, shm_denied_{0};
};

}  // namespace sparsekv::server
