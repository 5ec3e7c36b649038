#include "offload_stress.h"

#include "progress.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <unordered_map>
#include <vector>

#include "bench_util.h"
#include "sparsekv/bundle.h"
#include "sparsekv/fault_injection_file_system.h"
#include "sparsekv/ssd_tier.h"

namespace sparsekv::bench {
namespace {

// One report from the child, written whole (well under PIPE_BUF, so never interleaved or torn).
struct Msg {
  enum Type : uint32_t {
    kPutIntent = 1,
    kPutAck,
    kPutFail,
    kEraseIntent,
    kEraseAck,
    kEraseFail,
    kReadOk,
    kReadWrong,    // bytes that are no version of this key: corrupt data returned
    kReadStale,    // a real version of this key that should no longer be there
    kReadLost,     // not found, though acknowledged and not being erased
    kReadCorrupt,  // the tier reported Corruption (detected)
  };
  uint32_t type = 0;
  uint32_t reserved = 0;
  uint64_t id = 0;
  uint64_t version = 0;
};
static_assert(sizeof(Msg) == 24);

constexpr uint32_t kStressNamespace = 3;
constexpr uint64_t kMinPayload = 1024;
constexpr uint64_t kMaxPayload = 192 << 10;
constexpr size_t kMaxLive = 1500;

BundleKey StressKey(uint64_t id) {
  BundleKey k;
  k.namespace_id = kStressNamespace;
  k.hash.hi = id * 0xff51afd7ed558ccdull + 0x5ca1ab1e;
  k.hash.lo = id;
  return k;
}

// The bundle of (id, version): its size and bytes are functions of both; the first segment
// starts with the id and the version, so a read says which version it found.
BundlePtr StressBundle(uint64_t id, uint64_t version) {
  const uint64_t payload = kMinPayload + MixBits(id * 31 + version) % (kMaxPayload - kMinPayload);
  const uint64_t a = payload * 3 / 4, b = payload / 5;
  const uint64_t sizes[] = {a, b, payload - a - b};
  auto r = Bundle::MakeWith(StressKey(id), sizes, [&](uint32_t seg, std::span<std::byte> d) {
    uint64_t x = MixBits(id ^ (version << 20) ^ (uint64_t{seg} << 56)) | 1;
    size_t i = 0;
    if (seg == 0) {
      std::memcpy(d.data(), &id, 8);
      std::memcpy(d.data() + 8, &version, 8);
      i = 16;
    }
    for (; i + 8 <= d.size(); i += 8) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      std::memcpy(d.data() + i, &x, 8);
    }
    for (; i < d.size(); ++i) d[i] = std::byte(i);
  });
  return r.ok() ? *r : nullptr;
}

// What a read found: the matching version, a stale real version, or garbage.
enum class Verdict { kOk, kStale, kWrong };
Verdict Judge(const Bundle& got, uint64_t id, const std::vector<uint64_t>& acceptable) {
  const auto seg = got.segment(0);
  if (got.segment_count() != 3 || seg.size() < 16) return Verdict::kWrong;
  uint64_t gid, gver;
  std::memcpy(&gid, seg.data(), 8);
  std::memcpy(&gver, seg.data() + 8, 8);
  if (gid != id) return Verdict::kWrong;
  BundlePtr want = StressBundle(id, gver);
  if (!want || want->record_bytes() != got.record_bytes() ||
      std::memcmp(want->record().data(), got.record().data(), got.record_bytes()) != 0) {
    return Verdict::kWrong;
  }
  return std::find(acceptable.begin(), acceptable.end(), gver) != acceptable.end()
             ? Verdict::kOk
             : Verdict::kStale;
}

SsdTierOptions StressTierOptions(const std::string& root, Durability durability) {
  SsdTierOptions o;
  o.path = root + "/ssd";
  o.capacity_bytes = 1ull << 30;  // far above what kMaxLive bundles need: no evictions
  o.queue_depth = 16;
  o.io_bytes = 256 << 10;
  o.max_record_bytes = 1 << 20;
  o.slab_grow_bytes = 8 << 20;
  o.durability = durability;
  return o;
}

// What the parent knows of a key.
struct KeyState {
  uint64_t acked = 0;              // last acknowledged version; 0: none, or erased
  std::vector<uint64_t> possible;  // versions put but not acknowledged: they may be there
  bool erase_pending = false;      // an erase was asked and not acknowledged: absence is fine
  bool loss_counted = false;
};

std::string StatePath(const std::string& root) {
  return root + "/state.bin";
}

Status WriteState(const std::string& root, const std::unordered_map<uint64_t, KeyState>& state) {
  const std::string tmp = StatePath(root) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const uint64_t n = state.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    for (const auto& [id, s] : state) {
      const uint64_t head[3] = {id, s.acked, (uint64_t{s.erase_pending} << 32) | s.possible.size()};
      out.write(reinterpret_cast<const char*>(head), sizeof head);
      out.write(reinterpret_cast<const char*>(s.possible.data()),
                static_cast<std::streamsize>(8 * s.possible.size()));
    }
    if (!out) return Status::IOError("stress: writing " + tmp + " failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, StatePath(root), ec);
  if (ec) return Status::IOError("stress: rename " + tmp + ": " + ec.message());
  return Status::OK();
}

Result<std::unordered_map<uint64_t, KeyState>> ReadState(const std::string& root) {
  std::unordered_map<uint64_t, KeyState> state;
  std::ifstream in(StatePath(root), std::ios::binary);
  if (!in) return state;
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  for (uint64_t i = 0; i < n && in; ++i) {
    uint64_t head[3];
    in.read(reinterpret_cast<char*>(head), sizeof head);
    KeyState s;
    s.acked = head[1];
    s.erase_pending = (head[2] >> 32) != 0;
    s.possible.resize(head[2] & 0xffffffffu);
    in.read(reinterpret_cast<char*>(s.possible.data()),
            static_cast<std::streamsize>(8 * s.possible.size()));
    state[head[0]] = std::move(s);
  }
  if (!in) return Status::Corruption("stress: state file " + StatePath(root) + " is truncated");
  return state;
}

// Versions a read may legitimately find.
std::vector<uint64_t> Acceptable(const KeyState& s) {
  std::vector<uint64_t> v = s.possible;
  if (s.acked) v.push_back(s.acked);
  return v;
}
bool AbsenceOk(const KeyState& s) {
  return s.acked == 0 || s.erase_pending;
}

// A set of ids with O(1) insert, erase and random pick.
class IdSet {
 public:
  void Insert(uint64_t id) {
    if (at_.count(id)) return;
    at_[id] = ids_.size();
    ids_.push_back(id);
  }
  void Erase(uint64_t id) {
    auto it = at_.find(id);
    if (it == at_.end()) return;
    const size_t i = it->second;
    at_[ids_.back()] = i;
    ids_[i] = ids_.back();
    ids_.pop_back();
    at_.erase(id);
  }
  uint64_t Pick(std::mt19937_64& rng) const { return ids_[rng() % ids_.size()]; }
  size_t size() const { return ids_.size(); }
  bool empty() const { return ids_.empty(); }

 private:
  std::vector<uint64_t> ids_;
  std::unordered_map<uint64_t, size_t> at_;
};

}  // namespace

Status RunOffloadStressChild(const OffloadStressChildOptions& o) {
  SPARSEKV_ASSIGN_OR_RETURN(auto known, ReadState(o.dir));
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<SsdTier> tier,
                            SsdTier::Open(StressTierOptions(o.dir, o.durability)));
  IdSet live;
  for (const auto& [id, s] : known) {
    if (!Acceptable(s).empty()) live.Insert(id);
  }
  std::mt19937_64 rng(o.seed);
  uint64_t next_id = (uint64_t{o.incarnation} << 32) + 1;
  uint64_t next_version = (uint64_t{o.incarnation} << 32) + 1;
  auto send = [&](uint32_t type, uint64_t id, uint64_t version) -> Status {
    Msg m;
    m.type = type;
    m.id = id;
    m.version = version;
    for (;;) {
      const ssize_t n = write(o.ack_fd, &m, sizeof m);
      if (n == sizeof m) return Status::OK();
      if (n < 0 && errno == EINTR) continue;
      return Status::Aborted("stress child: the parent stopped listening");
    }
  };
  for (;;) {
    const uint64_t dice = rng() % 100;
    if (dice < 55 || live.empty()) {
      std::vector<BundlePtr> batch;
      std::vector<uint64_t> ids, versions;
      const int n = 1 + static_cast<int>(rng() % 8);
      for (int i = 0; i < n; ++i) {
        const bool overwrite = !live.empty() && (live.size() >= kMaxLive || rng() % 100 < 30);
        const uint64_t id = overwrite ? live.Pick(rng) : next_id++;
        if (std::find(ids.begin(), ids.end(), id) != ids.end()) continue;
        ids.push_back(id);
        versions.push_back(next_version++);
        batch.push_back(StressBundle(id, versions.back()));
        SPARSEKV_RETURN_IF_ERROR(send(Msg::kPutIntent, id, versions.back()));
      }
      std::vector<Status> st = tier->Put(batch).get();
      for (size_t i = 0; i < ids.size(); ++i) {
        KeyState& s = known[ids[i]];
        if (st[i].ok()) {
          s = KeyState{versions[i], {}, false, false};
          live.Insert(ids[i]);
          SPARSEKV_RETURN_IF_ERROR(send(Msg::kPutAck, ids[i], versions[i]));
        } else {
          s.possible.push_back(versions[i]);
          live.Insert(ids[i]);
          SPARSEKV_RETURN_IF_ERROR(send(Msg::kPutFail, ids[i], versions[i]));
        }
      }
    } else if (dice < 65) {
      std::vector<uint64_t> ids;
      const int n = 1 + static_cast<int>(rng() % 3);
      for (int i = 0; i < n && !live.empty(); ++i) {
        const uint64_t id = live.Pick(rng);
        if (std::find(ids.begin(), ids.end(), id) != ids.end()) continue;
        ids.push_back(id);
        SPARSEKV_RETURN_IF_ERROR(send(Msg::kEraseIntent, id, 0));
      }
      std::vector<BundleKey> keys;
      for (uint64_t id : ids) keys.push_back(StressKey(id));
      std::vector<Status> st = tier->Erase(keys).get();
      for (size_t i = 0; i < ids.size(); ++i) {
        if (st[i].ok()) {
          known.erase(ids[i]);
          live.Erase(ids[i]);
          SPARSEKV_RETURN_IF_ERROR(send(Msg::kEraseAck, ids[i], 0));
        } else {
          known[ids[i]].erase_pending = true;
          SPARSEKV_RETURN_IF_ERROR(send(Msg::kEraseFail, ids[i], 0));
        }
      }
    } else {
      std::vector<uint64_t> ids;
      const int n = 1 + static_cast<int>(rng() % 8);
      for (int i = 0; i < n; ++i) ids.push_back(live.Pick(rng));
      std::vector<BundleKey> keys;
      for (uint64_t id : ids) keys.push_back(StressKey(id));
      auto got = tier->Get(keys).get();
      for (size_t i = 0; i < ids.size(); ++i) {
        const KeyState& s = known[ids[i]];
        uint32_t type = Msg::kReadOk;
        uint64_t version = 0;
        if (got[i].ok()) {
          const Verdict v = Judge(**got[i], ids[i], Acceptable(s));
          type = v == Verdict::kOk      ? Msg::kReadOk
                 : v == Verdict::kStale ? Msg::kReadStale
                                        : Msg::kReadWrong;
        } else if (got[i].status().Is(StatusCode::kCorruption)) {
          type = Msg::kReadCorrupt;
        } else if (got[i].status().Is(StatusCode::kNotFound)) {
          if (!AbsenceOk(s)) type = Msg::kReadLost;
        } else {
          continue;  // an I/O error: neither a loss nor a wrong answer
        }
        SPARSEKV_RETURN_IF_ERROR(send(type, ids[i], version));
        if (type == Msg::kReadCorrupt || type == Msg::kReadLost) {
          known.erase(ids[i]);  // gone: reported once
          live.Erase(ids[i]);
        }
      }
    }
  }
}

Result<nlohmann::json> RunOffloadStress(const OffloadStressOptions& o) {
  if (o.dir.empty()) return Status::InvalidArgument("stress offload: --dir is required");
  if (o.kill_cycles < 1)
    return Status::InvalidArgument("stress offload: --kill-cycles must be at least 1");
  if (o.seconds <= 0) return Status::InvalidArgument("stress offload: --seconds must be positive");
  const uint64_t seed = o.seed ? o.seed : std::random_device{}() | 1;
  std::mt19937_64 rng(seed);
  const std::string root =
      (std::filesystem::path(o.dir) / fmt::format("sparsekv-stress-{}", getpid())).string();
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  std::filesystem::create_directories(root, ec);
  if (ec) return Status::IOError("stress offload: create " + root + ": " + ec.message());
  struct Cleanup {
    std::string root;
    bool keep;
    ~Cleanup() {
      std::error_code e;
      if (!keep) std::filesystem::remove_all(root, e);
    }
  } cleanup{root, o.keep};

  std::unordered_map<uint64_t, KeyState> state;
  uint64_t acknowledged = 0, erased = 0, child_reads = 0, lost = 0, corrupt_returned = 0,
           stale_returned = 0, detected = 0, early_exits = 0;
  auto apply = [&](const Msg& m) {
    switch (m.type) {
      case Msg::kPutIntent:
        state[m.id].possible.push_back(m.version);
        break;
      case Msg::kPutAck: {
        KeyState& s = state[m.id];
        s.acked = m.version;
        s.possible.clear();
        s.erase_pending = false;
        s.loss_counted = false;
        ++acknowledged;
        break;
      }
      case Msg::kPutFail:
        break;  // the version stays possible
      case Msg::kEraseIntent:
        state[m.id].erase_pending = true;
        break;
      case Msg::kEraseAck: {
        KeyState& s = state[m.id];
        s.acked = 0;
        s.possible.clear();
        s.erase_pending = false;
        ++erased;
        break;
      }
      case Msg::kEraseFail:
        break;
      case Msg::kReadOk:
        ++child_reads;
        break;
      case Msg::kReadWrong:
        ++child_reads, ++corrupt_returned;
        break;
      case Msg::kReadStale:
        ++child_reads, ++stale_returned;
        break;
      case Msg::kReadLost:
      case Msg::kReadCorrupt: {
        ++child_reads;
        if (m.type == Msg::kReadCorrupt) ++detected;
        KeyState& s = state[m.id];
        if (!s.loss_counted && !AbsenceOk(s)) {
          ++lost;
          s.loss_counted = true;
        }
        // The tier dropped it: from now on absence is what it is.
        s.acked = 0;
        s.possible.clear();
        break;
      }
      default:
        break;
    }
  };

  const double t_start = NowSeconds();
  for (int cycle = 0; cycle < o.kill_cycles; ++cycle) {
    ProgressNote(fmt::format("kill cycle {} of {}, {} puts acknowledged", cycle + 1, o.kill_cycles, acknowledged));
    SPARSEKV_RETURN_IF_ERROR(WriteState(root, state));
    std::vector<std::string> args = o.child_command;
    const std::vector<std::string> more = {
        "--dir",         root,
        "--incarnation", std::to_string(cycle + 1),
        "--seed",        std::to_string(seed + cycle),
        "--durability",  std::string(DurabilityName(o.durability))};
    args.insert(args.end(), more.begin(), more.end());
    const double share = o.seconds / o.kill_cycles;
    const double run_for =
        std::max(0.2, share * (0.5 + std::uniform_real_distribution<double>(0, 1)(rng)));
    SPARSEKV_ASSIGN_OR_RETURN(const bool killed, RunChildUntilKilled(args, sizeof(Msg), run_for, [&](const std::byte* r) {
      Msg m;
      std::memcpy(&m, r, sizeof m);
      apply(m);
    }));
    const bool child_gone = !killed;
    early_exits += child_gone;
    if (child_gone) {
      return Status::Internal(fmt::format(
          "stress offload: the child exited by itself in cycle {} (see its error above): {}",
          cycle + 1, "it must run until killed"));
    }
  }
  const double run_seconds = NowSeconds() - t_start;

  // Verification: every key the child ever named, against what it was told.
  SsdTierOptions topt = StressTierOptions(root, o.durability);
  SPARSEKV_ASSIGN_OR_RETURN(std::unique_ptr<SsdTier> tier, SsdTier::Open(topt));
  std::vector<uint64_t> ids;
  for (const auto& [id, s] : state) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  uint64_t verified = 0, unacked_found = 0;
  std::vector<uint64_t> live_ok;
  auto check = [&](const std::vector<uint64_t>& which, SsdTier& t, bool count_live) {
    for (size_t at = 0; at < which.size(); at += 64) {
      std::vector<BundleKey> keys;
      for (size_t i = at; i < std::min(which.size(), at + 64); ++i)
        keys.push_back(StressKey(which[i]));
      auto got = t.Get(keys).get();
      for (size_t j = 0; j < keys.size(); ++j) {
        const uint64_t id = which[at + j];
        KeyState& s = state[id];
        if (got[j].ok()) {
          const Verdict v = Judge(**got[j], id, Acceptable(s));
          if (v == Verdict::kWrong) {
            ++corrupt_returned;
          } else if (v == Verdict::kStale) {
            ++stale_returned;
          } else {
            if (count_live) {
              ++verified;
              uint64_t gver;
              std::memcpy(&gver, (*got[j])->segment(0).data() + 8, 8);
              if (gver != s.acked) ++unacked_found;
              live_ok.push_back(id);
            }
          }
        } else if (got[j].status().Is(StatusCode::kCorruption)) {
          ++detected;
          if (!AbsenceOk(s) && !s.loss_counted) ++lost, s.loss_counted = true;
        } else if (!AbsenceOk(s) && !s.loss_counted) {
          ++lost;
          s.loss_counted = true;
        }
      }
    }
  };
  check(ids, *tier, true);
  uint64_t unknown_found = 0;
  for (const BundleKey& k : tier->Keys()) unknown_found += state.count(k.hash.lo) == 0;

  // Bit rot: one flipped bit inside each of some records, then every one must be caught.
  nlohmann::json flip = {{"injected", 0}, {"detected", 0}, {"returned", 0}};
  if (o.flip_bundles > 0 && !live_ok.empty()) {
    std::shuffle(live_ok.begin(), live_ok.end(), rng);
    std::vector<uint64_t> flipped(
        live_ok.begin(), live_ok.begin() + std::min<size_t>(o.flip_bundles, live_ok.size()));
    std::vector<uint64_t> untouched(live_ok.begin() + static_cast<std::ptrdiff_t>(flipped.size()),
                                    live_ok.end());
    std::vector<SsdRecordLocation> where;
    for (uint64_t id : flipped) {
      SPARSEKV_ASSIGN_OR_RETURN(SsdRecordLocation l, tier->Locate(StressKey(id)));
      where.push_back(std::move(l));
    }
    tier.reset();
    FaultInjectionFileSystem fs(FileSystem::Default(), seed);
    for (const SsdRecordLocation& l : where) {
      SPARSEKV_RETURN_IF_ERROR(
          fs.FlipBitInFile(l.file, l.offset + rng() % l.record_bytes, static_cast<int>(rng() % 8)));
    }
    SPARSEKV_ASSIGN_OR_RETURN(tier, SsdTier::Open(topt));
    std::vector<BundleKey> keys;
    for (uint64_t id : flipped) keys.push_back(StressKey(id));
    auto got = tier->Get(keys).get();
    uint64_t det = 0, ret = 0;
    for (auto& g : got) {
      if (g.ok()) {
        ++ret;
      } else if (g.status().Is(StatusCode::kCorruption)) {
        ++det;
      }
    }
    corrupt_returned += ret;
    flip = {{"injected", flipped.size()}, {"detected", det}, {"returned", ret}};
    // The rest is untouched by the damage and its clean-up.
    const uint64_t lost_before = lost;
    check(untouched, *tier, false);
    flip["lost_untouched"] = lost - lost_before;
  }

  nlohmann::json j;
  j["acknowledged"] = acknowledged;
  j["erased_acknowledged"] = erased;
  j["lost"] = lost;
  j["corrupt_returned"] = corrupt_returned;
  j["stale_returned"] = stale_returned;
  j["detected_corrupt"] = detected;
  j["verified"] = verified;
  j["unacknowledged_found"] = unacked_found;
  j["unknown_found"] = unknown_found;
  j["keys"] = ids.size();
  j["child_reads"] = child_reads;
  j["kill_cycles"] = o.kill_cycles;
  j["seconds"] = run_seconds;
  j["durability"] = std::string(DurabilityName(o.durability));
  j["seed"] = seed;
  j["flip"] = flip;
  const bool flips_ok = flip["detected"].get<uint64_t>() == flip["injected"].get<uint64_t>();
  j["ok"] = lost == 0 && corrupt_returned == 0 && stale_returned == 0 && unknown_found == 0 &&
            flips_ok && early_exits == 0;
  return j;
}

}  // namespace sparsekv::bench
