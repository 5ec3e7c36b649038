#include "sparsekv/offload_options.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>

namespace sparsekv {
namespace {

using nlohmann::json;

std::string Shown(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// Parses "64GiB", "512 MiB", "4096", "1.5GB"; binary units are powers of 1024, decimal of 1000.
bool ParseSizeString(std::string_view text, uint64_t* out) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  if (i == 0) return false;
  double number = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + i, number);
  if (ec != std::errc() || p != text.data() + i) return false;
  std::string_view unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  static const std::pair<std::string_view, double> kUnits[] = {{"", 1},
                                                               {"B", 1},
                                                               {"KiB", 1024.0},
                                                               {"MiB", 1048576.0},
                                                               {"GiB", 1073741824.0},
                                                               {"TiB", 1099511627776.0},
                                                               {"KB", 1e3},
                                                               {"MB", 1e6},
                                                               {"GB", 1e9},
                                                               {"TB", 1e12}};
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) {
      const double v = number * scale;
      if (v < 0 || v > 1.8e19) return false;
      *out = static_cast<uint64_t>(v);
      return true;
    }
  }
  return false;
}

class Section {
 public:
  Section(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

  Status IsObject() const {
    if (!j_.is_object())
      return Status::InvalidArgument(
          fmt::format("{}: expected an object, got {}", path_, Shown(j_)));
    return Status::OK();
  }

  Status OnlyKeys(std::initializer_list<std::string_view> allowed) const {
    for (const auto& [k, v] : j_.items()) {
      if (std::find(allowed.begin(), allowed.end(), k) == allowed.end()) {
        std::string list;
        for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
        return Status::InvalidArgument(
            fmt::format("{}.{}: unknown key; expected one of {}", path_, k, list));
      }
    }
    return Status::OK();
  }

  Status Bool(const char* key, bool* out) const {
    if (!j_.contains(key)) return Status::OK();
    const json& v = j_.at(key);
    if (!v.is_boolean())
      return Status::InvalidArgument(
          fmt::format("{}.{}: expected true or false, got {}", path_, key, Shown(v)));
    *out = v.get<bool>();
    return Status::OK();
  }

  template <typename T>
  Status Uint(const char* key, uint64_t lo, uint64_t hi, T* out) const {
    if (!j_.contains(key)) return Status::OK();
    const json& v = j_.at(key);
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
      return Status::InvalidArgument(fmt::format("{}.{}: expected an integer from {} to {}, got {}",
                                                 path_, key, lo, hi, Shown(v)));
    }
    const uint64_t x = v.get<uint64_t>();
    if (x < lo || x > hi) {
      return Status::InvalidArgument(
          fmt::format("{}.{}: expected an integer from {} to {}, got {}", path_, key, lo, hi, x));
    }
    *out = static_cast<T>(x);
    return Status::OK();
  }

  Status Bytes(const char* key, uint64_t lo, uint64_t* out) const {
    if (!j_.contains(key)) return Status::OK();
    const json& v = j_.at(key);
    uint64_t x = 0;
    if (v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0)) {
      x = v.get<uint64_t>();
    } else if (!v.is_string() || !ParseSizeString(v.get<std::string>(), &x)) {
      return Status::InvalidArgument(
          fmt::format("{}.{}: expected a size: bytes as an integer or a string such as \"64GiB\" "
                      "or \"512MB\", got {}",
                      path_, key, Shown(v)));
    }
    if (x < lo) {
      return Status::InvalidArgument(
          fmt::format("{}.{}: expected at least {} bytes, got {}", path_, key, lo, x));
    }
    *out = x;
    return Status::OK();
  }

  Status String(const char* key, std::string* out) const {
    if (!j_.contains(key)) return Status::OK();
    const json& v = j_.at(key);
    if (!v.is_string())
      return Status::InvalidArgument(
          fmt::format("{}.{}: expected a string, got {}", path_, key, Shown(v)));
    *out = v.get<std::string>();
    return Status::OK();
  }

  template <typename E>
  Status Enum(const char* key, Result<E> (*parse)(std::string_view), E* out) const {
    if (!j_.contains(key)) return Status::OK();
    std::string s;
    SPARSEKV_RETURN_IF_ERROR(String(key, &s));
    Result<E> r = parse(s);
    if (!r.ok())
      return Status::InvalidArgument(fmt::format("{}.{}: {}", path_, key, r.status().message()));
    *out = *r;
    return Status::OK();
  }

  // A number from 0 to 1.
  Status Fraction(const char* key, double* out) const {
    if (!j_.contains(key)) return Status::OK();
    const json& v = j_.at(key);
    if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() <= 1)) {
      return Status::InvalidArgument(
          fmt::format("{}.{}: expected a number from 0 to 1, got {}", path_, key, Shown(v)));
    }
    *out = v.get<double>();
    return Status::OK();
  }

  Status StringList(const char* key, std::vector<std::string>* out) const {
    if (!j_.contains(key)) return Status::OK();
    const json& v = j_.at(key);
    bool ok = v.is_array();
    for (size_t i = 0; ok && i < v.size(); ++i) ok = v[i].is_string();
    if (!ok) {
      return Status::InvalidArgument(
          fmt::format("{}.{}: expected an array of strings, got {}", path_, key, Shown(v)));
    }
    out->clear();
    for (const json& e : v) out->push_back(e.get<std::string>());
    return Status::OK();
  }

  bool Has(const char* key) const { return j_.contains(key); }
  Section Sub(const char* key) const { return Section(j_.at(key), path_ + "." + key); }

 private:
  const json& j_;
  std::string path_;
};

Status ParseHost(const Section& s, OffloadOptions& o) {
  SPARSEKV_RETURN_IF_ERROR(s.IsObject());
  SPARSEKV_RETURN_IF_ERROR(s.OnlyKeys(
      {"enabled", "capacity_bytes", "max_record_bytes", "slot_bytes", "huge_pages", "populate", "eviction",
       "hint_bound"}));
  SPARSEKV_RETURN_IF_ERROR(s.Enum("eviction", &ParseEvictionPolicy, &o.host.eviction));
  SPARSEKV_RETURN_IF_ERROR(s.Fraction("hint_bound", &o.host.hint_bound));
  SPARSEKV_RETURN_IF_ERROR(s.Bool("enabled", &o.host_enabled));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("capacity_bytes", 1, &o.host.capacity_bytes));
  // "slot_bytes" is the name this limit had when every record took a slot of that size.
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("slot_bytes", 0, &o.host.max_record_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("max_record_bytes", 0, &o.host.max_record_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Bool("populate", &o.host.populate));
  return s.Bool("huge_pages", &o.host.huge_pages);
}

Status ParseSsd(const Section& s, OffloadOptions& o) {
  SPARSEKV_RETURN_IF_ERROR(s.IsObject());
  SPARSEKV_RETURN_IF_ERROR(
      s.OnlyKeys({"enabled", "path", "capacity_bytes", "queue_depth", "io_threads", "io_bytes",
                  "max_record_bytes", "slab_grow_bytes", "durability", "register_buffers",
                  "read_arena_bytes", "read_coalesce_bytes", "read_gap_bytes", "eviction", "hint_bound"}));
  SsdTierOptions& t = o.ssd;
  SPARSEKV_RETURN_IF_ERROR(s.Enum("eviction", &ParseEvictionPolicy, &t.eviction));
  SPARSEKV_RETURN_IF_ERROR(s.Fraction("hint_bound", &t.hint_bound));
  SPARSEKV_RETURN_IF_ERROR(s.Bool("enabled", &o.ssd_enabled));
  SPARSEKV_RETURN_IF_ERROR(s.String("path", &t.path));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("capacity_bytes", kDirectIoAlignment, &t.capacity_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Uint("queue_depth", 1, 4096, &t.queue_depth));
  SPARSEKV_RETURN_IF_ERROR(s.Uint("io_threads", 1, 64, &t.io_threads));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("io_bytes", kDirectIoAlignment, &t.io_bytes));
  if (t.io_bytes % kDirectIoAlignment != 0 || t.io_bytes > (64u << 20)) {
    return Status::InvalidArgument(fmt::format(
        "offload.ssd.io_bytes: expected a multiple of 4096 up to 64 MiB, got {}", t.io_bytes));
  }
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("max_record_bytes", BundleHeaderBytes(0), &t.max_record_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("slab_grow_bytes", kDirectIoAlignment, &t.slab_grow_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Enum("durability", &ParseDurability, &t.durability));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("read_arena_bytes", 0, &t.read_arena_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("read_coalesce_bytes", 0, &t.read_coalesce_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("read_gap_bytes", 0, &t.read_gap_bytes));
  if (t.read_coalesce_bytes > (1ull << 30)) {
    return Status::InvalidArgument(fmt::format(
        "offload.ssd.read_coalesce_bytes: expected at most 1 GiB, got {}", t.read_coalesce_bytes));
  }
  if (t.read_gap_bytes % kDirectIoAlignment != 0) {
    return Status::InvalidArgument(fmt::format(
        "offload.ssd.read_gap_bytes: expected a multiple of 4096, got {}", t.read_gap_bytes));
  }
  return s.Bool("register_buffers", &t.register_buffers);
}

Status ParseRocksDb(const Section& s, OffloadOptions& o) {
  SPARSEKV_RETURN_IF_ERROR(s.IsObject());
  SPARSEKV_RETURN_IF_ERROR(
      s.OnlyKeys({"enabled", "path", "capacity_bytes", "min_blob_size", "blob_file_size",
                  "max_record_bytes", "durability", "use_direct_io", "worker_threads"}));
  RocksDbTierOptions& t = o.rocksdb;
  SPARSEKV_RETURN_IF_ERROR(s.Bool("enabled", &o.rocksdb_enabled));
  SPARSEKV_RETURN_IF_ERROR(s.String("path", &t.path));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("capacity_bytes", 1, &t.capacity_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("min_blob_size", 0, &t.min_blob_size));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("blob_file_size", 1 << 20, &t.blob_file_size));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("max_record_bytes", BundleHeaderBytes(0), &t.max_record_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Enum("durability", &ParseDurability, &t.durability));
  SPARSEKV_RETURN_IF_ERROR(s.Bool("use_direct_io", &t.use_direct_io));
  return s.Uint("worker_threads", 1, 64, &t.worker_threads);
}

Status ParseRemote(const Section& s, OffloadOptions& o) {
  SPARSEKV_RETURN_IF_ERROR(s.IsObject());
  SPARSEKV_RETURN_IF_ERROR(
      s.OnlyKeys({"enabled", "nodes", "password", "key_prefix", "timeout_ms", "connections_per_node",
                  "max_record_bytes", "max_pending_write_bytes", "writer_threads", "capacity_bytes"}));
  RemoteTierOptions& t = o.remote;
  SPARSEKV_RETURN_IF_ERROR(s.Bool("enabled", &o.remote_enabled));
  SPARSEKV_RETURN_IF_ERROR(s.StringList("nodes", &t.nodes));
  SPARSEKV_RETURN_IF_ERROR(s.String("password", &t.password));
  SPARSEKV_RETURN_IF_ERROR(s.String("key_prefix", &t.key_prefix));
  SPARSEKV_RETURN_IF_ERROR(s.Uint("timeout_ms", 1, 60000, &t.timeout_ms));
  SPARSEKV_RETURN_IF_ERROR(s.Uint("connections_per_node", 1, 1024, &t.connections_per_node));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("max_record_bytes", BundleHeaderBytes(0), &t.max_record_bytes));
  // Redis refuses bulk strings over 512 MB (proto-max-bulk-len).
  if (t.max_record_bytes > (512ull << 20)) {
    return Status::InvalidArgument(fmt::format(
        "offload.remote.max_record_bytes: expected at most 512 MiB (Redis's largest value), got {}",
        t.max_record_bytes));
  }
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("max_pending_write_bytes", 0, &t.max_pending_write_bytes));
  SPARSEKV_RETURN_IF_ERROR(s.Uint("writer_threads", 1, 64, &t.writer_threads));
  SPARSEKV_RETURN_IF_ERROR(s.Bytes("capacity_bytes", 0, &t.capacity_bytes));
  if (o.remote_enabled && t.nodes.empty()) {
    return Status::InvalidArgument("offload.remote.nodes: expected at least one \"host:port\" of the cluster");
  }
  for (const std::string& n : t.nodes) {
    const size_t colon = n.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == n.size() ||
        n.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
      return Status::InvalidArgument(fmt::format("offload.remote.nodes: expected \"host:port\", got \"{}\"", n));
    }
  }
  if (t.key_prefix.find_first_of("{}") != std::string::npos) {
    return Status::InvalidArgument("offload.remote.key_prefix: must not hold '{' or '}' (a hash tag)");
  }
  return Status::OK();
}

}  // namespace

Result<OffloadOptions> ParseOffloadOptionsJson(std::string_view json_text,
                                               std::string_view context) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument(fmt::format("{}: not valid JSON", context));
  OffloadOptions o;
  Section s(j, std::string(context));
  SPARSEKV_RETURN_IF_ERROR(s.IsObject());
  SPARSEKV_RETURN_IF_ERROR(s.OnlyKeys(
      {"write_policy", "promote_into_first_tier", "prefetch_blocks", "host", "ssd", "rocksdb", "remote"}));
  SPARSEKV_RETURN_IF_ERROR(s.Enum("write_policy", &ParseWritePolicy, &o.chain.write_policy));
  SPARSEKV_RETURN_IF_ERROR(s.Bool("promote_into_first_tier", &o.chain.promote_into_first_tier));
  SPARSEKV_RETURN_IF_ERROR(s.Uint("prefetch_blocks", 0, 4096, &o.chain.prefetch_blocks));
  if (s.Has("host")) SPARSEKV_RETURN_IF_ERROR(ParseHost(s.Sub("host"), o));
  if (s.Has("ssd")) SPARSEKV_RETURN_IF_ERROR(ParseSsd(s.Sub("ssd"), o));
  if (s.Has("rocksdb")) SPARSEKV_RETURN_IF_ERROR(ParseRocksDb(s.Sub("rocksdb"), o));
  if (s.Has("remote")) SPARSEKV_RETURN_IF_ERROR(ParseRemote(s.Sub("remote"), o));
  return o;
}

std::string OffloadOptionsToJson(const OffloadOptions& o) {
  json j;
  j["write_policy"] = std::string(WritePolicyName(o.chain.write_policy));
  j["promote_into_first_tier"] = o.chain.promote_into_first_tier;
  j["prefetch_blocks"] = o.chain.prefetch_blocks;
  j["host"] = {{"enabled", o.host_enabled},
               {"capacity_bytes", o.host.capacity_bytes},
               {"max_record_bytes", o.host.max_record_bytes},
               {"huge_pages", o.host.huge_pages},
               {"populate", o.host.populate},
               {"eviction", std::string(EvictionPolicyName(o.host.eviction))},
               {"hint_bound", o.host.hint_bound}};
  j["ssd"] = {{"enabled", o.ssd_enabled},
              {"path", o.ssd.path},
              {"capacity_bytes", o.ssd.capacity_bytes},
              {"queue_depth", o.ssd.queue_depth},
              {"io_threads", o.ssd.io_threads},
              {"io_bytes", o.ssd.io_bytes},
              {"max_record_bytes", o.ssd.max_record_bytes},
              {"slab_grow_bytes", o.ssd.slab_grow_bytes},
              {"durability", std::string(DurabilityName(o.ssd.durability))},
              {"register_buffers", o.ssd.register_buffers},
              {"read_arena_bytes", o.ssd.read_arena_bytes},
              {"read_coalesce_bytes", o.ssd.read_coalesce_bytes},
              {"read_gap_bytes", o.ssd.read_gap_bytes},
              {"eviction", std::string(EvictionPolicyName(o.ssd.eviction))},
              {"hint_bound", o.ssd.hint_bound}};
  j["rocksdb"] = {{"enabled", o.rocksdb_enabled},
                  {"path", o.rocksdb.path},
                  {"capacity_bytes", o.rocksdb.capacity_bytes},
                  {"min_blob_size", o.rocksdb.min_blob_size},
                  {"blob_file_size", o.rocksdb.blob_file_size},
                  {"max_record_bytes", o.rocksdb.max_record_bytes},
                  {"durability", std::string(DurabilityName(o.rocksdb.durability))},
                  {"use_direct_io", o.rocksdb.use_direct_io},
                  {"worker_threads", o.rocksdb.worker_threads}};
  j["remote"] = {{"enabled", o.remote_enabled},
                 {"nodes", o.remote.nodes},
                 {"password", o.remote.password.empty() ? "" : "(set)"},
                 {"key_prefix", o.remote.key_prefix},
                 {"timeout_ms", o.remote.timeout_ms},
                 {"connections_per_node", o.remote.connections_per_node},
                 {"max_record_bytes", o.remote.max_record_bytes},
                 {"max_pending_write_bytes", o.remote.max_pending_write_bytes},
                 {"writer_threads", o.remote.writer_threads},
                 {"capacity_bytes", o.remote.capacity_bytes}};
  return j.dump();
}

void ResolveOffloadPaths(OffloadOptions& o, const std::string& data_dir) {
  auto resolve = [&](std::string& p, const char* fallback) {
    if (p.empty()) p = fallback;
    if (std::filesystem::path(p).is_relative()) p = (std::filesystem::path(data_dir) / p).string();
  };
  resolve(o.ssd.path, "ssd");
  resolve(o.rocksdb.path, "rocksdb");
}

Result<std::unique_ptr<TierChain>> OpenTierChain(const OffloadOptions& o, FileSystem* fs) {
  std::vector<std::unique_ptr<Tier>> tiers;
  if (o.host_enabled) {
    auto t = HostTier::Open(o.host);
    if (!t.ok()) return t.status().WithContext("offload.host");
    tiers.push_back(std::move(*t));
  }
  if (o.ssd_enabled) {
    auto t = SsdTier::Open(o.ssd, fs);
    if (!t.ok()) return t.status().WithContext("offload.ssd");
    tiers.push_back(std::move(*t));
  }
  if (o.rocksdb_enabled) {
    auto t = RocksDbTier::Open(o.rocksdb);
    if (!t.ok()) return t.status().WithContext("offload.rocksdb");
    tiers.push_back(std::move(*t));
  }
  if (o.remote_enabled) {
    if (tiers.empty()) {
      return Status::InvalidArgument(
          "offload.remote: a remote tier needs a local tier before it (host, ssd or rocksdb enabled)");
    }
    auto t = RemoteTier::Open(o.remote);
    if (!t.ok()) return t.status().WithContext("offload.remote");
    tiers.push_back(std::move(*t));
  }
  if (tiers.empty()) return Status::InvalidArgument("offload: no tier is enabled");
  return std::make_unique<TierChain>(std::move(tiers), o.chain);
}

}  // namespace sparsekv
