// `sparsekv stress daemon`: a black-box consistency stress of sparsekvd through the client
// library, optionally killing (SIGKILL) and restarting the daemon while it runs.
//
// The rule checked: a key's value is its last acknowledged PUT; after an acknowledged DELETE it
// is NotFound. A PUT or DELETE that failed, or was in flight when the daemon died, may or may
// not have taken effect, so its outcome is accepted too; nothing older than the last
// acknowledged version ever is. A NotFound where a value should be is a cache miss (the daemon
// evicts) and only counted, except in the verification pass after a restart (below).
//
// Clients: `clients` threads, each with its own connection, each owning `keys_per_client` keys
// (16-byte block hashes derived from seed, client and key index), so every key sees one
// operation at a time and the checker knows exactly what each GET may return. Each client
// first deletes its keys (so a daemon holding values of an earlier run with the same seed
// cannot confuse the checker), then loops: PUT a new version ~40%, GET of 1-4 keys ~40%,
// LOOKUP of 1-4 keys ~10%, DELETE ~10%; value sizes are log-uniform in [min, max]
// value bytes.
//
// Values describe themselves: a 48-byte header {magic, seed, client, key index, version, total
// length, XXH3-64 of the rest} followed by a pseudo-random filler derived from (seed, key,
// version), so every byte of a GET is checked, and a value filed under the wrong key, a torn
// value and an old version are told apart (DaemonStressChecker).
//
// Kill cycles: the daemon is SIGKILLed `kill_cycles` times at random moments and restarted
// (a sparsekvd child of this process with `spawn`, else `kill_command` / `restart_command`).
// Clients whose connection breaks meanwhile reconnect (those failures are `reconnects`, not
// errors), then GET every key they own once: a key whose last operation was an acknowledged
// PUT and that is NotFound is `lost`. In write-back mode the daemon acknowledges from host
// memory, so a kill loses what only memory held: `lost` is reported, and required to be 0 only
// with `expect_durable`.
//
// Working set and `lost`. A cache may also evict a value legitimately, which would read as
// lost. A kill cycle therefore counts lost keys only when the bytes acknowledged-live at the
// kill are at most half the daemon's durable capacity (its tiers other than host memory, from
// STATS): half, because an SSD tier rounds records up, grows its file in steps and keeps an old
// copy until its replacement is committed, so it may evict before it is byte-full. Misses of a
// cycle that did not fit are `lost_not_counted`. Keep the working set, about
//   clients × keys_per_client × (max - min) / ln(max / min)   (the mean of a log-uniform size)
// (`working_set_bytes` in the JSON), well under that: the defaults (4 × 64 keys of 4 KiB-1 MiB,
// about 47 MiB) against a 2 GiB SSD tier.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sparsekv/client.h"
#include "sparsekv/status.h"
#include "sparsekv/tier.h"
#include "sparsekv/tier_chain.h"

namespace sparsekv::bench {

struct DaemonStressOptions {
  // HOST:PORT or unix:PATH of a running daemon. With `spawn`: "tcp" or "unix" picks the
  // transport of the spawned daemon. "" means "127.0.0.1:7420", or "unix" with `spawn`.
  // Default: "".
  std::string addr;
  std::string namespace_name = "default";
  std::string token;
  // Unix socket only: move values through shared memory. Default: true.
  bool shared_memory = true;
  // Clients, one thread and one connection each. Default: 4.
  int clients = 4;
  // Seconds of load, not counting the time the daemon takes to come back after a kill.
  // Default: 10.
  double seconds = 10;
  // Operations per client at most (the loop is bounded by time and by this). Default: 10^7.
  uint64_t max_ops_per_client = 10'000'000;
  // Keys each client owns. Default: 64.
  uint32_t keys_per_client = 64;
  // Value sizes, log-uniform between these (at least 64 bytes). Default: 4 KiB and 1 MiB.
  uint64_t min_value_bytes = 4096;
  uint64_t max_value_bytes = 1 << 20;
  // Seed of keys, values and operations; 0 draws one. Default: 0.
  uint64_t seed = 0;

  // SIGKILLs and restarts of the daemon during the run. Default: 0.
  int kill_cycles = 0;
  // External daemon: shell commands that kill it and start it again (the restart command
  // returns once it is started, e.g. by ending in `&`; the command waits until it answers).
  // kill_command may be empty when restart_command kills too. Default: "".
  std::string kill_command;
  std::string restart_command;
  // How long a restarted daemon may take to answer. Default: 60 s.
  double restart_timeout_seconds = 60;
  // After a kill, lost == 0 is required for ok (a write-through daemon with a durable SSD
  // tier promises it; a write-back one does not). Default: false.
  bool expect_durable = false;

  // Start a daemon for the run: in this process (server::Server over server::TieredStore)
  // without kill cycles, else the sparsekvd binary as a child process, SIGKILLed and restarted
  // here. Default: false.
  bool spawn = false;
  // With `spawn`: a temporary directory is made (and removed unless `keep`) under this.
  // Default: "" (the system's temporary directory).
  std::string dir;
  bool keep = false;
  // With `spawn`: the host memory tier and the SSD tier below it. Defaults: 64 MiB and 2 GiB.
  uint64_t host_bytes = 64ull << 20;
  uint64_t ssd_bytes = 2ull << 30;
  // With `spawn`. Defaults: kWriteBack, kFdatasync.
  WritePolicy write_policy = WritePolicy::kWriteBack;
  Durability durability = Durability::kFdatasync;
  // With `spawn` and kill cycles: the daemon binary. "" means `sparsekvd` in the directory of
  // this executable (where the build and `make install` put both). Default: "".
  std::string daemon_binary;
};

// Keys: acknowledged, puts, gets, hits, misses, absent_expected, lookups,
// lookup_deleted_present, lookup_tiers {host, ssd, rocksdb, remote, absent}, deletes, stale_returned,
// deleted_returned, corrupt_returned, corrupt_detected, refused, refused_examples, errors,
// error_examples, violation_examples, reconnects, verified, lost, lost_not_counted, cycles
// [{live_bytes, lost_counted}], working_set_bytes, durable_capacity_bytes, ops, ops_per_s,
// put_p50_us, put_p99_us, put_p999_us, get_p50_us, get_p99_us, get_p999_us, seconds, clients,
// keys_per_client, kill_cycles, durable_policy (expect_durable), write_policy and durability
// (spawn), addr, transport, seed, ok. ok: stale_returned == deleted_returned == corrupt_returned ==
// lookup_deleted_present == refused == errors == 0, and lost == 0 with expect_durable. Errors of
// the run's own setup (bad options, a daemon that cannot be started) are returned as a Status
// instead.
Result<nlohmann::json> RunDaemonStress(const DaemonStressOptions& options);

// What each key may hold, and the judge of every GET. Keys are numbered 0..key_count()-1,
// client c owning c × keys_per_client ... (c + 1) × keys_per_client - 1.
//
// Per key it keeps the last acknowledged operation (a PUT of some version, or a DELETE; a key
// starts deleted) and the operations sent since that were not acknowledged: a GET may return
// the acknowledged value or the outcome of any of those, nothing else.
//
// Thread safety: calls for one key must not overlap (its owning client makes them); calls for
// different keys may run on different threads.
class DaemonStressChecker {
 public:
  static constexpr size_t kHeaderBytes = 48;
  static constexpr uint64_t kMagic = 0x5345525453564b53;  // "SKVSTRES" as little-endian bytes

  enum class Verdict : uint8_t {
    kMatch,            // an acceptable version, every byte as written
    kAbsentExpected,   // NotFound, and the key may well be absent
    kMiss,             // NotFound where a value should be: an eviction
    kLost,             // kMiss in the pass after a restart, with nothing unacknowledged pending
    kStale,            // a version older than the last acknowledged one, or one never PUT
    kDeletedReturned,  // a value of a key whose last acknowledged operation is a DELETE
    kCorrupt,          // bytes that fail the self-check (header, length, checksum, filler, key)
  };
  struct Check {
    Verdict verdict = Verdict::kMatch;
    uint64_t version = 0;  // the version the value claims (0 when NotFound or unreadable)
  };

  DaemonStressChecker(uint64_t seed, uint32_t clients, uint32_t keys_per_client);

  uint32_t key_count() const { return static_cast<uint32_t>(keys_.size()); }
  uint32_t keys_per_client() const { return keys_per_client_; }
  WireBlockHash Hash(uint32_t key) const;

  // The next version of `key`, to be PUT (it counts as issued from here on).
  uint64_t NextVersion(uint32_t key);
  // The value of (key, version), `bytes` long (at least kHeaderBytes), into `out`.
  void MakeValue(uint32_t key, uint64_t version, size_t bytes, std::vector<std::byte>& out) const;

  void OnPutAcked(uint32_t key, uint64_t version, uint64_t bytes);
  // The PUT failed or its reply never came: it may or may not have landed.
  void OnPutUnacked(uint32_t key, uint64_t version);
  void OnDeleteAcked(uint32_t key);
  void OnDeleteUnacked(uint32_t key);

  // A GET's answer: `value` is the bytes, or nullopt for NotFound. `after_restart`: this is the
  // verification pass after a kill, where a missing acknowledged value is kLost.
  Check CheckGet(uint32_t key, std::optional<std::span<const std::byte>> value,
                 bool after_restart) const;
  // Whether a LOOKUP may report `key` present (false: deleted, with no PUT since).
  bool PresenceAllowed(uint32_t key) const;
  // "client 1 key 7: acknowledged v12 (present), unacknowledged [13], delete pending no".
  std::string Describe(uint32_t key) const;
  // Bytes of the values whose last acknowledged operation is a PUT.
  uint64_t live_bytes() const { return live_bytes_.load(std::memory_order_relaxed); }

  static std::string_view VerdictName(Verdict v);

 private:
  struct KeyState {
    uint64_t issued = 0;  // the last version handed out by NextVersion
    uint64_t acked = 0;   // version of the last acknowledged PUT
    uint64_t acked_bytes = 0;
    bool present = false;                // the last acknowledged operation is a PUT
    bool unacked_delete = false;         // a DELETE since then, unacknowledged
    std::vector<uint64_t> unacked_puts;  // PUTs since then, unacknowledged
  };
  // The expected filler's seed, and the header fields, of (key, version).
  uint64_t FillerSeed(uint32_t key, uint64_t version) const;

  const uint64_t seed_;
  const uint32_t keys_per_client_;
  std::vector<KeyState> keys_;
  std::atomic<uint64_t> live_bytes_{0};
};

}  // namespace sparsekv::bench
