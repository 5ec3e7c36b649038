// VllmKvEventPublisher against a real ZMQ subscriber: the three frames, sequence numbers from 0,
// drops on a full queue as sequence gaps, replay over the ROUTER socket with vLLM's framing, and
// the payload layout (array batch, "type"-tagged map events).
#include "sparsekv/vllm_kv_events.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <msgpack.hpp>
#include <thread>
#include <zmq.hpp>

#include "sparsekv/cache_manager.h"
#include "sparsekv/model_spec.h"

namespace sparsekv {
namespace {

std::string Endpoint(const char* what) {
  static std::atomic<int> n{0};
  return "ipc:///tmp/sparsekv-kvev-" + std::to_string(getpid()) + "-" + what + "-" + std::to_string(n++);
}

uint64_t BigEndian(const zmq::message_t& m) {
  EXPECT_EQ(m.size(), 8u);
  uint64_t v = 0;
  for (size_t i = 0; i < m.size(); ++i) v = (v << 8) | static_cast<const uint8_t*>(m.data())[i];
  return v;
}

KvEventDigest Digest(uint8_t seed) {
  KvEventDigest d{};
  for (int i = 0; i < 16; ++i) d[i] = static_cast<uint8_t>(seed + i);
  return d;
}

VllmKvEvent Stored(uint8_t seed, const std::string& medium = "GPU") {
  VllmKvEvent e;
  e.type = VllmKvEvent::Type::kBlockStored;
  e.block_hashes = {Digest(seed)};
  e.parent_block_hash = Digest(seed + 100);
  e.token_ids = {1, 2, 3, 4};
  e.block_size = 4;
  e.medium = medium;
  return e;
}

struct Message {
  std::string topic;
  uint64_t seq = 0;
  std::string payload;
};

class Subscriber {
 public:
  explicit Subscriber(const std::string& endpoint) : sub_(ctx_, zmq::socket_type::sub) {
    sub_.set(zmq::sockopt::subscribe, "");
    sub_.connect(endpoint);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // ZMQ's slow joiner
  }
  std::optional<Message> Receive(int timeout_ms = 2000) {
    zmq::pollitem_t item{sub_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) <= 0) return std::nullopt;
    std::vector<zmq::message_t> frames;
    for (;;) {
      zmq::message_t m;
      EXPECT_TRUE(sub_.recv(m));
      const bool more = m.more();
      frames.push_back(std::move(m));
      if (!more) break;
    }
    EXPECT_EQ(frames.size(), 3u);
    if (frames.size() != 3) return std::nullopt;
    return Message{frames[0].to_string(), BigEndian(frames[1]), frames[2].to_string()};
  }

 private:
  zmq::context_t ctx_{1};
  zmq::socket_t sub_;
};

std::unique_ptr<VllmKvEventPublisher> StartPublisher(VllmKvEventOptions o) {
  auto p = VllmKvEventPublisher::Start(o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

// The value of key `k` in a msgpack map, or nullptr.
const msgpack::object* Field(const msgpack::object& map, const std::string& k) {
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    if (map.via.map.ptr[i].key.as<std::string>() == k) return &map.via.map.ptr[i].val;
  }
  return nullptr;
}

TEST(VllmKvEvents, ThreeFramesAndTheReferenceLayout) {
  VllmKvEventOptions o;
  o.endpoint = Endpoint("pub");
  o.topic = "kv@pod-1@deepseek";
  o.tick_ms = 5;
  auto pub = StartPublisher(o);
  Subscriber sub(o.endpoint);
  VllmKvEvent removed;
  removed.type = VllmKvEvent::Type::kBlockRemoved;
  removed.block_hashes = {Digest(1)};
  removed.medium = "GPU";
  VllmKvEvent cleared;
  cleared.type = VllmKvEvent::Type::kAllBlocksCleared;
  pub->Publish({Stored(1), removed, cleared});
  pub->Flush();
  auto m = sub.Receive();
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->topic, "kv@pod-1@deepseek");
  EXPECT_EQ(m->seq, 0u);
  msgpack::object_handle oh = msgpack::unpack(m->payload.data(), m->payload.size());
  const msgpack::object& batch = oh.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 3u);  // [ts, events, data_parallel_rank]
  EXPECT_EQ(batch.via.array.ptr[0].type, msgpack::type::FLOAT64);
  EXPECT_EQ(batch.via.array.ptr[2].as<int>(), 0);
  const msgpack::object& events = batch.via.array.ptr[1];
  ASSERT_EQ(events.via.array.size, 3u);
  const msgpack::object& st = events.via.array.ptr[0];
  ASSERT_EQ(st.type, msgpack::type::MAP);
  // The tag comes first, then the fields in vLLM's declaration order.
  std::vector<std::string> keys;
  for (uint32_t i = 0; i < st.via.map.size; ++i) keys.push_back(st.via.map.ptr[i].key.as<std::string>());
  EXPECT_EQ(keys, (std::vector<std::string>{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                            "lora_id", "medium", "lora_name"}));
  EXPECT_EQ(Field(st, "type")->as<std::string>(), "BlockStored");
  // uint64 mode: the digest's last 8 bytes, big-endian.
  EXPECT_EQ(Field(st, "block_hashes")->via.array.ptr[0].as<uint64_t>(), 0x090a0b0c0d0e0f10ull);
  EXPECT_EQ(Field(st, "parent_block_hash")->as<uint64_t>(), 0x6d6e6f7071727374ull);
  EXPECT_EQ(Field(st, "token_ids")->as<std::vector<uint32_t>>(), (std::vector<uint32_t>{1, 2, 3, 4}));
  EXPECT_EQ(Field(st, "block_size")->as<int>(), 4);
  EXPECT_TRUE(Field(st, "lora_id")->is_nil());
  EXPECT_EQ(Field(st, "medium")->as<std::string>(), "GPU");
  const msgpack::object& rm = events.via.array.ptr[1];
  ASSERT_EQ(rm.via.map.size, 3u);
  EXPECT_EQ(Field(rm, "type")->as<std::string>(), "BlockRemoved");
  EXPECT_EQ(Field(rm, "medium")->as<std::string>(), "GPU");
  const msgpack::object& cl = events.via.array.ptr[2];
  ASSERT_EQ(cl.via.map.size, 1u);
  EXPECT_EQ(Field(cl, "type")->as<std::string>(), "AllBlocksCleared");
}

TEST(VllmKvEvents, BytesHashesAreTheSixteenDigestBytes) {
  VllmKvEvent e = Stored(7);
  auto payload = VllmKvEventPublisher::EncodeBatch(1.5, {&e, 1}, KvEventHashEncoding::kBytes, 3);
  msgpack::object_handle oh = msgpack::unpack(reinterpret_cast<const char*>(payload.data()), payload.size());
  const msgpack::object& ev = oh.get().via.array.ptr[1].via.array.ptr[0];
  const msgpack::object& h = Field(ev, "block_hashes")->via.array.ptr[0];
  ASSERT_EQ(h.type, msgpack::type::BIN);
  ASSERT_EQ(h.via.bin.size, 16u);
  EXPECT_EQ(0, std::memcmp(h.via.bin.ptr, Digest(7).data(), 16));
  EXPECT_EQ(oh.get().via.array.ptr[2].as<int>(), 3);
  EXPECT_DOUBLE_EQ(oh.get().via.array.ptr[0].as<double>(), 1.5);
}

TEST(VllmKvEvents, SequenceNumbersCountBatchesFromZero) {
  VllmKvEventOptions o;
  o.endpoint = Endpoint("seq");
  o.tick_ms = 2;
  auto pub = StartPublisher(o);
  Subscriber sub(o.endpoint);
  for (uint8_t i = 0; i < 5; ++i) {
    pub->Publish(Stored(i));
    pub->Flush();
  }
  for (uint64_t want = 0; want < 5; ++want) {
    auto m = sub.Receive();
    ASSERT_TRUE(m.has_value());
    EXPECT_EQ(m->seq, want);
  }
  EXPECT_EQ(pub->Stats().published_batches, 5u);
}

TEST(VllmKvEvents, AFullQueueDropsAndTheSubscriberSeesAGap) {
  VllmKvEventOptions o;
  o.endpoint = Endpoint("drop");
  o.tick_ms = 50;
  o.max_queued_events = 2;
  auto pub = StartPublisher(o);
  Subscriber sub(o.endpoint);
  pub->Publish(Stored(1));
  pub->Flush();
  // Five events at once into a queue of two: three are dropped, and never block the caller.
  EXPECT_EQ(pub->Publish({Stored(2), Stored(3), Stored(4), Stored(5), Stored(6)}), 3u);
  pub->Flush();
  auto a = sub.Receive();
  auto b = sub.Receive();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->seq, 0u);
  EXPECT_EQ(b->seq, 2u) << "the dropped events must show as a sequence gap";
  const VllmKvEventStats s = pub->Stats();
  EXPECT_EQ(s.dropped_events, 3u);
  EXPECT_EQ(s.sequence_gaps, 1u);
}

TEST(VllmKvEvents, ATickSendsEverythingQueuedInBatchesOfAtMostMaxBatchEvents) {
  VllmKvEventOptions o;
  o.endpoint = Endpoint("drain");
  o.tick_ms = 60000;  // one tick: only the Flush makes it
  o.max_batch_events = 100;
  auto pub = StartPublisher(o);
  Subscriber sub(o.endpoint);
  std::vector<VllmKvEvent> events;
  for (int i = 0; i < 1050; ++i) events.push_back(Stored(static_cast<uint8_t>(i)));
  EXPECT_EQ(pub->Publish(std::move(events)), 0u);
  EXPECT_EQ(pub->Stats().accepted_events, 1050u);
  pub->Flush();
  const VllmKvEventStats s = pub->Stats();
  EXPECT_EQ(s.published_batches, 11u);
  EXPECT_EQ(s.published_events, 1050u);
  EXPECT_EQ(s.queued_events, 0u);
  for (uint64_t want = 0; want < 11; ++want) {
    auto m = sub.Receive();
    ASSERT_TRUE(m.has_value());
    EXPECT_EQ(m->seq, want);
    msgpack::object_handle h = msgpack::unpack(m->payload.data(), m->payload.size());
    EXPECT_EQ(h.get().via.array.ptr[1].via.array.size, want < 10 ? 100u : 50u);
  }
}

TEST(VllmKvEvents, ReplayAnswersWithVllmsFraming) {
  VllmKvEventOptions o;
  o.endpoint = Endpoint("rpub");
  o.replay_endpoint = Endpoint("replay");
  o.topic = "kv@p@m";
  o.tick_ms = 2;
  o.buffer_batches = 4;
  auto pub = StartPublisher(o);
  for (uint8_t i = 0; i < 6; ++i) {
    pub->Publish(Stored(i));
    pub->Flush();
  }
  zmq::context_t ctx{1};
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.connect(o.replay_endpoint);
  uint8_t start[8] = {0, 0, 0, 0, 0, 0, 0, 1};  // from 1: the buffer holds 2..5 only
  dealer.send(zmq::message_t(), zmq::send_flags::sndmore);
  dealer.send(zmq::buffer(start, 8), zmq::send_flags::none);
  std::vector<uint64_t> seqs;
  bool ended = false;
  for (int guard = 0; guard < 20 && !ended; ++guard) {
    zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
    ASSERT_GT(zmq::poll(&item, 1, std::chrono::milliseconds(3000)), 0) << "no replay reply";
    std::vector<zmq::message_t> frames;
    for (;;) {
      zmq::message_t m;
      ASSERT_TRUE(dealer.recv(m));
      const bool more = m.more();
      frames.push_back(std::move(m));
      if (!more) break;
    }
    // ["", topic, seq, payload]; the end: ["", "", -1, ""].
    ASSERT_EQ(frames.size(), 4u);
    EXPECT_EQ(frames[0].size(), 0u);
    const uint64_t seq = BigEndian(frames[2]);
    if (seq == UINT64_MAX) {
      EXPECT_EQ(frames[1].size(), 0u);
      EXPECT_EQ(frames[3].size(), 0u);
      ended = true;
    } else {
      EXPECT_EQ(frames[1].to_string(), "kv@p@m");
      EXPECT_GT(frames[3].size(), 0u);
      seqs.push_back(seq);
    }
  }
  EXPECT_TRUE(ended);
  EXPECT_EQ(seqs, (std::vector<uint64_t>{2, 3, 4, 5}));
  EXPECT_EQ(pub->Stats().replay_requests, 1u);
}

TEST(VllmKvEvents, ACacheManagerPublishesTokenIdsAndParents) {
  auto spec = ModelPreset("deepseek-v3.2-exp");
  ASSERT_TRUE(spec.ok());
  CacheManagerOptions mo;
  mo.block_tokens = 4;
  mo.capacity_blocks = 16;
  mo.metadata_only = true;
  mo.event_token_ids = true;
  auto manager = CacheManager::Create(*spec, mo);
  ASSERT_TRUE(manager.ok()) << manager.status().ToString();
  std::vector<KvEvent> seen;
  (*manager)->Subscribe([&](const KvEvent& e) { seen.push_back(e); });
  auto seq = (*manager)->CreateSequence({});
  ASSERT_TRUE(seq.ok());
  std::vector<TokenId> tokens{10, 11, 12, 13, 14, 15, 16, 17, 18};
  ASSERT_TRUE((*manager)->AppendTokens(*seq, tokens).ok());
  ASSERT_TRUE((*manager)->AllocateSlots(*seq, tokens.size()).ok());
  ASSERT_TRUE((*manager)->CommitComputed(*seq, tokens.size()).ok());
  ASSERT_FALSE(seen.empty());
  const KvEvent& e = seen.front();
  ASSERT_EQ(e.type, KvEventType::kBlocksStored);
  ASSERT_EQ(e.block_hashes.size(), 2u);
  EXPECT_EQ(e.token_ids, (std::vector<TokenId>{10, 11, 12, 13, 14, 15, 16, 17}));
  auto v = VllmKvEventPublisher::FromCacheEvent(e, "GPU");
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->medium, "GPU");
  EXPECT_EQ(v->block_size, 4u);
  EXPECT_EQ(v->token_ids.size(), 8u);
  ASSERT_TRUE(v->parent_block_hash.has_value());
  EXPECT_EQ(v->block_hashes[0], DigestOf(e.block_hashes[0]));
}

// Batch listeners see the same events as per-event listeners, in order with no gaps, and an
// unsubscribed one is never called again (nor kept alive by the manager).
TEST(VllmKvEvents, BatchListenersSeeWhatEventListenersSee) {
  auto spec = ModelPreset("deepseek-v3.2-exp");
  ASSERT_TRUE(spec.ok());
  CacheManagerOptions mo;
  mo.block_tokens = 4;
  mo.capacity_blocks = 8;
  mo.metadata_only = true;
  mo.event_token_ids = true;
  auto manager = CacheManager::Create(*spec, mo);
  ASSERT_TRUE(manager.ok());
  std::vector<KvEvent> each, batch_a, batch_b;
  (*manager)->Subscribe([&](const KvEvent& e) { each.push_back(e); });
  auto collect = [](std::vector<KvEvent>* out) {
    return [out](const KvEventRun& run) {
      for (size_t i = 0; i < run.events.size(); ++i) out->push_back(run.Event(i));
    };
  };
  (*manager)->SubscribeBatch(collect(&batch_a));
  auto token = std::make_shared<int>(0);
  const SubscriptionId b = (*manager)->SubscribeBatch([out = &batch_b, token](const KvEventRun& run) {
    for (size_t i = 0; i < run.events.size(); ++i) out->push_back(run.Event(i));
  });
  auto run_one = [&](TokenId base, size_t n) {
    auto seq = (*manager)->CreateSequence({});
    ASSERT_TRUE(seq.ok());
    std::vector<TokenId> tokens(n);
    for (size_t i = 0; i < n; ++i) tokens[i] = base + static_cast<TokenId>(i);
    ASSERT_TRUE((*manager)->AppendTokens(*seq, tokens).ok());
    ASSERT_TRUE((*manager)->AllocateSlots(*seq, n).ok());
    ASSERT_TRUE((*manager)->CommitComputed(*seq, n).ok());
    ASSERT_TRUE((*manager)->Free(*seq).ok());
  };
  for (TokenId r = 0; r < 6; ++r) run_one(1000 * r, 13);  // past the capacity: evictions
  (*manager)->Unsubscribe(b);
  EXPECT_EQ(token.use_count(), 1);  // the manager let go of the listener
  run_one(9000, 9);
  ASSERT_GT(each.size(), 6u);
  ASSERT_EQ(batch_a.size(), each.size());
  for (size_t i = 0; i < each.size(); ++i) {
    EXPECT_EQ(each[i].sequence_number, i + 1);
    EXPECT_EQ(batch_a[i].sequence_number, each[i].sequence_number);
    EXPECT_EQ(batch_a[i].type, each[i].type);
    EXPECT_EQ(batch_a[i].kinds, each[i].kinds);
    EXPECT_EQ(batch_a[i].block_hashes, each[i].block_hashes);
    EXPECT_EQ(batch_a[i].parent_hash, each[i].parent_hash);
    EXPECT_EQ(batch_a[i].token_ids, each[i].token_ids);
  }
  ASSERT_LT(batch_b.size(), each.size());  // nothing after Unsubscribe
  for (size_t i = 0; i < batch_b.size(); ++i) EXPECT_EQ(batch_b[i].sequence_number, each[i].sequence_number);
}

// The attached manager's events go out encoded straight from the manager's queue (no vLLM event
// built): each must be what FromCacheEvent gives for the same event, and every payload must be
// msgpack in its smallest forms (what msgpack-c and msgspec write), which re-packing the decoded
// object reproduces byte for byte. A V4 cache (window and snapshot pages lost alone are not
// published), evictions, a reset, token ids in every integer width, both hash encodings.
void CheckAttachedManager(KvEventHashEncoding hash) {
  auto spec = ModelPreset("deepseek-v4-flash");
  ASSERT_TRUE(spec.ok());
  CacheManagerOptions mo;
  mo.block_tokens = 128;
  mo.capacity_blocks = 24;
  mo.metadata_only = true;
  mo.event_token_ids = true;
  auto manager = CacheManager::Create(*spec, mo);
  ASSERT_TRUE(manager.ok()) << manager.status().ToString();
  VllmKvEventOptions o;
  o.endpoint = Endpoint("attach");
  o.hash = hash;
  o.max_batch_events = 3;  // several batches per tick
  auto pub = StartPublisher(o);
  Subscriber sub(o.endpoint);
  std::vector<KvEvent> seen;
  (*manager)->Subscribe([&](const KvEvent& e) { seen.push_back(e); });
  const SubscriptionId attached = pub->Attach(**manager, "GPU");
  // Tokens of every msgpack width: fixint, uint8, uint16, uint32.
  const uint32_t widths[] = {0, 1, 127, 128, 200, 255, 256, 40000, 65535, 65536, 129279, 0x7fffffffu, 0xffffffffu};
  for (uint32_t r = 0; r < 12; ++r) {
    auto seq = (*manager)->CreateSequence({});
    ASSERT_TRUE(seq.ok());
    std::vector<TokenId> tokens(128 * (3 + r % 4) + 5);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = i < 128 && r % 3 == 0 ? static_cast<TokenId>(i)  // a shared first block
                                       : widths[(i * 7 + r * 13) % std::size(widths)] ^ (r << 1);
    }
    ASSERT_TRUE((*manager)->AppendTokens(*seq, tokens).ok());
    ASSERT_TRUE((*manager)->AcquireCachedPrefix(*seq).ok());
    auto slots = (*manager)->AllocateSlots(*seq, tokens.size());
    ASSERT_TRUE(slots.ok()) << slots.status().ToString();
    ASSERT_TRUE((*manager)->CommitComputed(*seq, tokens.size()).ok());
    ASSERT_TRUE((*manager)->Free(*seq).ok());
  }
  ASSERT_TRUE((*manager)->Reset().ok());
  pub->Flush();
  (*manager)->Unsubscribe(attached);
  ASSERT_GT(pub->Stats().published_batches, 2u);

  std::vector<VllmKvEvent> expected;
  bool removed = false, cleared = false;
  for (const KvEvent& e : seen) {
    removed |= e.type == KvEventType::kBlocksRemoved;
    cleared |= e.type == KvEventType::kAllCleared;
    if (auto v = VllmKvEventPublisher::FromCacheEvent(e, "GPU")) expected.push_back(std::move(*v));
  }
  ASSERT_TRUE(removed);
  ASSERT_TRUE(cleared);
  size_t next = 0;
  while (next < expected.size()) {
    auto m = sub.Receive();
    ASSERT_TRUE(m.has_value()) << next << " of " << expected.size() << " events received";
    msgpack::object_handle oh = msgpack::unpack(m->payload.data(), m->payload.size());
    // Smallest forms: re-packing what was decoded gives the same bytes.
    msgpack::sbuffer again;
    msgpack::pack(again, oh.get());
    ASSERT_EQ(std::string(again.data(), again.size()), m->payload) << "batch " << m->seq;
    const msgpack::object& events = oh.get().via.array.ptr[1];
    for (uint32_t i = 0; i < events.via.array.size; ++i, ++next) {
      ASSERT_LT(next, expected.size());
      const std::vector<uint8_t> want = VllmKvEventPublisher::EncodeBatch(0, std::span(&expected[next], 1), hash, 0);
      msgpack::object_handle w = msgpack::unpack(reinterpret_cast<const char*>(want.data()), want.size());
      EXPECT_EQ(events.via.array.ptr[i], w.get().via.array.ptr[1].via.array.ptr[0]) << "event " << next;
    }
  }
}

TEST(VllmKvEvents, AnAttachedManagerSendsWhatFromCacheEventGivesInSmallestForms) {
  CheckAttachedManager(KvEventHashEncoding::kUint64);
}

TEST(VllmKvEvents, AnAttachedManagerSendsWhatFromCacheEventGivesAsBytes) {
  CheckAttachedManager(KvEventHashEncoding::kBytes);
}

// The reference encoder's integers too: token ids of every width re-pack to the same bytes.
TEST(VllmKvEvents, TokenIdsOfEveryWidthAreInSmallestForm) {
  VllmKvEvent e = Stored(1);
  e.token_ids = {0, 127, 128, 255, 256, 65535, 65536, 0xffffffffu};
  const std::vector<uint8_t> bytes = VllmKvEventPublisher::EncodeBatch(1.5, std::span(&e, 1), KvEventHashEncoding::kUint64, 0);
  msgpack::object_handle oh = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  msgpack::sbuffer again;
  msgpack::pack(again, oh.get());
  EXPECT_EQ(std::string(again.data(), again.size()), std::string(bytes.begin(), bytes.end()));
  EXPECT_EQ(Field(oh.get().via.array.ptr[1].via.array.ptr[0], "token_ids")->as<std::vector<uint32_t>>(), e.token_ids);
}

}  // namespace
}  // namespace sparsekv
