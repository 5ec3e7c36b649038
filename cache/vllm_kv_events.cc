#include "sparsekv/vllm_kv_events.h"

#include <fmt/format.h>
#include <unistd.h>

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

using Packer = msgpack::packer<msgpack::sbuffer>;

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

void PackMediumOrNil(Packer& pk, const std::string& medium) {
  if (medium.empty()) {
    pk.pack_nil();
  } else {
    PackStr(pk, medium);
  }
}

// One event as msgspec encodes a tag=True struct without array_like: a map, the tag first, then
// the fields in declaration order; fields equal to their default left out (omit_defaults).
void PackEvent(Packer& pk, const VllmKvEvent& e, KvEventHashEncoding enc) {
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
      pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
      for (uint32_t t : e.token_ids) pk.pack_uint32(t);
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

void EncodeInto(msgpack::sbuffer& buf, double ts, std::span<const VllmKvEvent> events, KvEventHashEncoding hash,
                int data_parallel_rank) {
  Packer pk(buf);
  // EventBatch is array_like: [ts, events, data_parallel_rank].
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const VllmKvEvent& e : events) PackEvent(pk, e, hash);
  pk.pack_int(data_parallel_rank);
}

}  // namespace

std::vector<uint8_t> VllmKvEventPublisher::EncodeBatch(double ts, std::span<const VllmKvEvent> events,
                                                       KvEventHashEncoding hash, int data_parallel_rank) {
  msgpack::sbuffer buf;
  EncodeInto(buf, ts, events, hash, data_parallel_rank);
  const auto* p = reinterpret_cast<const uint8_t*>(buf.data());
  return std::vector<uint8_t>(p, p + buf.size());
}

std::optional<VllmKvEvent> VllmKvEventPublisher::FromCacheEvent(const KvEvent& e, const std::string& medium) {
  VllmKvEvent out;
  out.medium = medium;
  switch (e.type) {
    case KvEventType::kBlocksStored:
      // A stored event that only gives back window or snapshot pages is not a new block.
      if (!e.kinds.Has(CacheKind::kMlaLatent) && !e.kinds.Has(CacheKind::kCsaCompressed) &&
          !e.kinds.Has(CacheKind::kHcaCompressed) && !e.kinds.Has(CacheKind::kIndexerKey) && !e.kinds.empty()) {
        return std::nullopt;
      }
      out.type = VllmKvEvent::Type::kBlockStored;
      out.block_hashes.reserve(e.block_hashes.size());
      for (const BlockHash& h : e.block_hashes) out.block_hashes.push_back(DigestOf(h));
      out.parent_block_hash = DigestOf(e.parent_hash);
      out.token_ids = e.token_ids;
      out.block_size = e.block_tokens;
      return out;
    case KvEventType::kBlocksRemoved:
      if (!e.kinds.Has(CacheKind::kMlaLatent) && !e.kinds.Has(CacheKind::kCsaCompressed) &&
          !e.kinds.Has(CacheKind::kHcaCompressed) && !e.kinds.Has(CacheKind::kIndexerKey) && !e.kinds.empty()) {
        return std::nullopt;
      }
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
        if (queue_.size() >= options_.max_queued_events) {
          ++dropped;
          continue;
        }
        queue_.push_back(std::move(e));
      }
      stats_.dropped_events += dropped;
      stats_.accepted_events += events.size() - dropped;
      if (dropped > 0) drops_pending_ = true;
    }
    return dropped;
  }

  void Flush() {
    std::unique_lock<std::mutex> l(mu_);
    if (stopped_) return;
    flush_waiters_ = true;
    cv_.notify_all();
    // Woken after each batch is sent: done once nothing is queued (the last batch went out).
    done_cv_.wait(l, [&] { return (queue_.empty() && !flush_waiters_) || stopped_; });
  }

  VllmKvEventStats Stats() const {
    std::lock_guard<std::mutex> l(mu_);
    VllmKvEventStats s = stats_;
    s.queued_events = queue_.size();
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
      // Everything queued goes out now, in batches of at most max_batch_events (a queue left to
      // grow between ticks would hold the memory of every event not yet sent).
      bool stopping = false;
      for (;;) {
        std::vector<VllmKvEvent> batch;
        {
          std::lock_guard<std::mutex> l(mu_);
          stopping = stop_;
          const size_t n = std::min<size_t>(queue_.size(), std::max<uint32_t>(1, options_.max_batch_events));
          batch.reserve(n);
          for (size_t i = 0; i < n; ++i) {
            batch.push_back(std::move(queue_.front()));
            queue_.pop_front();
          }
          if (drops_pending_) {
            drops_pending_ = false;
            ++stats_.sequence_gaps;
            ++next_seq_;  // the dropped events' batch: a subscriber sees the gap
            stats_.next_sequence = next_seq_;
          }
        }
        if (batch.empty()) break;
        Send(batch);
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        if (queue_.empty()) flush_waiters_ = false;
      }
      done_cv_.notify_all();
      if (stopping) {
        const auto now = std::chrono::steady_clock::now();
        if (stop_by.time_since_epoch().count() == 0) stop_by = now + std::chrono::seconds(1);
        std::lock_guard<std::mutex> l(mu_);
        if (queue_.empty() || now > stop_by) {
          stopped_ = true;
          done_cv_.notify_all();
          return;
        }
      }
    }
  }

  void Send(const std::vector<VllmKvEvent>& batch) {
    // One buffer for every batch: a fresh one per batch would fault its pages in each time.
    buf_.clear();
    EncodeInto(buf_, NowSeconds(), batch, options_.hash, options_.data_parallel_rank);
    uint64_t seq;
    {
      std::lock_guard<std::mutex> l(mu_);
      seq = next_seq_++;
      stats_.next_sequence = next_seq_;
      stats_.published_batches++;
      stats_.published_events += batch.size();
    }
    uint8_t seq_bytes[8];
    PutBigEndian64(seq, seq_bytes);
    try {
      // A PUB socket never blocks: past the high-water mark ZMQ drops the message for that
      // subscriber, which then sees a gap.
      pub_.send(zmq::buffer(options_.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      pub_.send(zmq::buffer(seq_bytes, 8), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      pub_.send(zmq::buffer(buf_.data(), buf_.size()), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // Counted as published: the replay buffer still has it.
    }
    if (replay_ && options_.buffer_batches > 0) {
      const auto* p = reinterpret_cast<const uint8_t*>(buf_.data());
      ring_.emplace_back(seq, std::vector<uint8_t>(p, p + buf_.size()));
      while (ring_.size() > options_.buffer_batches) ring_.pop_front();
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
      uint64_t sent = 0;
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
          ++sent;
        }
        replay_->send(zmq::buffer(id), zmq::send_flags::sndmore);
        replay_->send(zmq::message_t(), zmq::send_flags::sndmore);
        replay_->send(zmq::message_t(), zmq::send_flags::sndmore);
        replay_->send(zmq::buffer(kEndSeq, 8), zmq::send_flags::sndmore);
        replay_->send(zmq::message_t(), zmq::send_flags::none);
      } catch (const zmq::error_t&) {
      }
      std::lock_guard<std::mutex> l(mu_);
      ++stats_.replay_requests;
      stats_.replayed_batches += sent;
    }
  }

  const VllmKvEventOptions options_;
  zmq::context_t ctx_;
  zmq::socket_t pub_;
  std::optional<zmq::socket_t> replay_;
  // Publisher thread only.
  std::deque<std::pair<uint64_t, std::vector<uint8_t>>> ring_;
  msgpack::sbuffer buf_;
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<VllmKvEvent> queue_;
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
  return manager.Subscribe([this, medium = std::move(medium)](const KvEvent& e) {
    if (auto v = FromCacheEvent(e, medium)) Publish(std::move(*v));
  });
}

}  // namespace sparsekv
