#include "sparsekv/remote_tier.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "redis_cluster.h"
#include "worker_pool.h"

namespace sparsekv {
namespace {

using offload::RedisCommand;
using offload::RedisReply;

// Replaces the value only with a newer version: ARGV[2], ARGV[3] are the new record's sequence
// (high and low 32 bits; Lua numbers are doubles), compared with the 8 bytes at offset 48 of
// the value held (bundle.h). Sequence 0 (unversioned) always replaces. 1: stored, 0: the
// value held is as new or newer.
constexpr std::string_view kPutScript = R"(
local hi, lo = tonumber(ARGV[2]), tonumber(ARGV[3])
if hi ~= 0 or lo ~= 0 then
  local cur = redis.call('GETRANGE', KEYS[1], 48, 55)
  if #cur == 8 then
    local clo, chi = struct.unpack('<I4I4', cur)
    if chi > hi or (chi == hi and clo >= lo) then return 0 end
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
)";

// Deletes the value if its sequence is below ARGV[1], ARGV[2] (high, low). 1: deleted.
constexpr std::string_view kEraseOlderScript = R"(
local cur = redis.call('GETRANGE', KEYS[1], 48, 55)
if #cur ~= 8 then return 0 end
local clo, chi = struct.unpack('<I4I4', cur)
local hi, lo = tonumber(ARGV[1]), tonumber(ARGV[2])
if chi < hi or (chi == hi and clo < lo) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
)";

// Deletes the value if its first 16 bytes (magic, version, count, checksum) are still ARGV[1]:
// a damaged copy goes, a good one written meanwhile stays.
constexpr std::string_view kDropDamagedScript = R"(
if redis.call('GETRANGE', KEYS[1], 0, 15) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
)";

// The bundle format whose values keep the key every release before the versioned keys wrote
// (RedisKey); a later format, whatever kBundleFormatVersion becomes, puts "v<N>:" in its keys.
constexpr uint16_t kUnversionedKeyFormat = 3;

bool SafeLabel(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
  });
}

// A namespace name as a key part: itself when plain, else "x" and its bytes in hex (so that no
// '{' makes a hash tag and no ':' shifts the key's parts).
std::string KeyLabel(std::string_view name) {
  if (SafeLabel(name)) return std::string(name);
  std::string out = "x";
  for (unsigned char c : name) fmt::format_to(std::back_inserter(out), "{:02x}", c);
  return out;
}

class RemoteTierImpl final : public RemoteTier {
 public:
  RemoteTierImpl(RemoteTierOptions options, std::unique_ptr<offload::RedisCluster> cluster)
      : options_(std::move(options)), cluster_(std::move(cluster)) {
    for (const std::string& n : options_.namespace_labels) labels_.push_back(KeyLabel(n));
    writers_ = std::make_unique<offload::WorkerPool>("skv-remote-w", options_.writer_threads);
  }

  ~RemoteTierImpl() override {
    writers_.reset();  // runs the queued puts first
  }

  std::string_view name() const override { return options_.name; }
  uint64_t capacity_bytes() const override { return options_.capacity_bytes; }
  uint64_t max_record_bytes() const override { return options_.max_record_bytes; }

  std::string RedisKey(const BundleKey& key) const override {
    const std::string label = key.namespace_id >= 1 && key.namespace_id <= labels_.size()
                                  ? labels_[key.namespace_id - 1]
                                  : fmt::format("ns{}", key.namespace_id);
    // Format 3 keeps the key it always had; any other bundle format puts its version in the key,
    // so that daemons of two formats sharing a key_prefix (a rolling upgrade) never share a key:
    // neither replaces nor even reads the other's values.
    const uint16_t version = BundleFormatVersion();
    if (version != kUnversionedKeyFormat) {
      return fmt::format("{}:v{}:{}:{:016x}{:016x}", options_.key_prefix, version, label, key.hash.hi,
                         key.hash.lo);
    }
    return fmt::format("{}:{}:{:016x}{:016x}", options_.key_prefix, label, key.hash.hi, key.hash.lo);
  }

  TierStats Stats() const override {
    TierStats s;
    s.name = options_.name;
    s.capacity_bytes = options_.capacity_bytes;
    s.hits = hits_.load();
    s.misses = misses_.load();
    s.puts = puts_.load();
    s.put_failures = put_failures_.load();
    s.erased = erased_.load();
    s.superseded = superseded_.load();
    s.corrupt = corrupt_.load();
    s.other_version = other_version_.load();
    s.io_errors = cluster_->Stats().failed_commands;
    s.bytes_written = bytes_written_.load();
    s.bytes_read = bytes_read_.load();
    return s;
  }

  RemoteTierState State() const override {
    const offload::RedisClusterStats c = cluster_->Stats();
    RemoteTierState s;
    s.nodes = c.nodes;
    s.nodes_down = c.nodes_down;
    s.slots_uncovered = c.slots_uncovered;
    s.healthy = c.slots_uncovered == 0;
    s.incidents = c.incidents;
    s.failed_commands = c.failed_commands;
    s.timeouts = c.timeouts;
    s.redirects = c.redirects;
    s.slot_map_refreshes = c.refreshes;
    s.connections_opened = c.connections_opened;
    s.pending_write_bytes = pending_write_bytes_.load();
    s.write_refusals = write_refusals_.load();
    return s;
  }

  std::vector<TierMetric> Metrics() const override {
    const RemoteTierState s = State();
    auto d = [](uint64_t v) { return static_cast<double>(v); };
    return {
        {"sparsekv_remote_healthy", "1 when every slot of the remote cluster is served by a node that answers.", false,
         s.healthy ? 1.0 : 0.0},
        {"sparsekv_remote_nodes", "Primaries of the remote cluster serving slots.", false, d(s.nodes)},
        {"sparsekv_remote_nodes_down", "Remote cluster nodes marked down (their keys miss).", false, d(s.nodes_down)},
        {"sparsekv_remote_slots_uncovered", "Slots with no node that answers (their keys miss).", false,
         d(s.slots_uncovered)},
        {"sparsekv_remote_incidents_total", "Times a remote cluster node went down.", true, d(s.incidents)},
        {"sparsekv_remote_failed_commands_total", "Remote commands answered as misses because a node failed.", true,
         d(s.failed_commands)},
        {"sparsekv_remote_timeouts_total", "Remote node failures that were a timeout.", true, d(s.timeouts)},
        {"sparsekv_remote_redirects_total", "MOVED and ASK replies followed.", true, d(s.redirects)},
        {"sparsekv_remote_slot_map_refreshes_total", "Slot maps read from the cluster.", true,
         d(s.slot_map_refreshes)},
        {"sparsekv_remote_connections_opened_total", "Connections opened to the cluster's nodes.", true,
         d(s.connections_opened)},
        {"sparsekv_remote_pending_write_bytes", "Bytes of puts queued for the remote cluster.", false,
         d(s.pending_write_bytes)},
        {"sparsekv_remote_write_refusals_total", "Puts refused because the remote write queue was full.", true,
         d(s.write_refusals)},
    };
  }

  bool WaitHealthy(std::chrono::milliseconds within) override { return cluster_->WaitCovered(within); }

  void PutAsync(std::vector<BundlePtr> bundles, StatusesCallback done) override {
    std::vector<Status> st(bundles.size());
    uint64_t queued = 0;
    std::vector<size_t> send;
    for (size_t i = 0; i < bundles.size(); ++i) {
      const uint64_t bytes = bundles[i]->record_bytes();
      if (bytes > options_.max_record_bytes) {
        st[i] = Status::InvalidArgument(fmt::format("remote tier: a record of {} bytes exceeds max_record_bytes ({})",
                                                    bytes, options_.max_record_bytes));
        ++put_failures_;
        continue;
      }
      uint64_t pending = pending_write_bytes_.load();
      bool room = false;
      while (pending + bytes <= options_.max_pending_write_bytes) {
        if (pending_write_bytes_.compare_exchange_weak(pending, pending + bytes)) {
          room = true;
          break;
        }
      }
      if (!room) {
        st[i] = Status::ResourceExhausted(fmt::format("remote tier: {} bytes of puts already queued",
                                                      pending_write_bytes_.load()));
        ++put_failures_;
        ++write_refusals_;
        continue;
      }
      queued += bytes;
      send.push_back(i);
    }
    if (send.empty()) {
      done(std::move(st));
      return;
    }
    writers_->Submit([this, bundles = std::move(bundles), send = std::move(send), st = std::move(st), queued,
                      done = std::move(done)](size_t) mutable {
      Store(bundles, send, st);
      pending_write_bytes_ -= queued;
      done(std::move(st));
    });
  }

  void GetAsync(std::vector<BundleKey> keys, BundlesCallback done) override {
    std::vector<std::string> names = Names(keys);
    std::vector<RedisCommand> cmds;
    cmds.reserve(keys.size());
    for (const std::string& n : names) cmds.push_back({{"GET", n}, 1});
    std::vector<RedisReply> replies = cluster_->Execute(cmds);
    std::vector<Result<BundlePtr>> out;
    out.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) out.push_back(Decode(keys[i], names[i], replies[i]));
    done(std::move(out));
  }

  void ContainsAsync(std::vector<BundleKey> keys, ContainsCallback done) override {
    std::vector<std::string> names = Names(keys);
    std::vector<RedisCommand> cmds;
    for (const std::string& n : names) cmds.push_back({{"EXISTS", n}, 1});
    std::vector<RedisReply> replies = cluster_->Execute(cmds);
    std::vector<bool> out(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      out[i] = replies[i].ok() && replies[i].type() == RedisReply::Type::kInteger && replies[i].integer() > 0;
    }
    done(std::move(out));
  }

  void EraseAsync(std::vector<BundleKey> keys, StatusesCallback done) override {
    std::vector<std::string> names = Names(keys);
    std::vector<RedisCommand> cmds;
    for (const std::string& n : names) cmds.push_back({{"DEL", n}, 1});
    done(Statuses(cluster_->Execute(cmds), /*count_erased=*/true));
  }

  void EraseOlderAsync(std::vector<BundleKey> keys, std::vector<uint64_t> below, StatusesCallback done) override {
    std::vector<std::string> names = Names(keys);
    std::vector<std::string> his(keys.size()), los(keys.size());
    std::vector<RedisCommand> cmds;
    for (size_t i = 0; i < keys.size(); ++i) {
      his[i] = std::to_string(below[i] >> 32);
      los[i] = std::to_string(below[i] & 0xffffffffu);
      cmds.push_back({{"EVAL", kEraseOlderScript, "1", names[i], his[i], los[i]}, 3});
    }
    done(Statuses(cluster_->Execute(cmds), /*count_erased=*/true));
  }

 private:
  std::vector<std::string> Names(const std::vector<BundleKey>& keys) const {
    std::vector<std::string> names;
    names.reserve(keys.size());
    for (const BundleKey& k : keys) names.push_back(RedisKey(k));
    return names;
  }

  std::vector<Status> Statuses(const std::vector<RedisReply>& replies, bool count_erased) {
    std::vector<Status> st(replies.size());
    for (size_t i = 0; i < replies.size(); ++i) {
      const RedisReply& r = replies[i];
      if (!r.ok()) {
        st[i] = r.status();
      } else if (r.type() == RedisReply::Type::kError) {
        st[i] = Status::IOError(fmt::format("remote tier: {}", r.str()), /*retryable=*/true);
      } else if (count_erased && r.type() == RedisReply::Type::kInteger && r.integer() > 0) {
        ++erased_;
      }
    }
    return st;
  }

  // Runs the conditional SETs of bundles[send...], filling st.
  void Store(const std::vector<BundlePtr>& bundles, const std::vector<size_t>& send, std::vector<Status>& st) {
    std::vector<std::string> names, his, los;
    names.reserve(send.size());
    his.reserve(send.size());
    los.reserve(send.size());
    std::vector<RedisCommand> cmds;
    cmds.reserve(send.size());
    for (size_t i : send) {
      const Bundle& b = *bundles[i];
      names.push_back(RedisKey(b.key()));
      his.push_back(std::to_string(b.sequence() >> 32));
      los.push_back(std::to_string(b.sequence() & 0xffffffffu));
      const std::span<const std::byte> rec = b.record();
      cmds.push_back({{"EVAL", kPutScript, "1", names.back(),
                       std::string_view(reinterpret_cast<const char*>(rec.data()), rec.size()), his.back(), los.back()},
                      3});
    }
    const std::vector<RedisReply> replies = cluster_->Execute(cmds);
    for (size_t j = 0; j < send.size(); ++j) {
      const size_t i = send[j];
      const RedisReply& r = replies[j];
      if (!r.ok()) {
        st[i] = r.status();
        ++put_failures_;
      } else if (r.type() != RedisReply::Type::kInteger) {
        st[i] = Status::IOError(fmt::format("remote tier: storing {}: {}", names[j], r.str()), /*retryable=*/true);
        ++put_failures_;
      } else if (r.integer() == 0) {
        ++superseded_;  // a newer copy is there: OK, as every tier answers (tier.h)
      } else {
        ++puts_;
        bytes_written_ += bundles[i]->record_bytes();
      }
    }
  }

  // A GET's reply as the tier answers it: the bundle, NotFound (absent, or its node failed: a
  // miss) or Corruption (the damaged copy is dropped).
  Result<BundlePtr> Decode(const BundleKey& key, const std::string& name, RedisReply& r) {
    if (!r.ok() || r.type() == RedisReply::Type::kNil || r.type() == RedisReply::Type::kError) {
      ++misses_;
      if (!r.ok()) return Status::NotFound(fmt::format("remote tier: {} missed: {}", name, r.status().message()));
      if (r.type() == RedisReply::Type::kError) return Status::NotFound(fmt::format("remote tier: {}: {}", name, r.str()));
      return Status::NotFound(fmt::format("remote tier: no {}", name));
    }
    const std::string_view v = r.str();
    bytes_read_ += v.size();
    // A value of 4 KiB or more arrived in a RecordBuffer (redis_cluster.h): adopted as it is.
    RecordBuffer buf = r.TakeBuffer();
    if (!buf) {
      buf = RecordBuffer::Allocate(v.size());
      std::memcpy(buf.data(), v.data(), v.size());
    }
    const std::span<std::byte> rec(buf.data(), v.size());
    // A record written by a process that numbers this namespace differently: checked as it
    // was written, then given this process's id.
    Status st;
    const std::optional<Bundle::RecordHeader> h = Bundle::PeekHeader(rec);
    if (h && h->key.hash == key.hash && h->key.namespace_id != key.namespace_id) {
      st = Bundle::RestampNamespace(rec, h->key, key.namespace_id);
    } else {
      st = Bundle::VerifyRecord(rec, key);
    }
    if (IsOtherBundleVersion(st)) {
      // Another release's record under this key: a miss, counted, never deleted (it is its
      // writer's, and Redis's eviction decides when it goes).
      ++other_version_;
      ++misses_;
      return Status::NotFound(fmt::format("remote tier: {}: {}", name, st.message()));
    }
    if (!st.ok()) {
      // Only a record that fails its checks is dropped, and only while it still holds the bytes
      // that failed (a good copy written meanwhile stays).
      ++corrupt_;
      spdlog::warn("remote tier: {} failed its checks and is dropped: {}", name, st.message());
      const std::string head(v.substr(0, std::min<size_t>(16, v.size())));
      const RedisCommand drop{{"EVAL", kDropDamagedScript, "1", name, head}, 3};
      cluster_->Execute(std::span(&drop, 1));
      return Status::Corruption(fmt::format("remote tier: {}: {}", name, st.message()));
    }
    ++hits_;
    return Bundle::AdoptVerifiedRecord(std::move(buf), v.size());
  }

  const RemoteTierOptions options_;
  std::unique_ptr<offload::RedisCluster> cluster_;
  std::vector<std::string> labels_;
  std::unique_ptr<offload::WorkerPool> writers_;
  std::atomic<uint64_t> hits_{0}, misses_{0}, puts_{0}, put_failures_{0}, erased_{0}, superseded_{0}, corrupt_{0};
  std::atomic<uint64_t> other_version_{0};
  std::atomic<uint64_t> bytes_written_{0}, bytes_read_{0};
  std::atomic<uint64_t> pending_write_bytes_{0}, write_refusals_{0};
};

}  // namespace

Result<std::unique_ptr<RemoteTier>> RemoteTier::Open(const RemoteTierOptions& options) {
  if (options.nodes.empty()) return Status::InvalidArgument("remote tier: no cluster node given (nodes)");
  if (options.key_prefix.find_first_of("{}") != std::string::npos) {
    return Status::InvalidArgument("remote tier: key_prefix must not hold '{' or '}' (a hash tag would put every "
                                   "key in one slot)");
  }
  if (options.timeout_ms == 0 || options.connections_per_node == 0 || options.writer_threads == 0 ||
      options.max_record_bytes == 0) {
    return Status::InvalidArgument(
        "remote tier: timeout_ms, connections_per_node, writer_threads and max_record_bytes must be at least 1");
  }
  offload::RedisClusterOptions c;
  c.seeds = options.nodes;
  c.password = options.password;
  c.timeout_ms = options.timeout_ms;
  c.max_idle_connections = options.connections_per_node;
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<offload::RedisCluster> cluster, offload::RedisCluster::Open(c));
  return std::unique_ptr<RemoteTier>(new RemoteTierImpl(options, std::move(cluster)));
}

}  // namespace sparsekv
