#include "server/metrics.h"

#include <fmt/format.h>

#include <cctype>

namespace sparsekv::server {
namespace {

std::string OpLabel(int op) {
  std::string s(wire::OpcodeName(static_cast<wire::Opcode>(op)));
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

void LatencyHistogram::Observe(double seconds) {
  int i = 0;
  while (i < kBuckets && seconds > UpperBound(i)) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
}

void LatencyHistogram::Render(const std::string& name, const std::string& labels, std::string& out) const {
  uint64_t cumulative = 0;
  for (int i = 0; i <= kBuckets; ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    const std::string le = i == kBuckets ? "+Inf" : fmt::format("{:g}", UpperBound(i));
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, le, cumulative);
  }
  out += fmt::format("{}_sum{{{}}} {:.9f}\n", name, labels, sum_ns_.load(std::memory_order_relaxed) / 1e9);
  out += fmt::format("{}_count{{{}}} {}\n", name, labels, cumulative);
}

void Metrics::Request(wire::Opcode op, double seconds, bool error) {
  const int i = static_cast<int>(op);
  if (i <= 0 || i >= kOps) return;
  requests_[i].fetch_add(1, std::memory_order_relaxed);
  if (error) errors_[i].fetch_add(1, std::memory_order_relaxed);
  latency_[i].Observe(seconds);
}

std::string Metrics::Render(const std::function<void(std::string&)>& extra) const {
  std::string out;
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} counter\n{0} {2}\n", name, help, v);
  };
  out += "# HELP sparsekv_requests_total Requests served, by operation.\n# TYPE sparsekv_requests_total counter\n";
  for (int i = 1; i < kOps; ++i) {
    out += fmt::format("sparsekv_requests_total{{op=\"{}\"}} {}\n", OpLabel(i), requests_[i].load(std::memory_order_relaxed));
  }
  out += "# HELP sparsekv_request_errors_total Requests answered with an error, by operation.\n# TYPE sparsekv_request_errors_total counter\n";
  for (int i = 1; i < kOps; ++i) {
    out += fmt::format("sparsekv_request_errors_total{{op=\"{}\"}} {}\n", OpLabel(i), errors_[i].load(std::memory_order_relaxed));
  }
  out += "# HELP sparsekv_request_seconds Request latency inside the daemon, by operation.\n# TYPE sparsekv_request_seconds histogram\n";
  for (int i = 1; i < kOps; ++i) {
    if (static_cast<wire::Opcode>(i) == wire::Opcode::kEvent || static_cast<wire::Opcode>(i) == wire::Opcode::kError) continue;
    latency_[i].Render("sparsekv_request_seconds", fmt::format("op=\"{}\"", OpLabel(i)), out);
  }
  counter("sparsekv_hits_total", "Blocks found by GET and LOOKUP.", hits());
  counter("sparsekv_misses_total", "Blocks asked for and not found.", misses());
  counter("sparsekv_received_bytes_total", "Frame bytes received.", bytes_in_.load(std::memory_order_relaxed));
  counter("sparsekv_sent_bytes_total", "Frame bytes sent.", bytes_out_.load(std::memory_order_relaxed));
  counter("sparsekv_connections_total", "Connections accepted.", connections_total_.load(std::memory_order_relaxed));
  counter("sparsekv_connections_rejected_total", "Connections refused over the limit.", rejected_.load(std::memory_order_relaxed));
  counter("sparsekv_bad_frames_total", "Malformed frames (connection closed).", bad_frames());
  counter("sparsekv_auth_failures_total", "HELLOs refused.", auth_failures_.load(std::memory_order_relaxed));
  counter("sparsekv_slow_clients_dropped_total", "Connections closed for not reading their replies.",
          slow_clients_.load(std::memory_order_relaxed));
  counter("sparsekv_write_lease_items_total", "Values leased room in the host arena (PUT_LEASE).",
          leased_items_.load(std::memory_order_relaxed));
  counter("sparsekv_write_lease_refused_total", "Write leases refused at their namespace's quota.",
          lease_refused_.load(std::memory_order_relaxed));
  counter("sparsekv_write_lease_expired_total", "Write leases taken back uncommitted.",
          lease_expired_.load(std::memory_order_relaxed));
  counter("sparsekv_write_lease_torn_total", "Leased values whose commit failed its check (never stored).",
          lease_torn_.load(std::memory_order_relaxed));
  counter("sparsekv_put_in_place_total",
          "Values whose bytes were received straight into room in the host tier (put_in_place_bytes).",
          put_in_place_.load(std::memory_order_relaxed));
  counter("sparsekv_local_reads_total",
          "Values clients read straight from the host arena without a request (local reads), as reported, of those still held.",
          local_reads_.load(std::memory_order_relaxed));
  counter("sparsekv_handshake_timeouts_total", "Connections closed for not finishing HELLO in time, or as the "
          "oldest of too many handshakes.", handshake_timeouts_.load(std::memory_order_relaxed));
  counter("sparsekv_frame_timeouts_total", "Connections closed for a frame that did not arrive in time.",
          frame_timeouts_.load(std::memory_order_relaxed));
  counter("sparsekv_idle_connections_replaced_total",
          "Longest-idle connections closed to admit a new one at a connection limit.",
          replaced_.load(std::memory_order_relaxed));
  counter("sparsekv_backpressure_pauses_total",
          "Times a connection stopped reading because the buffered-bytes budget was spent.",
          backpressure_.load(std::memory_order_relaxed));
  counter("sparsekv_shared_memory_denied_total", "HELLOs that asked for shared memory past its daemon-wide limit.",
          shm_denied_.load(std::memory_order_relaxed));
  out += fmt::format("# HELP sparsekv_connections Open connections.\n# TYPE sparsekv_connections gauge\nsparsekv_connections {}\n",
                     connections());
  if (extra) extra(out);
  return out;
}

}  // namespace sparsekv::server
