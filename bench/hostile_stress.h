// `sparsekv stress hostile`: a black-box attack harness against a running sparsekvd. It speaks
// the wire protocol (api/PROTOCOL.md) over raw sockets the way a broken or malicious client
// would, while a well-behaved client measures what the attacks cost everyone else.
//
// Phases. A baseline without attack, then each attack in turn, each phase `seconds` / (attacks
// + 1) long. An attack's preparation (storing the keys it reads) runs before its phase and is
// not timed. After each phase the attack's sockets are all closed, the daemon gets
// `settle_seconds`, and must be alive: its process exists (when its pid is known) and a fresh
// connection answers PING within max(3 s, call_timeout_seconds). A phase after which it is not
// counts in `daemon_deaths`; `daemon_exits` counts those where the process was gone, which
// ends the run. A daemon that is there but does not answer is waited for (`recover_seconds`)
// before the next phase; daemon_answered_again_after_seconds says when it did, counted from
// the end of the phase.
//
// The good client, in every phase (baseline included): one sparsekv::Client over the same
// address (shared memory on over a Unix socket) loops PUT of a 64 KiB pseudo-random bundle under
// one of 64 keys it owns, GET of it (every byte compared), LOOKUP of it. Every op's latency is
// kept (p50/p99/max per phase, in microseconds). Errors: a failed call, a wrong byte, a
// connection that broke (it reconnects). A NotFound right after its own acknowledged PUT is a
// miss (`good_misses`), not an error: a cache may evict. Every 250 ms a fresh client connects,
// PINGs and closes: a failure is a `new_connection_failures` and a good-client error too, since
// a new legitimate client must be admitted whatever the attackers hold.
//
// The daemon's memory: its VmRSS (/proc/<pid>/status), sampled every 20 ms, gives each phase's
// start and peak (the peak runs on until the daemon answers again after the phase). The pid comes
// from `pid`, else from SO_PEERCRED over a Unix socket; over TCP without `pid` the RSS fields are
// null.
//
// Attacks (each bounded by its phase; raw sockets are non-blocking and every wait is a poll
// with a deadline, so nothing here hangs on a daemon that stopped answering):
//   garbage        connections that send random bytes, a valid frame with a bit flipped, a
//                  truncated frame, a bad header checksum, a request before HELLO, or HELLO
//                  then a frame of a random opcode and payload; read what comes back, close.
//   big-claim      headers claiming a 64 MiB payload (HELLO or PUT) before any HELLO, then
//                  4 KiB of it, then silence; the daemon should close them (stayed open > 10 s
//                  is reported) without holding the claimed memory.
//   slowloris      HELLO one byte per 100 ms, then (when answered) a PUT the same way.
//   non-reader     pipelined GETs of 16 stored 1 MiB keys, never reading a reply.
//   idle-flood     up to 300 connections HELLO and sit idle; fresh clients must still get in.
//   shrink-memfd   (Unix socket only) a shared-memory HELLO, then ftruncate/fallocate/seals on
//                  the descriptors received, SHM_PUT slots across and past the area, SHM_GET.
//   dying-viewer   (Unix socket only) shared-memory sessions that take SHM_VIEW leases of 16
//                  stored 1 MiB values (each lent byte compared through the arena), send an
//                  SHM_GET_OVERLAP and a bogus SHM_VIEW_END, and vanish holding the leases; a
//                  fresh session must then be lent all 16 again (no pin left behind).
//   oversized-get  a GET of 1000 hashes (64 stored 1 MiB keys repeated): no reply frame may be
//                  larger than the HELLO reply's max_payload_bytes; and Client::Get of the same
//                  1000 must return every bundle intact.
//   big-frames     authenticated PUT headers claiming ~60 MiB, then 32 MiB of payload each as
//                  fast as the daemon takes it, then a stall (a daemon-wide buffer budget).
//   hello-flood    connections that send nothing (a handshake deadline should close them).
//
// Must-be-zero findings: frames_above_limit, ftruncate_succeeded, fallocate_succeeded,
// arena_write_mapped, client_get_errors, view_wrong_bytes, pins_left_by_the_dead. `ok`: no
// daemon death, no good-client error, no finding. `target_met` adds worst_p99_ratio <= 3 (an attack phase's good-client p99 over the
// baseline's).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sparsekv/status.h"

namespace sparsekv::bench {

struct HostileStressOptions {
  // HOST:PORT or unix:PATH of a running daemon. Default: "127.0.0.1:7420".
  std::string addr = "127.0.0.1:7420";
  // Namespace and token of every HELLO, hostile or not. Default: "default", "".
  std::string namespace_name = "default";
  std::string token;
  // Total seconds of the phases (baseline and attacks), not counting preparation and settling.
  // Default: 60.
  double seconds = 60;
  // The daemon's pid, for its RSS and liveness; 0 finds it over a Unix socket (SO_PEERCRED).
  // Default: 0.
  int64_t pid = 0;
  // Attacks to run, by name (HostileAttackNames); empty runs every one that applies (not
  // shrink-memfd over TCP). Default: {}.
  std::vector<std::string> attacks;
  // Seed of keys, values and garbage; 0 draws one. Default: 0.
  uint64_t seed = 0;
  // Connections of each attack. Defaults: 64, 60, 32, 8, 300, 32, 200.
  uint32_t garbage_connections = 64;
  uint32_t big_claim_connections = 60;
  uint32_t slowloris_connections = 32;
  uint32_t non_reader_connections = 8;
  uint32_t idle_connections = 300;
  uint32_t big_frame_connections = 32;
  uint32_t hello_flood_connections = 200;
  // oversized-get: hashes in each GET (the 64 stored keys repeated). Default: 1000.
  uint32_t oversized_get_hashes = 1000;
  // Pause of each garbage connection's thread between two connections, so that the attack tests
  // the daemon rather than the scheduler of the machine both run on. Default: 10 ms.
  double garbage_pause_seconds = 0.010;
  // Time the daemon gets after a phase before the liveness check. Default: 0.5 s.
  double settle_seconds = 0.5;
  // A daemon that failed the liveness check is waited for up to this long before the next
  // phase (which would otherwise measure the previous attack's aftermath). Default: 30 s.
  double recover_seconds = 30;
  // Limit of each good-client call and connection attempt. Default: 5 s.
  double call_timeout_seconds = 5;
};

// The attacks, in the order they run: garbage, big-claim, slowloris, non-reader, idle-flood,
// shrink-memfd, dying-viewer, oversized-get, big-frames, hello-flood.
const std::vector<std::string>& HostileAttackNames();

// Runs the phases against the daemon at options.addr and returns:
//   {addr, pid (null if unknown), seconds, phase_seconds, seed, baseline: PHASE,
//    attacks: [PHASE + {p99_ratio, details}], skipped: [{name, why}], daemon_deaths,
//    daemon_exits, good_client_errors, worst_p99_ratio, findings, finding_counters, ok, target_met,
//    elapsed_seconds}
// where PHASE = {name, seconds, daemon_peak_rss_bytes, daemon_rss_start_bytes, good_ops,
//    good_p50_us, good_p99_us, good_max_us, good_errors, good_misses, good_reconnects,
//    new_connections, new_connection_failures, error_examples, daemon_alive, [daemon_state,
//    daemon_answered_again_after_seconds],
//    [note]}; the RSS fields are null when the pid is unknown, the latency ones when there was
//    no op.
// A daemon that dies ends the run (the attacks left are listed in `skipped`). Errors: bad
// options, or a daemon that does not answer at the start.
Result<nlohmann::json> RunHostileStress(const HostileStressOptions& options);

}  // namespace sparsekv::bench
