#include "sparsekv/vllm_kv_events.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <msgpack.hpp>
#include <mutex>
#include <thread>
#include <zmq.hpp>

#include "sparsekv/cache_manager.h"

namespace sparsekv {
namespace {

// The replay socket's end-of-replay sequence: -1 as 8 signed big-endian bytes.
constexpr uint8_t kEndSeq[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

void PutBigEndian64(uint64_t v, uint8_t out[8]) {
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<uint8_t>(v);
    v >>= 8;
  }
}

uint64_t Uint64Of(const KvEventDigest& d) {
  uint64_t v = 0;
  for (int i = 8; i < 16; ++i) v = (v << 8) | d[i];
  return v;
}

// The encoder's output: a growable byte buffer that keeps its capacity across clear(), with room
// handed out directly (Room/Advance) for the arrays written element by element. It is the
// packer's stream (write()).
class OutBuffer {
 public:
  OutBuffer() = default;
  explicit OutBuffer(size_t capacity) { Grow(capacity); }
  ~OutBuffer() { std::free(data_); }
  OutBuffer(const OutBuffer&) = delete;
  OutBuffer& operator=(const OutBuffer&) = delete;
  void write(const char* p, size_t n) {
    if (n == 0) return;
    std::memcpy(Room(n), p, n);
    size_ += n;
  }
  // At least `n` writable bytes at the end.
  char* Room(size_t n) {
    if (cap_ - size_ < n) Grow(std::max(cap_ * 2, size_ + n));
    return data_ + size_;
  }
  void Advance(size_t n) { size_ += n; }
  void clear() { size_ = 0; }
  const char* data() const { return data_; }
  char* data() { return data_; }
  size_t size() const { return size_; }

 private:
  void Grow(size_t cap) {
    auto* p = static_cast<char*>(std::realloc(data_, cap));
    if (p == nullptr) throw std::bad_alloc();
    data_ = p;
    cap_ = cap;
  }
  char* data_ = nullptr;
  size_t size_ = 0, cap_ = 0;
};

using Packer = msgpack::packer<OutBuffer>;

void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void PackHash(Packer& pk, const KvEventDigest& d, KvEventHashEncoding enc) {
  if (enc == KvEventHashEncoding::kUint64) {
    pk.pack_uint64(Uint64Of(d));
  } else {
    pk.pack_bin(static_cast<uint32_t>(d.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(d.data()), static_cast<uint32_t>(d.size()));
  }
}

void PackHashes(Packer& pk, const std::vector<KvEventDigest>& hashes, KvEventHashEncoding enc) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const KvEventDigest& d : hashes) PackHash(pk, d, enc);
}

// An unsigned integer in msgpack's smallest form (as packer::pack_uint64 and pack_uint32 write
// it) at `out`; returns the bytes written (at most 9).
inline size_t PutUint(char* out, uint64_t v) {
  if (v < 128) {
    out[0] = static_cast<char>(v);
    return 1;
  }
  if (v < 256) {
    out[0] = static_cast<char>(0xcc);
    out[1] = static_cast<char>(v);
    return 2;
  }
  if (v < 65536) {
    out[0] = static_cast<char>(0xcd);
    const uint16_t be = __builtin_bswap16(static_cast<uint16_t>(v));
    std::memcpy(out + 1, &be, 2);
    return 3;
  }
  if (v <= UINT32_MAX) {
    out[0] = static_cast<char>(0xce);
    const uint32_t be = __builtin_bswap32(static_cast<uint32_t>(v));
    std::memcpy(out + 1, &be, 4);
    return 5;
  }
  out[0] = static_cast<char>(0xcf);
  const uint64_t be = __builtin_bswap64(v);
  std::memcpy(out + 1, &be, 8);
  return 9;
}

// Arrays are written straight into the buffer, room for the whole array taken at once.
void PackTokens(OutBuffer& buf, Packer& pk, std::span<const uint32_t> tokens) {
  pk.pack_array(static_cast<uint32_t>(tokens.size()));
  char* const start = buf.Room(tokens.size() * 5);
  char* out = start;
  for (const uint32_t t : tokens) out += PutUint(out, t);
  buf.Advance(static_cast<size_t>(out - start));
}

// Block hashes of a manager (BlockHash) as PackHash writes their DigestOf: uint64 is `lo`, bytes
// are hi then lo, big-endian.
void PackBlockHashes(OutBuffer& buf, Packer& pk, std::span<const BlockHash> hashes, KvEventHashEncoding enc) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  char* const start = buf.Room(hashes.size() * 18);
  char* out = start;
  for (const BlockHash& h : hashes) {
    if (enc == KvEventHashEncoding::kUint64) {
      out += PutUint(out, h.lo);
    } else {
      out[0] = static_cast<char>(0xc4);  // bin 8
      out[1] = 16;
      const uint64_t hi = __builtin_bswap64(h.hi), lo = __builtin_bswap64(h.lo);
      std::memcpy(out + 2, &hi, 8);
      std::memcpy(out + 10, &lo, 8);
      out += 18;
    }
  }
  buf.Advance(static_cast<size_t>(out - start));
}

void PackBlockHash(OutBuffer& buf, Packer& pk, const BlockHash& h, KvEventHashEncoding enc) {
  if (enc == KvEventHashEncoding::kUint64) {
    pk.pack_uint64(h.lo);
  } else {
    char d[18];
    d[0] = static_cast<char>(0xc4);
    d[1] = 16;
    const uint64_t hi = __builtin_bswap64(h.hi), lo = __builtin_bswap64(h.lo);
    std::memcpy(d + 2, &hi, 8);
    std::memcpy(d + 10, &lo, 8);
    buf.write(d, 18);
  }
}

void PackMediumOrNil(Packer& pk, const std::string& medium) {
  if (medium.empty()) {
    pk.pack_nil();
  } else {
    PackStr(pk, medium);
  }
}

// One event as msgspec encodes a tag=True struct without array_like: a map, the tag first, then
// the fields in declaration order; fields equal to their default left out (omit_defaults).
void PackEvent(OutBuffer& buf, Packer& pk, const VllmKvEvent& e, KvEventHashEncoding enc) {
  switch (e.type) {
    case VllmKvEvent::Type::kBlockStored: {
      const uint32_t n = 8 + (e.group_idx ? 1 : 0) + (e.kv_cache_spec_kind ? 1 : 0);
      pk.pack_map(n);
      PackStr(pk, "type");
      PackStr(pk, "BlockStored");
      PackStr(pk, "block_hashes");
      PackHashes(pk, e.block_hashes, enc);
      PackStr(pk, "parent_block_hash");
      if (e.parent_block_hash) {
        PackHash(pk, *e.parent_block_hash, enc);
      } else {
        pk.pack_nil();
      }
      PackStr(pk, "token_ids");
      PackTokens(buf, pk, e.token_ids);
      PackStr(pk, "block_size");
      pk.pack_uint32(e.block_size);
      PackStr(pk, "lora_id");
      pk.pack_nil();
      PackStr(pk, "medium");
      PackMediumOrNil(pk, e.medium);
      PackStr(pk, "lora_name");
      pk.pack_nil();
      if (e.group_idx) {
        PackStr(pk, "group_idx");
        pk.pack_int(*e.group_idx);
      }
      if (e.kv_cache_spec_kind) {
        PackStr(pk, "kv_cache_spec_kind");
        PackStr(pk, *e.kv_cache_spec_kind);
      }
      return;
    }
    case VllmKvEvent::Type::kBlockRemoved:
      pk.pack_map(3 + (e.group_idx ? 1 : 0));
      PackStr(pk, "type");
      PackStr(pk, "BlockRemoved");
      PackStr(pk, "block_hashes");
      PackHashes(pk, e.block_hashes, enc);
      PackStr(pk, "medium");
      PackMediumOrNil(pk, e.medium);
      if (e.group_idx) {
        PackStr(pk, "group_idx");
        pk.pack_int(*e.group_idx);
      }
      return;
    case VllmKvEvent::Type::kAllBlocksCleared:
      pk.pack_map(1);
      PackStr(pk, "type");
      PackStr(pk, "AllBlocksCleared");
      return;
  }
}

// Whether FromCacheEvent gives a vLLM event for `e` (stored or removed window or snapshot pages
// alone are not a block coming or going).
bool Publishable(KvEventType type, KindSet kinds) {
  if (type == KvEventType::kAllCleared || kinds.empty()) return true;
  return kinds.Has(CacheKind::kMlaLatent) || kinds.Has(CacheKind::kCsaCompressed) ||
         kinds.Has(CacheKind::kHcaCompressed) || kinds.Has(CacheKind::kIndexerKey);
}

// The publisher's queue: events in order, each a vLLM event (in `vllm`) or a manager's event
// whose hashes and tokens are ranges of the flat `hashes` and `tokens`, with the medium its
// Attach named. Producers append to one Pending while the publisher's thread encodes the other;
// the two swap each tick and keep their capacity, so neither thread allocates at steady state
// and no block of memory is freed on a thread other than the one that allocated it.
struct QueuedItem {
  bool from_vllm = false;
  KvEventType type = KvEventType::kBlocksStored;
  uint32_t block_tokens = 0;
  uint32_t vllm_index = 0;
  BlockHash parent;
  size_t hash_begin = 0, hash_count = 0;
  size_t token_begin = 0, token_count = 0;
  const std::string* medium = nullptr;
};

struct Pending {
  std::vector<QueuedItem> items;
  std::vector<BlockHash> hashes;
  std::vector<TokenId> tokens;
  std::vector<VllmKvEvent> vllm;
  void clear() {
    items.clear();
    hashes.clear();
    tokens.clear();
    vllm.clear();
  }
};

void PackQueued(OutBuffer& buf, Packer& pk, const Pending& p, const QueuedItem& it, KvEventHashEncoding enc) {
  if (it.from_vllm) {
    PackEvent(buf, pk, p.vllm[it.vllm_index], enc);
    return;
  }
  const std::span<const BlockHash> hashes(p.hashes.data() + it.hash_begin, it.hash_count);
  switch (it.type) {
    case KvEventType::kBlocksStored:
      pk.pack_map(8);
      PackStr(pk, "type");
      PackStr(pk, "BlockStored");
      PackStr(pk, "block_hashes");
      PackBlockHashes(buf, pk, hashes, enc);
      PackStr(pk, "parent_block_hash");
      PackBlockHash(buf, pk, it.parent, enc);
      PackStr(pk, "token_ids");
      PackTokens(buf, pk, std::span<const TokenId>(p.tokens.data() + it.token_begin, it.token_count));
      PackStr(pk, "block_size");
      pk.pack_uint32(it.block_tokens);
      PackStr(pk, "lora_id");
      pk.pack_nil();
      PackStr(pk, "medium");
      PackMediumOrNil(pk, *it.medium);
      PackStr(pk, "lora_name");
      pk.pack_nil();
      return;
    case KvEventType::kBlocksRemoved:
      pk.pack_map(3);
      PackStr(pk, "type");
      PackStr(pk, "BlockRemoved");
      PackStr(pk, "block_hashes");
      PackBlockHashes(buf, pk, hashes, enc);
      PackStr(pk, "medium");
      PackMediumOrNil(pk, *it.medium);
      return;
    case KvEventType::kAllCleared:
      pk.pack_map(1);
      PackStr(pk, "type");
      PackStr(pk, "AllBlocksCleared");
      return;
  }
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string_view KvEventHashEncodingName(KvEventHashEncoding e) {
  return e == KvEventHashEncoding::kBytes ? "bytes" : "uint64";
}

Result<KvEventHashEncoding> ParseKvEventHashEncoding(std::string_view name) {
  if (name == "uint64") return KvEventHashEncoding::kUint64;
  if (name == "bytes") return KvEventHashEncoding::kBytes;
  return Status::InvalidArgument(fmt::format("kv_events hash '{}': expected \"uint64\" or \"bytes\"", name));
}

std::string DefaultKvEventTopic(std::string_view model) {
  std::string pod;
  if (const char* p = std::getenv("POD_NAME"); p != nullptr && *p != '\0') {
    pod = p;
  } else {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) == 0) pod = host;
  }
  if (pod.empty()) pod = "localhost";
  return fmt::format("kv@{}@{}", pod, model);
}

KvEventDigest DigestOf(const BlockHash& h) {
  KvEventDigest d;
  const uint64_t hi = __builtin_bswap64(h.hi), lo = __builtin_bswap64(h.lo);  // big-endian
  std::memcpy(d.data(), &hi, 8);
  std::memcpy(d.data() + 8, &lo, 8);
  return d;
}

namespace {

void EncodeInto(OutBuffer& buf, double ts, std::span<const VllmKvEvent> events, KvEventHashEncoding hash,
                int data_parallel_rank) {
  Packer pk(buf);
  // EventBatch is array_like: [ts, events, data_parallel_rank].
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const VllmKvEvent& e : events) PackEvent(buf, pk, e, hash);
  pk.pack_int(data_parallel_rank);
}

void EncodeQueued(OutBuffer& buf, double ts, const Pending& p, size_t begin, size_t end,
                  KvEventHashEncoding hash, int data_parallel_rank) {
  Packer pk(buf);
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(end - begin));
  for (size_t i = begin; i < end; ++i) PackQueued(buf, pk, p, p.items[i], hash);
  pk.pack_int(data_parallel_rank);
}

}  // namespace

std::vector<uint8_t> VllmKvEventPublisher::EncodeBatch(double ts, std::span<const VllmKvEvent> events,
                                                       KvEventHashEncoding hash, int data_parallel_rank) {
  OutBuffer buf;
  EncodeInto(buf, ts, events, hash, data_parallel_rank);
  const auto* p = reinterpret_cast<const uint8_t*>(buf.data());
  return std::vector<uint8_t>(p, p + buf.size());
}

std::optional<VllmKvEvent> VllmKvEventPublisher::FromCacheEvent(const KvEvent& e, const std::string& medium) {
  // A stored or removed event of window or snapshot pages alone is not a block coming or going.
  if (!Publishable(e.type, e.kinds)) return std::nullopt;
  VllmKvEvent out;
  out.medium = medium;
  switch (e.type) {
    case KvEventType::kBlocksStored:
      out.type = VllmKvEvent::Type::kBlockStored;
      out.block_hashes.reserve(e.block_hashes.size());
      for (const BlockHash& h : e.block_hashes) out.block_hashes.push_back(DigestOf(h));
      out.parent_block_hash = DigestOf(e.parent_hash);
      out.token_ids = e.token_ids;
      out.block_size = e.block_tokens;
      return out;
    case KvEventType::kBlocksRemoved:
      out.type = VllmKvEvent::Type::kBlockRemoved;
      out.block_hashes.reserve(e.block_hashes.size());
      for (const BlockHash& h : e.block_hashes) out.block_hashes.push_back(DigestOf(h));
      return out;
    case KvEventType::kAllCleared:
      out.type = VllmKvEvent::Type::kAllBlocksCleared;
      out.medium.clear();
      return out;
  }
  return std::nullopt;
}

// Payload buffers lent to ZMQ with the message (no copy) and given back by its free callback,
// on ZMQ's I/O thread once the message is sent or dropped: a buffer comes back with its capacity,
// so a steady stream of large batches neither copies them nor faults in fresh pages for each.
class PayloadPool {
 public:
  struct Lent {
    PayloadPool* pool = nullptr;
    OutBuffer buf{64 * 1024};
    // Set (release) when the buffer goes to ZMQ, read (acquire) when it comes back: ZMQ hands
    // the message between threads through its own lock-free pipes, which ThreadSanitizer does
    // not see in an uninstrumented libzmq; this makes the order it guarantees visible.
    std::atomic<bool> handed{false};
  };
  ~PayloadPool() {
    for (Lent* l : free_) delete l;
  }
  Lent* Take() {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!free_.empty()) {
        Lent* b = free_.back();
        free_.pop_back();
        b->buf.clear();
        return b;
      }
    }
    auto* b = new Lent;
    b->pool = this;
    return b;
  }
  static void GiveBack(void* /*data*/, void* hint) {
    auto* b = static_cast<Lent*>(hint);
    (void)b->handed.load(std::memory_order_acquire);
    PayloadPool* pool = b->pool;
    std::lock_guard<std::mutex> l(pool->mu_);
    if (pool->free_.size() < kKeep) {
      pool->free_.push_back(b);
      return;
    }
    delete b;
  }

 private:
  static constexpr size_t kKeep = 4;
  std::mutex mu_;
  std::vector<Lent*> free_;
};

class VllmKvEventPublisher::Impl {
 public:
  explicit Impl(const VllmKvEventOptions& o) : options_(o), ctx_(1), pub_(ctx_, zmq::socket_type::pub) {}

  Status Bind() {
    try {
      pub_.set(zmq::sockopt::sndhwm, options_.send_hwm);
      pub_.set(zmq::sockopt::linger, 0);
      pub_.bind(options_.endpoint);
      if (!options_.replay_endpoint.empty()) {
        replay_.emplace(ctx_, zmq::socket_type::router);
        replay_->set(zmq::sockopt::linger, 0);
        replay_->bind(options_.replay_endpoint);
      }
    } catch (const zmq::error_t& e) {
      return Status::InvalidArgument(fmt::format("kv_events: cannot bind '{}' / '{}': {}", options_.endpoint,
                                                 options_.replay_endpoint, e.what()));
    }
    thread_ = std::thread([this] { Run(); });
    return Status::OK();
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  size_t Publish(std::vector<VllmKvEvent>& events) {
    size_t dropped = 0;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (VllmKvEvent& e : events) {
        if (in_.items.size() >= options_.max_queued_events) {
          ++dropped;
          continue;
        }
        QueuedItem it;
        it.from_vllm = true;
        it.vllm_index = static_cast<uint32_t>(in_.vllm.size());
        in_.vllm.push_back(std::move(e));
        in_.items.push_back(it);
      }
      stats_.dropped_events += dropped;
      stats_.accepted_events += events.size() - dropped;
      if (dropped > 0) drops_pending_ = true;
    }
    return dropped;
  }

  // A manager's delivered run: the publishable events are copied into the queue's flat arrays
  // under one lock.
  void PublishCacheEvents(const KvEventRun& run, const std::string* medium) {
    std::lock_guard<std::mutex> l(mu_);
    size_t accepted = 0, dropped = 0;
    for (const KvEventRecord& e : run.events) {
      if (!Publishable(e.type, e.kinds)) continue;
      if (in_.items.size() >= options_.max_queued_events) {
        ++dropped;
        continue;
      }
      QueuedItem it;
      it.type = e.type;
      it.block_tokens = e.block_tokens;
      it.parent = e.parent_hash;
      it.medium = medium;
      const auto hashes = run.HashesOf(e);
      it.hash_begin = in_.hashes.size();
      it.hash_count = hashes.size();
      in_.hashes.insert(in_.hashes.end(), hashes.begin(), hashes.end());
      const auto tokens = run.TokensOf(e);
      it.token_begin = in_.tokens.size();
      it.token_count = tokens.size();
      in_.tokens.insert(in_.tokens.end(), tokens.begin(), tokens.end());
      in_.items.push_back(it);
      ++accepted;
    }
    stats_.dropped_events += dropped;
    stats_.accepted_events += accepted;
    if (dropped > 0) drops_pending_ = true;
  }

  // The medium names Attach was given, kept for as long as the publisher (queued events point
  // at them).
  const std::string* InternMedium(std::string medium) {
    std::lock_guard<std::mutex> l(mu_);
    for (const std::string& m : mediums_) {
      if (m == medium) return &m;
    }
    return &mediums_.emplace_back(std::move(medium));
  }

  void Flush() {
    std::unique_lock<std::mutex> l(mu_);
    if (stopped_) return;
    flush_waiters_ = true;
    cv_.notify_all();
    // Woken after each batch is sent: done once nothing is queued (the last batch went out).
    done_cv_.wait(l, [&] { return (in_.items.empty() && !flush_waiters_) || stopped_; });
  }

  VllmKvEventStats Stats() const {
    std::lock_guard<std::mutex> l(mu_);
    VllmKvEventStats s = stats_;
    s.queued_events = in_.items.size();
    return s;
  }

  const VllmKvEventOptions& options() const { return options_; }

 private:
  void Run() {
    const auto tick = std::chrono::milliseconds(options_.tick_ms);
    std::chrono::steady_clock::time_point stop_by{};
    for (;;) {
      // Until the tick ends (or a flush or stop asks): serve replay requests, or sleep.
      const auto deadline = std::chrono::steady_clock::now() + tick;
      for (;;) {
        {
          std::unique_lock<std::mutex> l(mu_);
          if (stop_ || flush_waiters_) break;
          if (!replay_) {
            cv_.wait_until(l, deadline, [&] { return stop_ || flush_waiters_; });
            break;
          }
        }
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) break;
        ServeReplay(static_cast<int>(
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1));
      }
      ServeReplay(0);
      // Everything queued goes out now, in batches of at most max_batch_events: the producers'
      // buffers are swapped for the (empty) ones sent last tick.
      bool stopping = false;
      {
        std::lock_guard<std::mutex> l(mu_);
        stopping = stop_;
        std::swap(in_, out_);
        if (drops_pending_) {
          drops_pending_ = false;
          ++stats_.sequence_gaps;
          ++next_seq_;  // the dropped events' batch: a subscriber sees the gap
          stats_.next_sequence = next_seq_;
        }
      }
      const size_t per_batch = std::max<uint32_t>(1, options_.max_batch_events);
      for (size_t begin = 0; begin < out_.items.size(); begin += per_batch) {
        Send(out_, begin, std::min(out_.items.size(), begin + per_batch));
      }
      out_.clear();
      {
        std::lock_guard<std::mutex> l(mu_);
        if (in_.items.empty()) flush_waiters_ = false;
      }
      done_cv_.notify_all();
      if (stopping) {
        const auto now = std::chrono::steady_clock::now();
        if (stop_by.time_since_epoch().count() == 0) stop_by = now + std::chrono::seconds(1);
        std::lock_guard<std::mutex> l(mu_);
        if (in_.items.empty() || now > stop_by) {
          stopped_ = true;
          done_cv_.notify_all();
          return;
        }
      }
    }
  }

  void Send(const Pending& p, size_t begin, size_t end) {
    PayloadPool::Lent* lent = pool_.Take();
    OutBuffer& buf = lent->buf;
    EncodeQueued(buf, NowSeconds(), p, begin, end, options_.hash, options_.data_parallel_rank);
    uint64_t seq;
    {
      std::lock_guard<std::mutex> l(mu_);
      seq = next_seq_++;
      stats_.next_sequence = next_seq_;
      stats_.published_batches++;
      stats_.published_events += end - begin;
    }
    if (replay_ && options_.buffer_batches > 0) {
      const auto* b = reinterpret_cast<const uint8_t*>(buf.data());
      ring_.emplace_back(seq, std::vector<uint8_t>(b, b + buf.size()));
      while (ring_.size() > options_.buffer_batches) ring_.pop_front();
    }
    uint8_t seq_bytes[8];
    PutBigEndian64(seq, seq_bytes);
    // The message owns the buffer from here: ZMQ gives it back to the pool when done with it,
    // and so does the message's destructor when a send fails.
    char* const data = buf.data();
    const size_t size = buf.size();
    lent->handed.store(true, std::memory_order_release);  // nothing here touches `lent` after this
    zmq::message_t payload(data, size, &PayloadPool::GiveBack, lent);
    try {
      // A PUB socket never blocks: past the high-water mark ZMQ drops the message for that
      // subscriber, which then sees a gap.
      pub_.send(zmq::buffer(options_.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      pub_.send(zmq::buffer(seq_bytes, 8), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      pub_.send(std::move(payload), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // Counted as published: the replay buffer still has it.
    }
  }

  // Answers waiting replay requests (vLLM's framing); `timeout_ms` 0 only looks.
  void ServeReplay(int timeout_ms) {
    if (!replay_) return;
    for (;;) {
      zmq::pollitem_t item{replay_->handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) <= 0) return;
      std::vector<zmq::message_t> frames;
      for (;;) {
        zmq::message_t m;
        if (!replay_->recv(m, zmq::recv_flags::dontwait)) break;
        const bool more = m.more();
        frames.push_back(std::move(m));
        if (!more) break;
      }
      if (frames.size() != 3 || frames[1].size() != 0 || frames[2].size() != 8) continue;  // as vLLM: ignored
      uint64_t start = 0;
      const auto* b = static_cast<const uint8_t*>(frames[2].data());
      for (int i = 0; i < 8; ++i) start = (start << 8) | b[i];
      const std::string id(static_cast<const char*>(frames[0].data()), frames[0].size());
      {
        // Counted before the answer goes: a requester that has read the answer sees it counted.
        std::lock_guard<std::mutex> l(mu_);
        ++stats_.replay_requests;
      }
      try {
        for (const auto& [seq, payload] : ring_) {
          if (seq < start) continue;
          uint8_t seq_bytes[8];
          PutBigEndian64(seq, seq_bytes);
          replay_->send(zmq::buffer(id), zmq::send_flags::sndmore);
          replay_->send(zmq::message_t(), zmq::send_flags::sndmore);
          replay_->send(zmq::buffer(options_.topic), zmq::send_flags::sndmore);
          replay_->send(zmq::buffer(seq_bytes, 8), zmq::send_flags::sndmore);
          replay_->send(zmq::buffer(payload), zmq::send_flags::none);
          std::lock_guard<std::mutex> l(mu_);  // counted before the end marker goes
          ++stats_.replayed_batches;
        }
        replay_->send(zmq::buffer(id), zmq::send_flags::sndmore);
        replay_->send(zmq::message_t(), zmq::send_flags::sndmore);
        replay_->send(zmq::message_t(), zmq::send_flags::sndmore);
        replay_->send(zmq::buffer(kEndSeq, 8), zmq::send_flags::sndmore);
        replay_->send(zmq::message_t(), zmq::send_flags::none);
      } catch (const zmq::error_t&) {
      }
    }
  }

  const VllmKvEventOptions options_;
  PayloadPool pool_;  // before ctx_: outlives every message ZMQ still holds
  zmq::context_t ctx_;
  zmq::socket_t pub_;
  std::optional<zmq::socket_t> replay_;
  // Publisher thread only.
  std::deque<std::pair<uint64_t, std::vector<uint8_t>>> ring_;
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  Pending in_;  // guarded by mu_: what producers queue
  Pending out_;  // the publisher thread's: what it sends this tick
  std::deque<std::string> mediums_;
  bool drops_pending_ = false;
  bool stop_ = false;
  bool flush_waiters_ = false;
  bool stopped_ = false;
  uint64_t next_seq_ = 0;
  VllmKvEventStats stats_;
};

VllmKvEventPublisher::VllmKvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VllmKvEventPublisher::~VllmKvEventPublisher() = default;

Result<std::unique_ptr<VllmKvEventPublisher>> VllmKvEventPublisher::Start(const VllmKvEventOptions& options) {
  if (options.endpoint.empty()) return Status::InvalidArgument("kv_events: endpoint is empty");
  if (options.tick_ms == 0) return Status::InvalidArgument("kv_events: tick_ms must be at least 1");
  auto impl = std::make_unique<Impl>(options);
  SPARSEKV_RETURN_IF_ERROR(impl->Bind());
  return std::unique_ptr<VllmKvEventPublisher>(new VllmKvEventPublisher(std::move(impl)));
}

size_t VllmKvEventPublisher::Publish(std::vector<VllmKvEvent> events) { return impl_->Publish(events); }
size_t VllmKvEventPublisher::Publish(VllmKvEvent event) {
  std::vector<VllmKvEvent> v;
  v.push_back(std::move(event));
  return impl_->Publish(v);
}
void VllmKvEventPublisher::Flush() { impl_->Flush(); }
VllmKvEventStats VllmKvEventPublisher::Stats() const { return impl_->Stats(); }
const VllmKvEventOptions& VllmKvEventPublisher::options() const { return impl_->options(); }

SubscriptionId VllmKvEventPublisher::Attach(CacheManager& manager, std::string medium) {
  // A delivered run of the manager's events is appended to the queue's flat arrays under one
  // lock and encoded on the publisher's thread.
  const std::string* m = impl_->InternMedium(std::move(medium));
  Impl* impl = impl_.get();
  return manager.SubscribeBatch([impl, m](const KvEventRun& run) { impl->PublishCacheEvents(run, m); });
}

}  // namespace sparsekv
